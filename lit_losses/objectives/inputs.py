"""The batch keys of RL objectives and their checks: per-token float tensors aligned with ``labels``.

Position ``t`` of each describes the target ``labels[b, t]`` (0.0 where ``labels`` is ``ignore_index``):

==================  ==========================================================================
key                 meaning
==================  ==========================================================================
sampling_logprobs   ``log q(y_t)``: the log-probability of the label under the policy that sampled
                    it (Tinker's ``logprobs``)
advantages          ``A_t``: per-token advantage (a sequence's advantage broadcast over its tokens)
loss_weights        optional, Tinker's per-token ``weights`` (absent: 1 at every valid position)
sample_weights      optional, the per-sequence weight of ROLL's ``agg_loss(..., weights=)``, stored
                    per token (constant over a sequence's tokens, so that packing keeps it)
ref_logprobs        optional, reference-policy log-probabilities (the ``kl_reference`` regularizer)
old_logprobs        optional, ``log π_old(y_t)``: the trainer's log-probability of the label at the time
                    of sampling (recomputed by the trainer, where ``sampling_logprobs`` is the
                    inference engine's); the denominator of the policy-gradient ratio and, with
                    ``sampling_logprobs``, of the rollout corrections (`lit_losses.objectives.correction`)
==================  ==========================================================================
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from lit_losses.errors import BatchKeyError

SAMPLING_LOGPROBS = "sampling_logprobs"
"""Batch key: the sampler's log-probability of each token ``[B, T]``."""
ADVANTAGES = "advantages"
"""Batch key: the advantage of each token ``[B, T]``."""
LOSS_WEIGHTS = "loss_weights"
"""Batch key: a weight per token ``[B, T]`` multiplying the base loss."""
SAMPLE_WEIGHTS = "sample_weights"
"""Batch key: a weight per token ``[B, T]`` (one per sequence, repeated), multiplying the base loss."""
REF_LOGPROBS = "ref_logprobs"
"""Batch key: the reference policy's log-probability of each token ``[B, T]`` (the KL term's)."""
OLD_LOGPROBS = "old_logprobs"
"""Batch key: π_old's log-probability of each token ``[B, T]`` (the trainer's, beside the engine's)."""
RL_KEYS = (SAMPLING_LOGPROBS, ADVANTAGES, LOSS_WEIGHTS, SAMPLE_WEIGHTS, REF_LOGPROBS, OLD_LOGPROBS)
"""The per-token float keys of an RL micro-batch (padded with 0.0, packed like ``labels``)."""
SEQUENCE_INDEX = "sequence_index"
"""Not a batch key: the ``inputs`` entry of a base loss that is not pointwise, the sequence of each valid
token (a (row, segment) pair in packed rows), numbered densely from 0."""
ROLLOUT_IS_WEIGHTS = "rollout_is_weights"
"""Not a batch key: the ``inputs`` entry of a base loss that takes the rollout correction's importance
weight inside its own formula (``vespo``) instead of having its loss multiplied by it."""
ROLLOUT_VALID = "rollout_valid"
"""The boolean ``[B, T]`` batch key that the rejection of rollout tokens (verl's ``rollout_rs``) adds: the
labels mask before the rejection, counted by the loader so that the correction's telemetry is a mean
over every completion token, the rejected ones included."""


def token_values(batch: Mapping[str, Any], key: str, mask: Tensor, reader: str) -> Tensor:
    """``batch[key]`` checked as a per-token tensor aligned with ``labels`` (``mask``'s shape), finite at
    every valid position.

    Args:
        batch: the micro-batch.
        key: the batch key.
        mask: ``labels != ignore_index`` ``[B, T]``.
        reader: who reads it, for messages (``"base loss 'ppo'"``).

    Raises:
        BatchKeyError: the key is missing (the message names it, ``reader`` and the keys the batch has).
        ValueError: not a real-valued tensor, a shape other than ``labels``'s (both shapes named), or a
            NaN/Inf at a position with a label.

    Example:
        >>> import torch
        >>> mask = torch.tensor([[True, False]])
        >>> token_values({"advantages": torch.tensor([[0.5, float("nan")]])}, "advantages", mask, "ppo")
        tensor([[0.5000,    nan]])
        >>> token_values({"labels": mask}, "advantages", mask, "base loss 'ppo'")
        Traceback (most recent call last):
        ...
        lit_losses.errors.BatchKeyError: base loss 'ppo' reads batch key 'advantages', which is missing; ...
    """
    if key not in batch:
        raise BatchKeyError(
            f"{reader} reads batch key {key!r}, which is missing; the batch has keys {sorted(batch)}"
        )
    value = batch[key]
    if not isinstance(value, Tensor) or value.is_complex() or value.dtype == torch.bool:
        got = f"dtype {value.dtype}" if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"batch[{key!r}] read by {reader} must be a real-valued [B, T] tensor, got {got}")
    if value.shape != mask.shape:
        raise ValueError(
            f"batch[{key!r}] has shape {tuple(value.shape)} but batch['labels'] has shape "
            f"{tuple(mask.shape)}; {reader} reads one value per label"
        )
    if not bool(torch.isfinite(value[mask]).all()):
        bad = int((~torch.isfinite(value[mask])).sum())
        raise ValueError(
            f"batch[{key!r}] holds {bad} non-finite value(s) (NaN/Inf) at positions with a label"
        )
    return value


def valid_values(batch: Mapping[str, Any], key: str, mask: Tensor, reader: str, dtype: torch.dtype) -> Tensor:
    """`token_values` at the valid positions, row-major (the fused head's token order), in ``dtype``."""
    return token_values(batch, key, mask, reader=reader)[mask].to(dtype)


def check_provided(reads: Iterable[str], provided: Iterable[str], reader: str, source: str) -> None:
    """Refuse, before training, a key that ``reader`` reads and the data never provides.

    Args:
        reads: the batch keys read.
        provided: the keys of the data's micro-batches.
        reader: who reads them, as the option that configured it (``"model.base_loss='ppo'"``).
        source: the data, for messages (``"the data module (TextDataModule)"``).

    Raises:
        BatchKeyError: one line naming the key, the reader, the data and the keys it provides.

    Example:
        >>> check_provided(["advantages"], ["input_ids", "labels"], "model.base_loss='ppo'", "TextDataModule")
        Traceback (most recent call last):
        ...
        lit_losses.errors.BatchKeyError: model.base_loss='ppo' reads batch key 'advantages', which ...
    """
    provided = set(provided)
    for key in reads:
        if key not in provided:
            raise BatchKeyError(
                f"{reader} reads batch key {key!r}, which {source} never provides; its micro-batches have "
                f"keys {sorted(provided)}"
            )
