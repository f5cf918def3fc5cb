"""verl's rejection sampling of rollout tokens as a change of the labels, made before a step is counted.

verl's ``rollout_rs`` replaces the response mask by ``response_mask × keep``: a rejected token leaves the
loss's numerator *and* its denominators (the token count, and the sequence count when every token of a
sequence goes). Here the denominators are the step's global counts, which `GlobalStatsLoader` takes from
the labels before the first micro-batch runs; ``keep`` depends only on log-probabilities stored in the
batch (``old_logprobs`` and ``sampling_logprobs``), so it is computed there, before the counting: the
rejected tokens get ``ignore_index`` as label, and the batch keeps the labels mask of before under
``rollout_valid`` (for the telemetry's means over every completion token). `RegularizedLM` hands
`BoundBaseLoss.reject` to its `GlobalStatsLoader` and applies it to the batches of other loaders.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lit_losses.aggregation.stats import batch_segment_ids, sequence_ids
from lit_losses.errors import BatchKeyError
from lit_losses.objectives.correction import RolloutCorrection
from lit_losses.objectives.inputs import OLD_LOGPROBS, ROLLOUT_VALID, SAMPLING_LOGPROBS, token_values
from lit_losses.objectives.mismatch import rejection_keep


def reject_rollouts(
    batch: Mapping[str, Any], correction: RolloutCorrection, ignore_index: int, reader: str
) -> dict[str, Any]:
    """``batch`` with ``labels`` set to ``ignore_index`` where ``correction.rejection`` rejects the token,
    and ``rollout_valid``, the labels mask before; a batch that has ``rollout_valid`` already is returned
    as it is (the rejection is applied once).

    The divergences are computed in float64 from ``log ρ_t = old_logprobs − sampling_logprobs`` over the
    labelled tokens, a sequence being a row or a (row, segment) pair in packed rows
    (`lit_losses.objectives.mismatch.rejection_keep`).

    Raises:
        BatchKeyError: the batch lacks ``old_logprobs`` or ``sampling_logprobs``.

    Example:
        >>> import torch
        >>> from lit_losses.objectives.correction import RejectionCriterion, RolloutCorrection
        >>> correction = RolloutCorrection(rejection=(RejectionCriterion("token_k2", upper=0.02),))
        >>> batch = {"labels": torch.tensor([[4, 5, -100]]),
        ...          "sampling_logprobs": torch.tensor([[-1.0, -1.0, 0]]),
        ...          "old_logprobs": torch.tensor([[-1.1, -1.5, 0]])}
        >>> out = reject_rollouts(batch, correction, -100, reader="ppo")
        >>> out["labels"].tolist(), out["rollout_valid"].tolist()  # ½·0.5² > 0.02
        ([[4, -100, -100]], [[True, True, False]])
    """
    if ROLLOUT_VALID in batch:
        return dict(batch)
    labels = batch["labels"]
    mask = labels != ignore_index
    for key in (OLD_LOGPROBS, SAMPLING_LOGPROBS):
        if key not in batch:
            raise BatchKeyError(
                f"{reader} rejects rollout tokens by π_old/π_rollout (rollout_rs) and reads batch key "
                f"{key!r}, which is missing; the batch has keys {sorted(batch)}"
            )
    old = token_values(batch, OLD_LOGPROBS, mask, reader=reader)[mask].double()
    log_ratio = old - token_values(batch, SAMPLING_LOGPROBS, mask, reader=reader)[mask].double()
    index = torch.unique(sequence_ids(mask, batch_segment_ids(batch))[mask], return_inverse=True)[1]
    keep = rejection_keep(correction.rejection, log_ratio, index)
    rejected = torch.zeros_like(mask)
    rejected[mask] = ~keep
    return {**batch, "labels": labels.masked_fill(rejected, ignore_index), ROLLOUT_VALID: mask}
