"""What a head returns, and the validation every backend shares."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lit_losses.validation import all_finite, check_finite_weight, finite_sum

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
    token_weights: Tensor | None = None,
) -> None:
    """Raise a clear error for inputs that would otherwise fail deep inside a kernel (or silently).

    Args:
        hidden: ``[..., D]`` hidden states.
        targets: ``[...]`` int64/int32 token ids in ``[0, V)`` or ``ignore_index``.
        weight: ``[V, D]`` output projection.
        bias: ``[V]`` or ``None``.
        ignore_index: target value of positions without a label.
        check_finite: also require finite hidden states, weight and ``token_weights``.
        token_weights: per-token weights shaped like ``targets`` (their shape checked by the caller), or
            ``None``.

    The value checks (targets in range, finiteness) are read from the device at once: one host
    synchronization on CUDA.

    Raises:
        ValueError: mismatched shapes, a bad target dtype or value, or non-finite hidden states, weight or
            token weights; the message names the offending shapes or value.
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
    values = _Values(
        hidden,
        targets,
        weight,
        ignore_index=ignore_index,
        check_finite=check_finite,
        token_weights=token_weights,
    )
    if not values.pass_at_once():
        values.refuse()
        return
    for tensor, check in ((weight, check_finite_weight), (token_weights, check_finite_token_weights)):
        if check_finite and tensor is not None and not _folds(tensor, hidden):
            check(tensor)


def check_finite_token_weights(token_weights: Tensor) -> None:
    """Refuse per-token weights holding NaN/Inf, naming how many and the first position.

    Example:
        >>> check_finite_token_weights(torch.tensor([1.0, float("nan")]))
        Traceback (most recent call last):
        ...
        ValueError: token_weights hold 1 non-finite value(s) (NaN/Inf), e.g. at position (1,)
    """
    if not all_finite([token_weights]):
        bad = ~torch.isfinite(token_weights)
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"token_weights hold {int(bad.sum())} non-finite value(s) (NaN/Inf), e.g. at position {first}"
        )


def _folds(tensor: Tensor, hidden: Tensor) -> bool:
    """Whether `_Values.pass_at_once` reads ``tensor``'s finiteness with the other checks: a plain tensor on
    the hidden states' device (a subclass such as a DTensor, or a tensor elsewhere, is checked on its own)."""
    return type(tensor) in (Tensor, torch.nn.Parameter) and tensor.device == hidden.device


def _out_of_range(targets: Tensor, vocab_size: int, ignore_index: int) -> Tensor:
    """Where a target is neither ``ignore_index`` nor a token id in ``[0, vocab_size)``."""
    return (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))


@dataclass
class _Values:
    """The value checks of one `check_head_inputs` call: targets in range and, with ``check_finite``, finite
    hidden states, weight and token weights."""

    hidden: Tensor
    targets: Tensor
    weight: Tensor
    ignore_index: int
    check_finite: bool
    token_weights: Tensor | None

    def pass_at_once(self) -> bool:
        """Whether every check passes, read from the device once (one host synchronization on CUDA per
        head call, where a read per check would stall the queue each time). The finiteness checks are sums
        being finite (`finite_sum`: no temporary of the tensor's size; a sum that overflows sends the call
        to `refuse`, which checks element by element); the weight's and token weights' only where they
        `_folds`."""
        with torch.no_grad():
            ok = ~_out_of_range(self.targets, self.weight.shape[0], self.ignore_index).any()
            if self.check_finite:
                folded = (
                    t for t in (self.weight, self.token_weights) if t is not None and _folds(t, self.hidden)
                )
                for tensor in (self.hidden, *folded):
                    ok &= torch.isfinite(finite_sum(tensor))
            return bool(ok)

    def refuse(self) -> None:
        """Each check on its own, raising for the first that fails (a weight or token weights whose sum
        merely overflows pass)."""
        V = self.weight.shape[0]
        bad = _out_of_range(self.targets, V, self.ignore_index)
        if bool(bad.any()):
            value = int(self.targets[bad].flatten()[0])
            raise ValueError(
                f"target {value} is out of range for vocabulary size V={V} "
                f"(valid: 0..{V - 1}, or ignore_index={self.ignore_index})"
            )
        if not self.check_finite:
            return
        check_finite_weight(self.weight)
        if not bool(torch.isfinite(self.hidden).all()):
            n_bad = int((~torch.isfinite(self.hidden)).sum())
            raise ValueError(
                f"hidden states contain {n_bad} non-finite value(s) (NaN/Inf) before the output head; "
                "pass check_finite=False to skip this check (model.init_args.check_finite=false from the "
                "CLI; a TrainingController skips such steps and lets its rules act)"
            )
        if self.token_weights is not None:
            check_finite_token_weights(self.token_weights)
