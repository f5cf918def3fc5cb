"""What a head returns, and the validation every backend shares."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lit_losses.validation import check_finite_weight, finite_sum

#: The per-token outputs a head can give.
HEAD_OUTPUTS = ("logprobs", "lse", "entropy")
"""The per-token outputs a head call can give (`HeadOutput`'s fields)."""


@dataclass
class HeadOutput:
    """Per-token quantities of the output distribution ``p = softmax(z)``, ``z = h Wᵀ + b``.

    Each field is shaped like the targets and is ``None`` unless requested. At ignored positions
    (``target == ignore_index``) every field is 0 and receives no gradient.

    Attributes:
        logprobs: ``log p[target] = z[target] − lse``.
        lse: ``log Σ_v exp(z_v)``.
        entropy: ``H = −Σ_v p_v log p_v = lse − Σ_v p_v z_v``.

    Example:
        >>> import torch
        >>> from lit_losses.heads import FusedLMHead, HeadOutput
        >>> weight = torch.zeros(4, 2)  # V = 4 equal logits: p = 1/4 for every token
        >>> out = FusedLMHead(weight)(torch.ones(3, 2), torch.tensor([0, -100, 3]), ("logprobs", "entropy"))
        >>> isinstance(out, HeadOutput), out.lse is None
        (True, True)
        >>> torch.allclose(out.logprobs, torch.tensor([-1.0, 0.0, -1.0]) * torch.log(torch.tensor(4.0)))
        True
        >>> out.entropy.tolist() == [out.entropy[0].item(), 0.0, out.entropy[0].item()]
        True
    """

    logprobs: Tensor | None = None
    lse: Tensor | None = None
    entropy: Tensor | None = None


def normalize_outputs(outputs: str | Sequence[str]) -> tuple[str, ...]:
    """Validate the requested head outputs; a single name is accepted.

    Args:
        outputs: one name or a sequence of names among `HEAD_OUTPUTS`.

    Returns:
        The names as a tuple.

    Raises:
        ValueError: an unknown name, or none at all.
    """
    requested = (outputs,) if isinstance(outputs, str) else tuple(outputs)
    unknown = [o for o in requested if o not in HEAD_OUTPUTS]
    if unknown or not requested:
        raise ValueError(f"unknown head output(s) {unknown or requested!r}; choose among {HEAD_OUTPUTS}")
    return requested


def check_head_inputs(
    hidden: Tensor,
    targets: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    ignore_index: int,
    check_finite: bool,
) -> None:
    """Raise a clear error for inputs that would otherwise fail deep inside a kernel (or silently).

    Args:
        hidden: ``[..., D]`` hidden states.
        targets: ``[...]`` int64/int32 token ids in ``[0, V)`` or ``ignore_index``.
        weight: ``[V, D]`` output projection.
        bias: ``[V]`` or ``None``.
        ignore_index: target value of positions without a label.
        check_finite: also require finite hidden states (one reduction over ``hidden``).

    Raises:
        ValueError: mismatched shapes, a bad target dtype or value, or non-finite hidden states; the
            message names the offending shapes or value.
    """
    if hidden.dim() == 0 or hidden.shape[-1] == 0:
        raise ValueError(
            f"hidden states of shape {tuple(hidden.shape)} have no width: the head needs [..., D] with D >= 1"
        )
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"hidden width {hidden.shape[-1]} (hidden.shape={tuple(hidden.shape)}) does not match the output "
            f"weight width {weight.shape[-1]} (weight.shape={tuple(weight.shape)})"
        )
    if weight.dim() != 2:
        raise ValueError(f"the output weight must be [V, D], got shape {tuple(weight.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias shape {tuple(bias.shape)} does not match weight rows V={weight.shape[0]}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} does not match "
            f"hidden.shape[:-1]={tuple(hidden.shape[:-1])}"
        )
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be int64 or int32 token ids, got dtype {targets.dtype}")
    if not _values_pass(hidden, targets, weight, ignore_index=ignore_index, check_finite=check_finite):
        _refuse_values(hidden, targets, weight, ignore_index=ignore_index, check_finite=check_finite)
    elif check_finite and not _folds_weight(weight, hidden):
        check_finite_weight(weight)


def _folds_weight(weight: Tensor, hidden: Tensor) -> bool:
    """Whether `_values_pass` reads the weight's finiteness with the other checks: a plain tensor on the
    hidden states' device (a subclass such as a DTensor, or a weight elsewhere, is checked on its own)."""
    return type(weight) in (Tensor, torch.nn.Parameter) and weight.device == hidden.device


def _out_of_range(targets: Tensor, vocab_size: int, ignore_index: int) -> Tensor:
    """Where a target is neither ``ignore_index`` nor a token id in ``[0, vocab_size)``."""
    return (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))


def _values_pass(
    hidden: Tensor, targets: Tensor, weight: Tensor, ignore_index: int, check_finite: bool
) -> bool:
    """Whether every value check of `check_head_inputs` passes, read from the device once (one host
    synchronization on CUDA per head call, where a read per check would stall the queue each time). The
    finiteness checks are sums being finite (`finite_sum`: no temporary of the tensor's size; a sum that
    overflows sends the call to `_refuse_values`, which checks element by element), the weight's folded in
    where `_folds_weight`."""
    with torch.no_grad():
        ok = ~_out_of_range(targets, weight.shape[0], ignore_index).any()
        if check_finite:
            ok &= torch.isfinite(finite_sum(hidden))
            if _folds_weight(weight, hidden):
                ok &= torch.isfinite(finite_sum(weight))
        return bool(ok)


def _refuse_values(
    hidden: Tensor, targets: Tensor, weight: Tensor, ignore_index: int, check_finite: bool
) -> None:
    """Each value check of `check_head_inputs` on its own, raising for the first that fails (a weight whose
    sum merely overflows passes)."""
    V = weight.shape[0]
    bad = _out_of_range(targets, V, ignore_index)
    if bool(bad.any()):
        value = int(targets[bad].flatten()[0])
        raise ValueError(
            f"target {value} is out of range for vocabulary size V={V} "
            f"(valid: 0..{V - 1}, or ignore_index={ignore_index})"
        )
    if check_finite:
        check_finite_weight(weight)
    if check_finite and not bool(torch.isfinite(hidden).all()):
        n_bad = int((~torch.isfinite(hidden)).sum())
        raise ValueError(
            f"hidden states contain {n_bad} non-finite value(s) (NaN/Inf) before the output head; "
            "pass check_finite=False to skip this check (model.init_args.check_finite=false from the CLI; a "
            "TrainingController skips such steps and lets its rules act)"
        )
