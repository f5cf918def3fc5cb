"""The ``torch`` backend: `torch.nn.functional.linear_cross_entropy` (chunked), per-token log-probabilities.

It gives ``logprobs = −CE`` only (no log-sum-exp, no entropy); ask the ``chunked`` backend for those.
Torch's kernel differentiates once: double backward through it is refused (`first_order_only`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_losses.heads.backend import HeadBackend, HeadConfig, register_backend, scatter_valid, valid_tokens
from lit_losses.heads.higher_order import first_order_only
from lit_losses.heads.output import HeadOutput

_INSTEAD = "use backend='chunked' or 'naive' for a loss you differentiate twice"


def torch_available() -> bool:
    """True when this PyTorch has `F.linear_cross_entropy` (not in 2.11 and before)."""
    return hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")


def torch_lce_logprobs(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, chunk_size: int | None
) -> Tensor:
    """Per-token log-probabilities ``−CE_t = log p_t[y_t]`` with torch's chunked implementation.

    Args:
        hidden: ``[n, D]`` hidden states.
        weight: ``[V, D]`` output projection.
        bias: optional ``[V]`` bias.
        targets: ``[n]`` token ids, all valid.
        chunk_size: torch's ``batch_chunk_size`` (``None``: torch's default).

    Returns:
        ``[n]`` log-probabilities, differentiable (once) with respect to ``hidden``, ``weight`` and ``bias``.

    Raises:
        RuntimeError: this PyTorch has no `F.linear_cross_entropy`.
    """
    if not torch_available():
        raise RuntimeError(
            f"backend 'torch' needs torch.nn.functional.linear_cross_entropy, which this PyTorch "
            f"({torch.__version__}) does not have. Use backend='chunked'."
        )
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_size)
    ce = F.linear_cross_entropy(hidden, weight, targets, linear_bias=bias, reduction="none", options=options)
    return first_order_only(-ce, "head backend 'torch' (F.linear_cross_entropy)", _INSTEAD)


def torch_per_token(
    head: HeadConfig, hidden: Tensor, targets: Tensor, outputs: tuple[str, ...]
) -> HeadOutput:
    """`torch_lce_logprobs` on the valid positions (the head's ``chunk_size`` as torch's chunk size),
    scattered back to the shape of ``targets`` (0 at ignored positions)."""
    valid, h, y = valid_tokens(hidden, targets, head.ignore_index)
    logprobs = torch_lce_logprobs(h, head.weight, head.bias, targets=y, chunk_size=head.chunk_size)
    logprobs = logprobs.to(torch.promote_types(logprobs.dtype, head.accum_dtype))  # low-precision operands
    return scatter_valid({"logprobs": logprobs}, outputs, valid)


#: The ``torch`` backend (log-probabilities only; no fused losses).
TORCH = register_backend(
    HeadBackend(
        name="torch",
        outputs=("logprobs",),
        per_token=torch_per_token,
        available=torch_available,
        description="torch.nn.functional.linear_cross_entropy (recent PyTorch), logprobs only",
    )
)
