"""The weights and masks of the rollout corrections (`lit_losses.objectives.correction`), computed as their
sources compute them, on the valid tokens of a micro-batch.

Inputs are 1-D, one entry per valid token (row-major, the fused head's order): ``log_ratio`` ``log ρ_t =
o_t − q_t`` (π_old over π_rollout), and ``index`` the token's sequence (`SEQUENCE_INDEX`, dense from 0).
Sums over a sequence run over its valid tokens, as TRL's and verl's masked sums do.

- `importance_weights`: TRL's ``_generate_and_score_completions`` (``vllm_importance_sampling_mode``) or
  verl's ``compute_rollout_correction_weights`` (``rollout_is``, detached, without batch normalization).
- `rejection_keep`: verl's ``compute_rollout_rejection_mask`` (``rollout_rs``: every criterion must pass).
- `off_policy_keep`: TRL's ``get_off_policy_mask`` (DeepSeek-V3.2's off-policy sequence masking).
- `mismatch_terms`: the per-token telemetry of the mismatch (TRL's ``sampling_logp_difference`` and
  verl's ``k3_kl``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lit_losses.objectives.correction import RejectionCriterion, RolloutCorrection
from lit_losses.objectives.ratios import sequence_sum

SAFETY_BOUND = 20.0
"""verl's clamp of a log-ratio before it is exponentiated (``exp(±20)``)."""
VERL_MEAN_EPS = 1e-8
"""verl's ``masked_mean`` divides by ``count + 1e-8``."""


@dataclass
class ImportanceWeights:
    """The importance weight of each token, and which tokens its bounds truncated or masked (to 0)."""

    weight: Tensor
    truncated: Tensor
    masked: Tensor


def sequence_count(index: Tensor, like: Tensor) -> Tensor:
    """The number of valid tokens of each token's sequence, in ``like``'s dtype."""
    counts = torch.bincount(index, minlength=int(index.max()) + 1 if index.numel() else 0)
    return counts[index].to(like.dtype)


def sequence_max(values: Tensor, index: Tensor) -> Tensor:
    """``max_{u∈s} values_u`` at every token of sequence ``s``."""
    size = int(index.max()) + 1 if index.numel() else 0
    out = values.new_full((size,), -math.inf).scatter_reduce(0, index, values, reduce="amax")
    return out[index]


def importance_weights(
    correction: RolloutCorrection, log_ratio: Tensor, index: Tensor | None
) -> ImportanceWeights:
    """The correction's importance weight ``w_t`` (no gradient).

    TRL: ``ρ = exp(log ρ_t)`` per token or ``exp(Σ_{u∈s} log ρ_u)`` per sequence; ``*_truncate``:
    ``clamp(ρ, C_min, C_max)``; ``*_mask``: ``ρ``, or 0 outside ``[C_min, C_max]``. verl: ``exp(clamp(log
    ρ_t, ±20))`` per token or ``exp(clamp(Σ_{u∈s} log ρ_u, ±20))`` per sequence, then ``min(·, threshold)``.

    Example:
        >>> import torch
        >>> from lit_losses.objectives.correction import RolloutCorrection
        >>> trl = RolloutCorrection(vllm_mode="token_mask", clip_min=0.5, clip_max=2.0)
        >>> importance_weights(trl, torch.tensor([0.0, 1.0, -1.0]), None).weight  # ρ = 1, e, 1/e
        tensor([1., 0., 0.])
    """
    log_ratio = log_ratio.detach()
    sequence = correction.level == "sequence"
    if sequence and index is None:
        raise ValueError(
            "a sequence-level rollout correction needs whole sequences: the base loss was called without "
            "inputs['sequence_index'] (a pointwise call, e.g. chunk by chunk inside the fused head)"
        )
    summed = sequence_sum(log_ratio, index) if sequence else log_ratio
    if correction.vllm_mode is not None:
        ratio = torch.exp(summed)
        low = -math.inf if correction.clip_min is None else correction.clip_min
        high = math.inf if correction.clip_max is None else correction.clip_max
        outside = (ratio < low) | (ratio > high)
        if correction.vllm_mode.endswith("truncate"):
            weight = torch.clamp(ratio, min=correction.clip_min, max=correction.clip_max)
            return ImportanceWeights(weight, truncated=outside, masked=torch.zeros_like(outside))
        return ImportanceWeights(
            ratio.masked_fill(outside, 0.0), truncated=torch.zeros_like(outside), masked=outside
        )
    ratio = torch.exp(summed.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    above = ratio > correction.rollout_is_threshold
    weight = ratio.clamp(max=correction.rollout_is_threshold)
    return ImportanceWeights(weight, truncated=above, masked=torch.zeros_like(above))


def rejection_statistic(criterion: RejectionCriterion, log_ratio: Tensor, index: Tensor) -> Tensor:
    """The divergence ``criterion`` thresholds, at every token (a sequence's statistic at each of its
    tokens): ``k1 = −log ρ``, ``k2 = ½ (log ρ)²``, ``k3 = exp(log ρ) − 1 − log ρ`` of the clamped ``log ρ``,
    the token's own or its sequence's sum, mean (``Σ / (n + 1e-8)``) or max."""
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}[criterion.divergence]
    level = criterion.level
    if level == "token":
        return per_token
    if level == "seq_max":
        return sequence_max(per_token, index)
    summed = sequence_sum(per_token, index)
    return summed if level == "seq_sum" else summed / (sequence_count(index, summed) + VERL_MEAN_EPS)


