"""The ``liger`` backend: Liger-Kernel's fused linear cross-entropy on CUDA (optional extra ``[liger]``).

Liger computes the gradients inside forward. Its ``reduction="none"`` mode scales them by a single
upstream value (Liger-Kernel issue #968, fixed only in recent releases by PR #1298), so this backend
is used only where that is exact: the plain cross-entropy ``Σ_t w·(−ℓ_t)`` with one weight ``w``
for every token (``token-mean`` / ``token-sum``), computed with ``reduction="sum"``. Per-token
outputs and per-token weights go to the ``chunked`` backend.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def liger_available() -> bool:
    """True when CUDA is available and `liger_kernel` imports."""
    if not torch.cuda.is_available():
        return False
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return False
    return True


def _liger_function() -> Any:
    if not torch.cuda.is_available():
        raise RuntimeError("backend 'liger' needs a CUDA device; on CPU use backend='chunked'")
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError as err:  # pragma: no cover - depends on the optional extra
        raise RuntimeError(
            "backend 'liger' needs the optional extra: pip install 'lit_losses[liger]'"
        ) from err
    return liger_fused_linear_cross_entropy


def liger_uniform_ce_sum(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, token_weight: float
) -> Tensor:
    """``token_weight · Σ_t CE_t`` over valid ``targets`` (all valid), gradients fused by Liger."""
    if hidden.device.type != "cuda":
        raise RuntimeError(f"backend 'liger' needs CUDA tensors, got hidden on {hidden.device}")
    fn = _liger_function()
    out = fn(hidden, weight, targets, bias=bias, reduction="sum")
    loss = out[0] if isinstance(out, tuple) else out
    return loss * token_weight
