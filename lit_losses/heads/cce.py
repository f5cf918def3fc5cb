"""The ``cce`` backend: Apple's cut-cross-entropy on CUDA, per-token log-probabilities and the plain
cross-entropy (optional extra ``[cce]``).

The call is the public ``cut_cross_entropy.linear_cross_entropy(h, W, y, ignore_index=..., reduction="none",
shift=False, filter_eps=None, impl="cce")`` on the valid tokens only (ignored positions are removed before,
and get 0 and no gradient, like every backend's). What cut-cross-entropy 25.1.1 does, and what follows here:

* **Outputs.** Per-token ``nll`` (fp32; ``logprobs = −nll``). This release has no log-sum-exp output
  (``return_lse``) and no bias argument, so the backend gives ``logprobs`` only and refuses a head with a
  bias (`ValueError`); ask the ``chunked`` backend for ``lse``/``entropy``.
* **Shift.** ``shift=False`` is passed explicitly: with ``shift=True`` CCE would pair ``h_t`` with
  ``y_{t+1}`` itself, and the head's targets are already the labels of each position (a causal LM shifts
  them once, before the head).
* **Gradient filtering.** By default (``filter_eps="high"``) CCE's backward skips every ``[tokens ×
  vocabulary]`` block of the logit gradient whose entries ``|softmax − one_hot|`` are all below
  ``eps(dtype) / 32`` (about 2.4e-4 for bf16), and sorts the vocabulary by average logit to make such
  blocks likely: those blocks' contributions to both gradients are dropped. ``filter_eps=None`` is
  passed here, so every block is computed and the gradients are those of the loss.
* **Precision.** The forward's logits are bf16/fp16 products accumulated in fp32 (fp32 inputs would use
  TF32 under ``torch.backends.cuda.matmul`` precision "high"), the softmax in fp32; the target logit is a
  sum of bf16 products in fp32. CCE's backward takes bf16/fp16 hidden states only, so an fp32 (or
  float64) operand dtype is refused (`ValueError`). It accumulates the gradients of ``hidden`` (over
  vocabulary blocks) and of the weight (over token blocks) in the operand dtype, bf16, where the head's
  contract accumulates in fp32. Outputs are returned in ``promote(hidden, accum_dtype)`` (fp32).
* **Temperature.** CCE has none; the head applies its ``temperature`` before any backend
  (``(h / T) Wᵀ``, `HeadSettings.tempered`).
* **Gradients.** Backward takes any per-token upstream gradient, so per-token token weights are exact
  (``fused_ce_weights="any"``). First-order only: double backward is refused (`first_order_only`).

``backend="auto"`` never picks it: its gradients are accumulated in bf16 (not at the head's precision
contract), it has no bias, and it takes bf16/fp16 operands only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_losses.heads import peer_kernels
from lit_losses.heads.backend import HeadBackend, HeadConfig, register_backend, scatter_valid, valid_tokens
from lit_losses.heads.output import HeadOutput

NAME = "cce"
_INSTALL = "lit_losses[cce]"
_OPERANDS = (torch.bfloat16, torch.float16)


def cce_available() -> bool:
    """True when CUDA is available and `cut_cross_entropy` imports (the optional extra ``[cce]``)."""
    return torch.cuda.is_available() and peer_kernels.module_importable("cut_cross_entropy")


def cce_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """``log p_t[y_t]`` of ``softmax(h Wᵀ)`` with cut-cross-entropy, gradient filtering off.

    Args:
        hidden: ``[n, D]`` hidden states (CUDA, bf16 or fp16).
        weight: ``[V, D]`` output projection.
        targets: ``[n]`` token ids (positions equal to ``ignore_index`` get 0).
        ignore_index: target value of positions without a label.

    Returns:
        ``[n]`` fp32 log-probabilities, differentiable once with respect to ``hidden`` and ``weight`` for any
        upstream gradient.

    Raises:
        RuntimeError: not on CUDA, or cut-cross-entropy not installed.
        ValueError: ``hidden`` not in bf16/fp16 (CCE's backward takes nothing else).
    """
    peer_kernels.require_cuda(NAME, hidden)
    peer_kernels.require_dtype(NAME, hidden, torch.float32, dtypes=_OPERANDS)
    cce = peer_kernels.import_peer(NAME, "cut_cross_entropy", _INSTALL)
    nll = cce.linear_cross_entropy(
        hidden,
        weight,
        targets,
        ignore_index=ignore_index,
        reduction="none",
        shift=False,
        filter_eps=None,
        impl="cce",
    )
    return peer_kernels.kernel_output(NAME, -nll)


def _valid_logprobs(head: HeadConfig, h: Tensor, y: Tensor) -> Tensor:
    """``[n]`` log-probabilities of the valid tokens ``h``, ``y``, in ``promote(h, accum_dtype)``."""
    out_dtype = peer_kernels.check_operands(
        NAME, h, head.bias, accum_dtype=head.accum_dtype, dtypes=_OPERANDS
    )
    if h.shape[0] == 0:
        return peer_kernels.empty_rows(h, head.weight, out_dtype)
    return cce_logprobs(h, head.weight, y, ignore_index=head.ignore_index).to(out_dtype)


def cce_per_token(head: HeadConfig, hidden: Tensor, targets: Tensor, outputs: tuple[str, ...]) -> HeadOutput:
    """`cce_logprobs` on the valid positions, scattered back to the shape of ``targets`` (0 elsewhere)."""
    valid, h, y = valid_tokens(hidden, targets, head.ignore_index)
    return scatter_valid({"logprobs": _valid_logprobs(head, h, y)}, outputs, valid)


def cce_weighted_ce(head: HeadConfig, h: Tensor, y: Tensor, token_weights: Tensor | float) -> Tensor:
    """``Σ_t w_t · (−log p_t[y_t])`` of the valid tokens ``h [n, D]``, ``y [n]`` with cut-cross-entropy
    (one float or ``[n]`` weights; exact for both, the upstream gradient being per token)."""
    logprobs = _valid_logprobs(head, h, y)
    w = token_weights.to(logprobs.dtype) if isinstance(token_weights, Tensor) else float(token_weights)
    return -(w * logprobs).sum()


#: The ``cce`` backend: per-token log-probabilities and the plain cross-entropy with cut-cross-entropy, on
#: CUDA, bf16/fp16 operands, no bias; never picked by ``auto`` (see the module docstring).
CCE = register_backend(
    HeadBackend(
        name=NAME,
        outputs=("logprobs",),
        per_token=cce_per_token,
        fused_ce=cce_weighted_ce,
        fused_ce_weights="any",
        cuda_only=True,
        available=cce_available,
        description="Apple cut-cross-entropy (CUDA, [cce]): logprobs and plain CE, bf16/fp16, no bias",
    )
)
