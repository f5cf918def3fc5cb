"""`CorrectionBatch`: a rollout correction bound to one micro-batch — the weight of each valid token's
loss, and the sums of the correction's telemetry."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lit_losses.aggregation.stats import batch_segment_ids, sequence_ids
from lit_losses.errors import BatchKeyError
from lit_losses.objectives.correction import RolloutCorrection
from lit_losses.objectives.inputs import (
    ADVANTAGES,
    OLD_LOGPROBS,
    ROLLOUT_VALID,
    SAMPLING_LOGPROBS,
    SEQUENCE_INDEX,
    valid_values,
)
from lit_losses.objectives.mismatch import (
    ImportanceWeights,
    importance_weights,
    mismatch_terms,
    off_policy_keep,
)


def dense_sequence_index(batch: Mapping[str, Any], mask: Tensor) -> Tensor:
    """The sequence of each valid token of ``mask`` (row-major), numbered densely (`SEQUENCE_INDEX`)."""
    ids = sequence_ids(mask, batch_segment_ids(batch))[mask]
    return torch.unique(ids, return_inverse=True)[1]


def completion_mask(batch: Mapping[str, Any], mask: Tensor) -> Tensor:
    """The completion tokens before any rejection: ``batch["rollout_valid"]`` when a rejection added it,
    else ``mask`` (``labels != ignore_index``)."""
    original = batch.get(ROLLOUT_VALID)
    if original is None:
        return mask
    if not isinstance(original, Tensor) or original.dtype != torch.bool or original.shape != mask.shape:
        got = f"{original.dtype} {tuple(original.shape)}" if isinstance(original, Tensor) else type(original)
        raise ValueError(f"batch[{ROLLOUT_VALID!r}] must be a boolean tensor shaped like labels, got {got}")
    if bool((mask & ~original).any()):
        raise ValueError(
            f"batch[{ROLLOUT_VALID!r}] must hold every labelled position (it is the mask before a rejection)"
        )
    return original


class CorrectionBatch:
    """``w_t`` for the valid tokens ``[start, end)`` of one micro-batch, and the sums of the telemetry.

    With ``old_logprobs`` in the batch the weights are computed once, here, over the completion tokens
    before a rejection (verl computes a sequence's weight over its whole response); without them ``π_old``
    is the current policy detached and each call computes its range's weights. The off-policy mask always
    needs the current policy: it is computed per call (on whole sequences).

    Args:
        correction: the correction.
        batch: the micro-batch.
        mask: ``labels != ignore_index`` (after a rejection).
        dtype: the dtype of the computation.
        weight_inside: the base loss takes the importance weight in its own formula (``vespo``) instead
            of a multiplication of its loss.
        reader: who reads the batch keys, for messages.

    Example:
        >>> import torch
        >>> from lit_losses.objectives.correction import RolloutCorrection
        >>> batch = {"sampling_logprobs": torch.tensor([[-1.0, -2.0]]),
        ...          "old_logprobs": torch.tensor([[-1.0, -1.0]])}
        >>> correction = RolloutCorrection(rollout_is="token")
        >>> mask = torch.tensor([[True, True]])
        >>> on_batch = CorrectionBatch(correction, batch, mask=mask, dtype=torch.float64, weight_inside=False,
        ...                            reader="ppo")
        >>> on_batch(0, 2, torch.zeros(2, dtype=torch.float64), {})[0]  # exp(0), min(e, 2)
        tensor([1., 2.], dtype=torch.float64)
    """

    def __init__(
        self,
        correction: RolloutCorrection,
        batch: Mapping[str, Any],
        mask: Tensor,
        dtype: torch.dtype,
        weight_inside: bool,
        reader: str,
    ) -> None:
        self.correction = correction
        self.weight_inside = weight_inside
        self.sums = {
            name: torch.zeros((), dtype=dtype, device=mask.device) for name in correction.metric_names
        }
        self.weights: Tensor | None = None
        self.precomputed = correction.uses_old and OLD_LOGPROBS in batch
        if correction.rejects and OLD_LOGPROBS not in batch:
            raise BatchKeyError(
                f"{reader} rejects rollout tokens by π_old/π_rollout (rollout_rs) and reads batch key "
                f"{OLD_LOGPROBS!r}, which is missing; the batch has keys {sorted(batch)}"
            )
        if correction.rejects and ROLLOUT_VALID not in batch:
            raise ValueError(
                "rollout_rs changes the labels before the step's tokens are counted: pass the batch through "
                "Objective.reject (RegularizedLM and its GlobalStatsLoader do) before counting and the loss"
            )
        if self.precomputed:
            self._precompute(batch, mask, dtype=dtype, reader=reader)

    def _precompute(self, batch: Mapping[str, Any], mask: Tensor, dtype: torch.dtype, reader: str) -> None:
        original = completion_mask(batch, mask)
        old = valid_values(batch, OLD_LOGPROBS, original, reader=reader, dtype=dtype)
        log_ratio = old - valid_values(batch, SAMPLING_LOGPROBS, original, reader=reader, dtype=dtype)
        self._add_mismatch(log_ratio)
        kept = mask[original]
        if self.correction.weighted:
            index = dense_sequence_index(batch, original)
            weights = importance_weights(self.correction, log_ratio, index)
            self._add_weights(weights)
            self.weights = weights.weight[kept]
        if self.correction.rejects:
            self.sums["rollout_rs_masked_fraction"] += (~kept).sum()

    def _add_mismatch(self, log_ratio: Tensor) -> None:
        difference, k3 = mismatch_terms(log_ratio)
        self.sums["rollout_logprob_diff_mean"] += difference.sum()
        self.sums["rollout_k3_kl"] += k3.sum()
        if difference.numel():
            top = self.sums["rollout_logprob_diff_max"]
            self.sums["rollout_logprob_diff_max"] = torch.maximum(top, difference.max().to(top.dtype))

    def _add_weights(self, weights: ImportanceWeights) -> None:
        self.sums["rollout_is_weight_mean"] += weights.weight.sum()
        self.sums["rollout_is_truncated_fraction"] += weights.truncated.sum()
        self.sums["rollout_is_masked_fraction"] += weights.masked.sum()

    def __call__(
        self, start: int, end: int, logprobs: Tensor, inputs: Mapping[str, Tensor]
    ) -> tuple[Tensor | None, Tensor | None]:
        """``(m, w)`` for the tokens ``[start, end)``: ``m`` multiplies their loss (``None``: 1), ``w`` is the
        importance weight a base loss takes inside its formula (``None`` unless ``weight_inside``).
        ``inputs``: the base loss's inputs of the range (``old_logprobs``: ``π_old``)."""
        correction = self.correction
        weight = None
        if correction.weighted:
            weight = self.weights[start:end] if self.weights is not None else self._weights(inputs)
        elif correction.uses_old and not self.precomputed:
            self._add_mismatch(inputs[OLD_LOGPROBS] - inputs[SAMPLING_LOGPROBS])
        multiplier = None if self.weight_inside else weight
        if correction.off_policy_mask_threshold is not None:
            keep = off_policy_keep(
                correction.off_policy_mask_threshold,
                sampling=inputs[SAMPLING_LOGPROBS],
                logprobs=logprobs,
                advantages=inputs[ADVANTAGES],
                index=inputs[SEQUENCE_INDEX],
            )
            self.sums["off_policy_masked_fraction"] += (~keep).sum()
            mask = keep.to(logprobs.dtype)
            multiplier = mask if multiplier is None else mask * multiplier
        return multiplier, (weight if self.weight_inside else None)

    def _weights(self, inputs: Mapping[str, Tensor]) -> Tensor:
        log_ratio = inputs[OLD_LOGPROBS] - inputs[SAMPLING_LOGPROBS]
        self._add_mismatch(log_ratio)
        weights = importance_weights(self.correction, log_ratio, inputs.get(SEQUENCE_INDEX))
        self._add_weights(weights)
        return weights.weight
