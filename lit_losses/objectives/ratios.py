"""Importance ratios of the policy-gradient base losses: per token, or per sequence (GSPO).

The ratio's denominator ``q_t`` is `old_logprobs` of the inputs: ``π_old``, the batch's ``old_logprobs``
when it has them (or the current policy detached under a rollout correction without them), else the
sampler's ``sampling_logprobs`` (Tinker's definition). ``importance_sampling_level: token`` keeps
``log r_t = ℓ_t − q_t``; ``sequence`` gives every token of a
sequence ``s`` the sequence's ratio ``log r_s = mean_{u∈s} (ℓ_u − q_u)`` over its valid tokens (GSPO,
"Group Sequence Policy Optimization"; TRL's and Liger-Kernel's ``importance_sampling_level="sequence"``).
A sequence is a row, or a (row, segment) pair in packed rows. A base loss with sequence-level ratios is
not pointwise: it takes the general path, one call per micro-batch (whole sequences are never split
across micro-batches, so its value does not depend on the split).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from lit_losses.objectives.inputs import OLD_LOGPROBS, SAMPLING_LOGPROBS, SEQUENCE_INDEX

ImportanceSamplingLevel = Literal["token", "sequence"]
"""Where the importance ratio is formed: each token's own, or its sequence's geometric mean (GSPO)."""


def token_level(params: Mapping[str, Any]) -> bool:
    """Whether bound parameters keep token-level ratios (the base loss is then pointwise)."""
    return params.get("importance_sampling_level", "token") == "token"


def sequence_sum(values: Tensor, index: Tensor) -> Tensor:
    """``Σ_{u∈s} values_u`` at every token of sequence ``s`` (``index``: `SEQUENCE_INDEX`), differentiable.

    Example:
        >>> import torch
        >>> sequence_sum(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([0, 0, 1]))
        tensor([3., 3., 4.])
    """
    size = int(index.max()) + 1 if index.numel() else 0
    sums = values.new_zeros(size).index_add(0, index, values)
    return sums[index]


def sequence_mean(values: Tensor, index: Tensor) -> Tensor:
    """``mean_{u∈s} values_u`` at every token of sequence ``s`` (differentiable).

    Example:
        >>> import torch
        >>> sequence_mean(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([0, 0, 1]))
        tensor([1.5000, 1.5000, 4.0000])
    """
    counts = torch.bincount(index, minlength=int(index.max()) + 1 if index.numel() else 0)
    return sequence_sum(values, index) / counts[index].to(values.dtype)


def old_logprobs(inputs: Mapping[str, Tensor]) -> Tensor:
    """The ratio's denominator: ``inputs["old_logprobs"]`` when given, else ``inputs["sampling_logprobs"]``.

    Example:
        >>> import torch
        >>> old_logprobs({"sampling_logprobs": torch.tensor([-1.0]), "old_logprobs": torch.tensor([-0.5])})
        tensor([-0.5000])
    """
    return inputs[OLD_LOGPROBS] if OLD_LOGPROBS in inputs else inputs[SAMPLING_LOGPROBS]


def log_ratio(logprobs: Tensor, inputs: Mapping[str, Tensor], level: ImportanceSamplingLevel) -> Tensor:
    """``log r`` at each token: ``ℓ_t − q_t`` (``token``) or its sequence's mean (``sequence``), ``q_t``
    from `old_logprobs`."""
    per_token = logprobs - old_logprobs(inputs)
    if level == "token":
        return per_token
    if SEQUENCE_INDEX not in inputs:
        raise ValueError(
            "importance_sampling_level='sequence' needs whole sequences: the base loss was called without "
            f"inputs[{SEQUENCE_INDEX!r}] (a pointwise call, e.g. chunk by chunk inside the fused head)"
        )
    return sequence_mean(per_token, inputs[SEQUENCE_INDEX])
