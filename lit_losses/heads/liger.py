"""The ``liger`` backend: Liger-Kernel's fused linear cross-entropy on CUDA (optional extra ``[liger]``).

Liger computes the gradients inside forward. Its ``reduction="none"`` mode scales them by a single
upstream value (Liger-Kernel issue #968, fixed only in recent releases by PR #1298), so this backend
is used only where that is exact: the plain cross-entropy ``Σ_t w·(−ℓ_t)`` with one weight ``w``
for every token (``token-mean`` / ``token-sum``), computed with ``reduction="sum"``. With
``backend="auto"`` per-token outputs and per-token weights go to the ``chunked`` backend; with
``backend="liger"`` they are refused (`ValueError`) and pointwise losses are computed by ``chunked``.

Liger's kernel computes the logits in the dtype of its inputs and the softmax in fp32; `FusedLMHead`
hands it hidden states and weight in the head's operand dtype (`lit_losses.heads.precision`: bf16 under
``bf16-mixed``/``bf16-true`` on CUDA with the default ``matmul_precision="auto"``, fp32 with ``full``).
The loss is returned in ``promote(hidden, fp32)``, like every backend's. Its gradients are first-order
only (double backward is refused).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor

from lit_losses.heads.backend import HeadBackend, HeadConfig, register_backend
from lit_losses.heads.higher_order import first_order_only


def liger_available() -> bool:
    """True when CUDA is available and `liger_kernel` imports (the optional extra ``[liger]``)."""
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
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    token_weight: float,
    accum_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """``token_weight · Σ_t CE_t`` with Liger's fused linear cross-entropy (``reduction="sum"``).

    Args:
        hidden: ``[n, D]`` hidden states (CUDA).
        weight: ``[V, D]`` output projection.
        bias: optional ``[V]`` bias.
        targets: ``[n]`` token ids, all valid.
        token_weight: the one weight of every token.
        accum_dtype: dtype of Liger's weight- and bias-gradient accumulators (passed where this Liger
            release takes it: otherwise they follow the weight's dtype, bf16 under bf16 operands).

    Returns:
        The scalar loss; Liger computes its gradients in forward.

    Raises:
        RuntimeError: ``hidden`` is not on CUDA, or `liger_kernel` is not installed.
    """
    if hidden.device.type != "cuda":
        raise RuntimeError(f"backend 'liger' needs CUDA tensors, got hidden on {hidden.device}")
    fn = _liger_function()
    accum = {"accum_dtype": accum_dtype} if "accum_dtype" in inspect.signature(fn).parameters else {}
    out = fn(hidden, weight, targets, bias=bias, reduction="sum", **accum)
    loss = out[0] if isinstance(out, tuple) else out
    loss = first_order_only(
        loss, "head backend 'liger'", "use backend='chunked' for a loss you differentiate twice"
    )
    return loss.to(torch.promote_types(hidden.dtype, torch.float32)) * token_weight


def liger_weighted_ce(head: HeadConfig, h: Tensor, y: Tensor, token_weights: Tensor | float) -> Tensor:
    """The plain cross-entropy of valid tokens ``h [n, D]``, ``y [n]`` with one weight for every token
    (`liger_uniform_ce_sum`; per-token weights are refused earlier, by `select_backend`)."""
    accum = torch.promote_types(head.weight.dtype, head.accum_dtype)
    return liger_uniform_ce_sum(
        h, head.weight, head.bias, targets=y, token_weight=float(token_weights), accum_dtype=accum
    )


#: The ``liger`` backend: the plain-CE fast path with one weight for every token, on CUDA. ``auto`` takes it
#: there when `liger_kernel` is installed; it gives no per-token outputs, and pointwise losses asked of it
#: go to the ``chunked`` backend.
LIGER = register_backend(
    HeadBackend(
        name="liger",
        fused_ce=liger_weighted_ce,
        fused_ce_weights="uniform",
        cuda_only=True,
        auto_ce=True,
        available=liger_available,
        description="Liger-Kernel fused linear CE (CUDA, [liger] extra), one weight for every token only",
    )
)
