"""The ``torch`` backend: `torch.nn.functional.linear_cross_entropy` (chunked), per-token log-probabilities.

It gives ``logprobs = −CE`` only (no log-sum-exp, no entropy); ask the ``chunked`` backend for those.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def torch_available() -> bool:
    """True when this PyTorch has `F.linear_cross_entropy` (2.10+)."""
    return hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")


def torch_lce_logprobs(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, chunk_size: int | None
) -> Tensor:
    """Per-token log-probabilities of valid ``targets`` (all valid) with torch's chunked implementation."""
    if not torch_available():
        raise RuntimeError(
            f"backend 'torch' needs torch.nn.functional.linear_cross_entropy (torch>=2.10); this is "
            f"torch {torch.__version__}. Use backend='chunked'."
        )
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_size)
    ce = F.linear_cross_entropy(hidden, weight, targets, linear_bias=bias, reduction="none", options=options)
    return -ce
