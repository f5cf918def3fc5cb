"""Soft alternatives to PPO's clipping from TRL's ``GRPOTrainer`` and Liger-Kernel's GRPO loss: SAPO's
sigmoid gate and VESPO's gamma weight of the sequence ratio.

Notation as in `lit_losses.objectives.builtins`: ``ℓ_t`` the learner's log-probability, ``q_t`` the
sampler's (``sampling_logprobs``), ``A_t`` the advantage, ``r_t = exp(ℓ_t − q_t)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lit_losses.objectives.builtins import POLICY_INPUTS
from lit_losses.objectives.inputs import ADVANTAGES, ROLLOUT_IS_WEIGHTS, SEQUENCE_INDEX
from lit_losses.objectives.ratios import (
    ImportanceSamplingLevel,
    log_ratio,
    old_logprobs,
    sequence_sum,
    token_level,
)
from lit_losses.objectives.registry import BaseLossArgError, register_base_loss

VESPO_LOG_W_MIN = math.log(1e-8)
"""The lower clamp of VESPO's ``log w`` (TRL's and the paper code's ``log(1e-8)``); the upper one is 20."""


def by_sign(condition: Tensor, if_true: float, otherwise: float, like: Tensor) -> Tensor:
    """``if_true`` where ``condition`` holds, else ``otherwise``, in ``like``'s dtype and device (the
    Python floats are not rounded to the default dtype first)."""
    return torch.where(condition, like.new_tensor(if_true), like.new_tensor(otherwise))


def check_temperatures(params: Mapping[str, Any]) -> None:
    """SAPO's temperatures are ``> 0``."""
    for name in ("temperature_pos", "temperature_neg"):
        if params[name] <= 0:
            raise BaseLossArgError(name, "must be > 0 (the gate's temperature)")


@register_base_loss("sapo", reads=POLICY_INPUTS, check=check_temperatures, pointwise=token_level)
def sapo(
    logprobs: Tensor,
    inputs: Mapping[str, Tensor],
    temperature_pos: float = 1.0,
    temperature_neg: float = 1.05,
    importance_sampling_level: ImportanceSamplingLevel = "token",
) -> Tensor:
    """SAPO (Soft Adaptive Policy Optimization): ``L_t = −(4/τ_t) · σ(τ_t · (r_t − 1)) · A_t``.

    A sigmoid gate replaces the hard clip: at ``r = 1`` its gradient is the policy gradient's
    (``d/dr (4/τ) σ(τ(r − 1)) = 1``), and it fades smoothly as the ratio leaves 1. ``τ_t`` is
    ``temperature_pos`` where ``A_t > 0`` and ``temperature_neg`` elsewhere (TRL's ``sapo_temperature_pos``
    1.0 and ``sapo_temperature_neg`` 1.05). ``importance_sampling_level: sequence``: GSPO's sequence ratio
    (TRL allows it; Liger-Kernel refuses it).

    Example:
        >>> import torch
        >>> inputs = {"sampling_logprobs": torch.tensor([-1.0]), "advantages": torch.tensor([2.0])}
        >>> sapo(torch.tensor([-1.0]), inputs)  # r = 1: −(4/1)·σ(0)·2
        tensor([-4.])
    """
    ratio = torch.exp(log_ratio(logprobs, inputs, importance_sampling_level))
    advantages = inputs[ADVANTAGES]
    temperature = by_sign(advantages > 0, temperature_pos, temperature_neg, like=ratio)
    return -torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature * advantages


def check_gamma(params: Mapping[str, Any]) -> None:
    """VESPO's shapes ``k ≥ 0`` and rates ``λ > 0``."""
    for name in ("k_pos", "k_neg"):
        if params[name] < 0:
            raise BaseLossArgError(name, "must be >= 0 (the power of w in the gamma weight)")
    for name in ("lambda_pos", "lambda_neg"):
        if params[name] <= 0:
            raise BaseLossArgError(name, "must be > 0 (the decay rate of the gamma weight)")


def gamma_weight(
    inputs: Mapping[str, Tensor], log_ratio_tokens: Tensor, params: Mapping[str, float]
) -> Tensor:
    """VESPO's ``φ(w_s) = exp(λ + k · log w_s − λ · w_s)`` at every token of ``s`` (no gradient); a rollout
    correction's token weights ``ρ̃_t`` (``inputs["rollout_is_weights"]``) join the sequence ratio as TRL
    joins them: ``log w_s += Σ_{t∈s} clip(log ρ̃_t, log 1e-8, 20)``."""
    with torch.no_grad():
        summed = sequence_sum(log_ratio_tokens.clamp(-20.0, 20.0), inputs[SEQUENCE_INDEX])
        if ROLLOUT_IS_WEIGHTS in inputs:
            log_is = torch.log(inputs[ROLLOUT_IS_WEIGHTS]).clamp(VESPO_LOG_W_MIN, 20.0)
            summed = summed + sequence_sum(log_is, inputs[SEQUENCE_INDEX])
        log_w = summed.clamp(VESPO_LOG_W_MIN, 20.0)
        nonneg = inputs[ADVANTAGES] >= 0
        k = by_sign(nonneg, params["k_pos"], params["k_neg"], like=log_w)
        rate = by_sign(nonneg, params["lambda_pos"], params["lambda_neg"], like=log_w)
        phi = torch.exp(rate + k * log_w - rate * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@register_base_loss("vespo", reads=POLICY_INPUTS, metrics=("phi_mean",), check=check_gamma, pointwise=False)
def vespo(
    logprobs: Tensor,
    inputs: Mapping[str, Tensor],
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """VESPO: ``L_t = −sg(φ(w_s)) · ℓ_t · A_t`` with ``φ(w) = e^λ · w^k · e^{−λ w}`` (``φ(1) = 1``).

    A smooth, asymmetric weight of the sequence's importance ratio ``w_s = exp(Σ_{u∈s} clip(ℓ_u − q_u,
    ±20))`` (a product over the sequence, ``log w`` clamped to ``[log 1e-8, 20]``) replaces clipping; it is
    detached, so it scales the policy gradient ``A_t ∇ℓ_t``. ``(k, λ)`` is ``(k_pos, lambda_pos)`` (TRL's
    ``vespo_k_pos`` 2.0, ``vespo_lambda_pos`` 3.0) where ``A_t ≥ 0``, else ``(k_neg, lambda_neg)`` (3.0,
    2.0). Needs whole sequences: not pointwise. Metric ``phi_mean``: the mean weight over the step's tokens
    (TRL's ``vespo/phi_seq_mean`` is a mean over sequences).
    """
    params = {"k_pos": k_pos, "lambda_pos": lambda_pos, "k_neg": k_neg, "lambda_neg": lambda_neg}
    phi = gamma_weight(inputs, logprobs.detach() - old_logprobs(inputs), params)
    return -phi * logprobs * inputs[ADVANTAGES], {"phi_mean": phi}