def rejection_keep(criteria: tuple[RejectionCriterion, ...], log_ratio: Tensor, index: Tensor) -> Tensor:
    """verl's rejection: ``True`` where every criterion keeps the token (a ``k1`` criterion keeps
    ``log lower ≤ k1 ≤ log upper``, the others ``statistic ≤ upper``).

    Example:
        >>> import torch
        >>> from lit_losses.objectives.correction import RejectionCriterion
        >>> keep = rejection_keep((RejectionCriterion("seq_mean_k3", upper=0.01),),
        ...                       torch.tensor([0.0, 0.01, 0.5, 0.0]), torch.tensor([0, 0, 1, 1]))
        >>> keep.tolist()  # the second sequence's mean k3 is 0.0487
        [True, True, False, False]
    """
    keep = torch.ones_like(log_ratio, dtype=torch.bool)
    for criterion in criteria:
        statistic = rejection_statistic(criterion, log_ratio.detach(), index)
        if criterion.divergence == "k1":
            assert criterion.lower is not None
            keep &= (statistic >= math.log(criterion.lower)) & (statistic <= math.log(criterion.upper))
        else:
            keep &= statistic <= criterion.upper
    return keep


def off_policy_keep(
    threshold: float, sampling: Tensor, logprobs: Tensor, advantages: Tensor, index: Tensor
) -> Tensor:
    """TRL's off-policy sequence mask: keep a token where ``A_t ≥ 0`` or its sequence's mean of ``q_u −
    ℓ_u`` (over its valid tokens, ``ℓ`` detached) is ``≤ δ``.

    Example:
        >>> import torch
        >>> keep = off_policy_keep(0.1, torch.tensor([-1.0, -1.0, -1.0]), torch.tensor([-1.5, -1.5, -1.0]),
        ...                        torch.tensor([-1.0, 1.0, -1.0]), torch.tensor([0, 0, 1]))
        >>> keep.tolist()  # sequence 0's mean KL is 0.5: its negative-advantage token goes
        [False, True, True]
    """
    kl = sampling - logprobs.detach()
    mean = sequence_sum(kl, index) / sequence_count(index, kl).clamp(min=1.0)
    return (advantages >= 0) | (mean <= threshold)


def mismatch_terms(log_ratio: Tensor) -> tuple[Tensor, Tensor]:
    """``(|log ρ_t|, exp(log ρ_t) − log ρ_t − 1)`` per token: the absolute log-probability difference of
    π_old and π_rollout, and the k3 estimate of ``KL(π_rollout ‖ π_old)``."""
    log_ratio = log_ratio.detach()
    return log_ratio.abs(), torch.exp(log_ratio) - log_ratio - 1
