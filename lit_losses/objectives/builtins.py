"""Built-in base losses: Tinker's loss types (``forward_backward(data, loss_fn=...)``).

Formulas and ``loss_fn_config`` parameters follow Tinker's loss-function documentation
(https://tinker-docs.thinkingmachines.ai/tinker/losses and its pages ``importance-sampling``, ``ppo``,
``cispo``, ``dro``). Notation, per valid token ``t``: ``ℓ_t = log p_θ(y_t)`` the learner's
log-probability (Tinker's ``target_logprobs``, with gradient), ``q_t`` the sampler's (Tinker's
``logprobs``, batch key ``sampling_logprobs``), ``A_t`` the advantage (``advantages``), and the ratio
``r_t = exp(ℓ_t − q_t)``. Each function returns the per-token loss ``L_t``; Tinker's ``loss`` is the sum
``Σ_t L_t`` (times its per-token ``weights``, here ``loss_weights``), which lit_losses aggregates with
``model.loss_agg`` and the step's global counts instead (``token-sum`` is Tinker's sum).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from lit_losses.objectives.inputs import ADVANTAGES, SAMPLING_LOGPROBS
from lit_losses.objectives.ratios import ImportanceSamplingLevel, log_ratio, token_level
from lit_losses.objectives.registry import BaseLossArgError, register_base_loss

POLICY_INPUTS = (SAMPLING_LOGPROBS, ADVANTAGES)
PPO_METRICS = ("clip_fraction", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region")
CISPO_METRICS = ("clip_fraction", "clip_ratio_high")

BaseLossName = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "sapo", "vespo"]
"""The built-in base losses (``model.base_loss`` also takes any registered name or import path)."""


def check_thresholds(params: Mapping[str, Any]) -> None:
    """``0 ≤ clip_low_threshold ≤ clip_high_threshold`` (bounds of the ratio ``r_t``, not of ``r_t − 1``)."""
    low, high = params["clip_low_threshold"], params["clip_high_threshold"]
    if low < 0:
        raise BaseLossArgError("clip_low_threshold", "must be >= 0 (a bound of the ratio p_θ/q, e.g. 0.8)")
    if high < low:
        raise BaseLossArgError("clip_high_threshold", f"must be >= clip_low_threshold={low}")


def ppo_bounds(
    clip_low: float | None, clip_high: float | None, epsilon_low: float | None, epsilon_high: float | None
) -> tuple[float, float]:
    """``(lo, hi)`` of `ppo` from either spelling: ``lo = clip_low_threshold`` or ``1 − epsilon_low``
    (default 0.8), ``hi = clip_high_threshold`` or ``1 + epsilon_high``, else ``1 + epsilon_low`` (TRL's
    default ``epsilon_high = epsilon``), else 1.2.

    Example:
        >>> ppo_bounds(None, None, None, 0.28), ppo_bounds(None, None, 0.1, None)
        ((0.8, 1.28), (0.9, 1.1))
    """
    lo = clip_low if clip_low is not None else 1.0 - (0.2 if epsilon_low is None else epsilon_low)
    if clip_high is not None:
        return lo, clip_high
    if epsilon_high is None:
        epsilon_high = 0.2 if epsilon_low is None else epsilon_low
    return lo, 1.0 + epsilon_high


def check_ppo(params: Mapping[str, Any]) -> None:
    """Each ratio bound in one spelling, ``ε ≥ 0``, ``0 ≤ lo ≤ hi``, ``δ > 0``."""
    for tinker, trl in (("clip_low_threshold", "epsilon_low"), ("clip_high_threshold", "epsilon_high")):
        if params[tinker] is not None and params[trl] is not None:
            raise BaseLossArgError(
                trl, f"and {tinker}={params[tinker]!r} both set the same bound; give one of them"
            )
    if params["epsilon_low"] is not None and not 0 <= params["epsilon_low"] <= 1:
        raise BaseLossArgError(
            "epsilon_low", "must be in [0, 1] (the lower bound of the ratio is 1 − epsilon_low)"
        )
    if params["epsilon_high"] is not None and params["epsilon_high"] < 0:
        raise BaseLossArgError(
            "epsilon_high", "must be >= 0 (the upper bound of the ratio is 1 + epsilon_high)"
        )
    names = ("clip_low_threshold", "clip_high_threshold", "epsilon_low", "epsilon_high")
    lo, hi = ppo_bounds(*(params[name] for name in names))
    if hi < lo and params["clip_high_threshold"] is None:
        raise BaseLossArgError("epsilon_high", f"gives the upper bound {hi} < the lower bound {lo}")
    check_thresholds({"clip_low_threshold": lo, "clip_high_threshold": hi})
    if params["delta"] is not None and params["delta"] <= 0:
        raise BaseLossArgError("delta", "must be > 0 (the cap of the unclipped ratio, e.g. 4)")


def check_beta(params: Mapping[str, Any]) -> None:
    """``β ≥ 0`` (the weight of DRO's quadratic penalty)."""
    if params["beta"] < 0:
        raise BaseLossArgError("beta", "must be >= 0")


@register_base_loss("cross_entropy")
def cross_entropy(logprobs: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
    """Tinker's ``cross_entropy``: ``L_t = −ℓ_t`` (``loss = −(target_logprobs · weights).sum()``).

    The negative log-likelihood of the labels, the default base loss. Alone it runs on the head's
    plain-CE fast path (three matmuls, every gradient in forward); ``loss_weights``, when the batch has
    them, are Tinker's ``weights``.
    """
    return -logprobs


@register_base_loss("importance_sampling", reads=POLICY_INPUTS, pointwise=token_level)
def importance_sampling(
    logprobs: Tensor,
    inputs: Mapping[str, Tensor],
    importance_sampling_level: ImportanceSamplingLevel = "token",
) -> Tensor:
    """Tinker's ``importance_sampling``: ``L_t = −r_t · A_t`` with ``r_t = exp(ℓ_t − q_t)``.

    The policy gradient corrected for a sampler ``q`` that differs from the learner ``p_θ``:
    ``L_IS(θ) = E_{x∼q}[p_θ(x)/q(x) · A(x)]`` (Tinker: ``prob_ratio = exp(target_logprobs −
    sampling_logprobs)``, ``loss = −(prob_ratio · advantages).sum()``). Reads ``sampling_logprobs`` and
    ``advantages``. ``importance_sampling_level: sequence``: GSPO's ratio ``r_s`` of the token's sequence
    (`lit_losses.objectives.ratios`).
    """
    return -torch.exp(log_ratio(logprobs, inputs, importance_sampling_level)) * inputs[ADVANTAGES]


@register_base_loss("ppo", reads=POLICY_INPUTS, metrics=PPO_METRICS, check=check_ppo, pointwise=token_level)
def ppo(
    logprobs: Tensor,
    inputs: Mapping[str, Tensor],
    clip_low_threshold: float | None = None,
    clip_high_threshold: float | None = None,
    epsilon_low: float | None = None,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: ImportanceSamplingLevel = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Tinker's ``ppo``: ``L_t = −min(min(r_t, δ) · A_t, clip(r_t, lo, hi) · A_t)``.

    PPO's clipped objective (Schulman et al., 2017), token-wise: ``clipped_ratio = clamp(prob_ratio,
    clip_low_threshold, clip_high_threshold)``, ``loss = −min(prob_ratio · advantages, clipped_ratio ·
    advantages).sum()``; TRL's ``GRPOTrainer`` and Liger-Kernel's ``LigerFusedLinearGRPOLoss`` compute the
    same per-token loss for their ``loss_type`` ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo`` and ``luspo``
    (which differ in aggregation only: ``model.loss_agg``, or the ``model.grpo`` presets).

    Parameters (``base_loss_args``):

    - ``clip_low_threshold`` ``lo`` and ``clip_high_threshold`` ``hi``: bounds of the ratio (Tinker's
      names; default 0.8 and 1.2, i.e. ε = 0.2).
    - ``epsilon_low``/``epsilon_high``: the same bounds in TRL's spelling, ``lo = 1 − epsilon_low`` and
      ``hi = 1 + epsilon_high`` (``epsilon_high`` defaults to ``epsilon_low``, as in TRL); give each bound
      in one spelling only.
    - ``delta``: INTELLECT-2's two-sided clipping, the unclipped ratio capped at ``δ`` (default none);
      a large negative-advantage ratio then stops at ``δ · A_t`` with zero gradient.
    - ``importance_sampling_level``: ``token`` (default) or ``sequence``, GSPO's ratio ``r_s =
      exp(mean_{u∈s} (ℓ_u − q_u))`` of each token's sequence (`lit_losses.objectives.ratios`); not pointwise.

    Metrics (token means over the step): ``clip_fraction``, the share of tokens whose clipped term is the
    minimum while different from the unclipped one (their gradient is 0); TRL's clip ratios
    ``clip_ratio_low`` (``r < lo`` and ``A < 0``), ``clip_ratio_high`` (``r > hi`` and ``A > 0``) and
    ``clip_ratio_region`` (either).
    """
    lo, hi = ppo_bounds(clip_low_threshold, clip_high_threshold, epsilon_low, epsilon_high=epsilon_high)
    ratio = torch.exp(log_ratio(logprobs, inputs, importance_sampling_level))
    advantages = inputs[ADVANTAGES]
    unclipped = (ratio if delta is None else ratio.clamp(max=delta)) * advantages
    clipped = ratio.clamp(lo, hi) * advantages
    low, high = (ratio < lo) & (advantages < 0), (ratio > hi) & (advantages > 0)
    metrics = {
        "clip_fraction": clipped < unclipped,
        "clip_ratio_low": low,
        "clip_ratio_high": high,
        "clip_ratio_region": low | high,
    }
    return -torch.minimum(unclipped, clipped), metrics


@register_base_loss(
    "cispo", reads=POLICY_INPUTS, metrics=CISPO_METRICS, check=check_thresholds, pointwise=token_level
)
def cispo(
    logprobs: Tensor,
    inputs: Mapping[str, Tensor],
    clip_low_threshold: float = 0.0,
    clip_high_threshold: float = 4.0,
    importance_sampling_level: ImportanceSamplingLevel = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Tinker's ``cispo``: ``L_t = −sg(clip(r_t, lo, hi)) · ℓ_t · A_t`` (``sg``: no gradient).

    CISPO (MiniMax-M1) weights the log-probability by the clipped, detached ratio, so clipping bounds a
    token's coefficient instead of zeroing its gradient: ``clipped_ratio = clamp(prob_ratio,
    clip_low_threshold, clip_high_threshold)``, ``loss = −(clipped_ratio.detach() · target_logprobs ·
    advantages).sum()``. ``loss_fn_config``: ``clip_low_threshold`` and ``clip_high_threshold`` (Tinker's
    defaults 0.0 and 4.0: no lower bound). TRL's and Liger-Kernel's ``loss_type="cispo"`` is this loss with
    ``lo = 0`` and ``hi`` their ``epsilon_high`` (the cap itself, not ``1 + ε``).
    ``importance_sampling_level: sequence``: GSPO's sequence ratio (not pointwise). Metrics:
    ``clip_fraction``, the share of tokens whose ratio lies outside ``[lo, hi]``; ``clip_ratio_high``,
    TRL's ``cispo_clip_ratio`` (``r > hi`` and ``A > 0``).
    """
    ratio = torch.exp(log_ratio(logprobs, inputs, importance_sampling_level)).detach()
    coefficient = ratio.clamp(clip_low_threshold, clip_high_threshold)
    outside = (ratio < clip_low_threshold) | (ratio > clip_high_threshold)
    high = (ratio > clip_high_threshold) & (inputs[ADVANTAGES] > 0)
    return -coefficient * logprobs * inputs[ADVANTAGES], {"clip_fraction": outside, "clip_ratio_high": high}


@register_base_loss("dro", reads=POLICY_INPUTS, check=check_beta)
def dro(logprobs: Tensor, inputs: Mapping[str, Tensor], beta: float) -> Tensor:
    """Tinker's ``dro``: ``L_t = −(ℓ_t · A_t − β/2 · (ℓ_t − q_t)²)``.

    Direct reward optimization (Richemond et al., 2024), off-policy and offline: ``quadratic_term =
    (target_logprobs − sampling_logprobs)²``, ``loss = −(target_logprobs · advantages − 0.5 · beta ·
    quadratic_term).sum()``; its advantages are the "soft" estimates computed on the client side.
    ``loss_fn_config``: ``beta`` (required: Tinker documents no default; its example uses 0.05).
    """
    return -(logprobs * inputs[ADVANTAGES] - 0.5 * beta * (logprobs - inputs[SAMPLING_LOGPROBS]).square())
