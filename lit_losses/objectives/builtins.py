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
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from lit_losses.objectives.inputs import ADVANTAGES, SAMPLING_LOGPROBS
from lit_losses.objectives.registry import BASE_LOSSES, BaseLossArgError, register_base_loss

POLICY_INPUTS = (SAMPLING_LOGPROBS, ADVANTAGES)

BaseLossName = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]
"""The built-in base losses (``model.base_loss`` also takes any registered name or import path)."""


def check_thresholds(params: Mapping[str, Any]) -> None:
    """``0 ≤ clip_low_threshold ≤ clip_high_threshold`` (bounds of the ratio ``r_t``, not of ``r_t − 1``)."""
    low, high = params["clip_low_threshold"], params["clip_high_threshold"]
    if low < 0:
        raise BaseLossArgError("clip_low_threshold", "must be >= 0 (a bound of the ratio p_θ/q, e.g. 0.8)")
    if high < low:
        raise BaseLossArgError("clip_high_threshold", f"must be >= clip_low_threshold={low}")


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


@register_base_loss("importance_sampling", reads=POLICY_INPUTS)
def importance_sampling(logprobs: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
    """Tinker's ``importance_sampling``: ``L_t = −r_t · A_t`` with ``r_t = exp(ℓ_t − q_t)``.

    The policy gradient corrected for a sampler ``q`` that differs from the learner ``p_θ``:
    ``L_IS(θ) = E_{x∼q}[p_θ(x)/q(x) · A(x)]`` (Tinker: ``prob_ratio = exp(target_logprobs −
    sampling_logprobs)``, ``loss = −(prob_ratio · advantages).sum()``). Reads ``sampling_logprobs`` and
    ``advantages``; no parameter.
    """
    return -torch.exp(logprobs - inputs[SAMPLING_LOGPROBS]) * inputs[ADVANTAGES]


@register_base_loss("ppo", reads=POLICY_INPUTS, metrics=("clip_fraction",), check=check_thresholds)
def ppo(
    logprobs: Tensor,
    inputs: Mapping[str, Tensor],
    clip_low_threshold: float = 0.8,
    clip_high_threshold: float = 1.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Tinker's ``ppo``: ``L_t = −min(r_t · A_t, clip(r_t, lo, hi) · A_t)``.

    PPO's clipped objective (Schulman et al., 2017), token-wise: ``clipped_ratio = clamp(prob_ratio,
    clip_low_threshold, clip_high_threshold)``, ``loss = −min(prob_ratio · advantages, clipped_ratio ·
    advantages).sum()``. ``loss_fn_config``: ``clip_low_threshold`` ``lo`` and ``clip_high_threshold``
    ``hi``, bounds of the ratio (Tinker's ``1 − ε_low`` and ``1 + ε_high``; default 0.8 and 1.2, i.e.
    ε = 0.2). Metric ``clip_fraction``: the share of tokens whose clipped term is the minimum while
    different from the unclipped one (their gradient is 0).
    """
    ratio = torch.exp(logprobs - inputs[SAMPLING_LOGPROBS])
    advantages = inputs[ADVANTAGES]
    unclipped = ratio * advantages
    clipped = ratio.clamp(clip_low_threshold, clip_high_threshold) * advantages
    return -torch.minimum(unclipped, clipped), {"clip_fraction": (clipped < unclipped).detach()}


@register_base_loss("cispo", reads=POLICY_INPUTS, metrics=("clip_fraction",), check=check_thresholds)
def cispo(
    logprobs: Tensor,
    inputs: Mapping[str, Tensor],
    clip_low_threshold: float = 0.0,
    clip_high_threshold: float = 4.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Tinker's ``cispo``: ``L_t = −sg(clip(r_t, lo, hi)) · ℓ_t · A_t`` (``sg``: no gradient).

    CISPO (MiniMax-M1) weights the log-probability by the clipped, detached ratio, so clipping bounds a
    token's coefficient instead of zeroing its gradient: ``clipped_ratio = clamp(prob_ratio,
    clip_low_threshold, clip_high_threshold)``, ``loss = −(clipped_ratio.detach() · target_logprobs ·
    advantages).sum()``. ``loss_fn_config``: ``clip_low_threshold`` and ``clip_high_threshold`` (Tinker's
    defaults 0.0 and 4.0: no lower bound). Metric ``clip_fraction``: the share of tokens whose ratio lies
    outside ``[lo, hi]``.
    """
    ratio = torch.exp(logprobs - inputs[SAMPLING_LOGPROBS]).detach()
    coefficient = ratio.clamp(clip_low_threshold, clip_high_threshold)
    outside = (ratio < clip_low_threshold) | (ratio > clip_high_threshold)
    return -coefficient * logprobs * inputs[ADVANTAGES], {"clip_fraction": outside}


@register_base_loss("dro", reads=POLICY_INPUTS, check=check_beta)
def dro(logprobs: Tensor, inputs: Mapping[str, Tensor], beta: float) -> Tensor:
    """Tinker's ``dro``: ``L_t = −(ℓ_t · A_t − β/2 · (ℓ_t − q_t)²)``.

    Direct reward optimization (Richemond et al., 2024), off-policy and offline: ``quadratic_term =
    (target_logprobs − sampling_logprobs)²``, ``loss = −(target_logprobs · advantages − 0.5 · beta ·
    quadratic_term).sum()``; its advantages are the "soft" estimates computed on the client side.
    ``loss_fn_config``: ``beta`` (required: Tinker documents no default; its example uses 0.05).
    """
    return -(logprobs * inputs[ADVANTAGES] - 0.5 * beta * (logprobs - inputs[SAMPLING_LOGPROBS]).square())


if set(get_args(BaseLossName)) - set(BASE_LOSSES.names()):  # pragma: no cover - a maintenance error
    raise RuntimeError(f"BaseLossName lists {get_args(BaseLossName)}; registered: {BASE_LOSSES.names()}")
