"""A base loss with its parameters (`BoundBaseLoss`), and bound to one micro-batch (`BaseLossBatch`): its
inputs at the valid tokens, the per-token loss of a range of them, and the step's RL telemetry. An RL base
loss may carry a rollout correction (`lit_losses.objectives.correction`), configured among its
parameters."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lit_losses.errors import ConfigError
from lit_losses.objectives import builtins, soft
from lit_losses.objectives.correction import RolloutCorrection, RolloutCorrectionOptions
from lit_losses.objectives.correction_batch import CorrectionBatch, dense_sequence_index
from lit_losses.objectives.inputs import (
    ADVANTAGES,
    OLD_LOGPROBS,
    ROLLOUT_IS_WEIGHTS,
    SAMPLING_LOGPROBS,
    SEQUENCE_INDEX,
    valid_values,
)
from lit_losses.objectives.registry import BASE_LOSSES, BaseLoss
from lit_losses.objectives.rejection import reject_rollouts
from lit_losses.registry import closest

TELEMETRY = {
    SAMPLING_LOGPROBS: ("ratio_mean", "approx_kl"),
    ADVANTAGES: ("advantage_mean", "advantage_logprob"),
}
"""Metrics every base loss that reads a key gets, as means over the step's valid tokens: ``ratio_mean``
``r̄ = mean exp(ℓ − q)``; ``approx_kl`` ``mean(r − 1 − log r)``, the k3 estimate of ``KL(q ‖ p_θ)`` from
the sampler's tokens (non-negative, unbiased); ``advantage_mean`` ``mean A``; ``advantage_logprob``
``mean A · ℓ``, the advantage-weighted log-probability that a policy gradient step raises."""


@dataclass(frozen=True)
class BoundBaseLoss:
    """A registered `BaseLoss` with checked parameters: what ``model.base_loss`` and
    ``model.base_loss_args`` configure (with a rollout correction among the arguments of an RL base loss:
    `RolloutCorrectionOptions`' fields).

    Example:
        >>> loss = BoundBaseLoss.resolve("cispo", {"clip_high_threshold": 5})
        >>> loss.params
        {'clip_low_threshold': 0.0, 'clip_high_threshold': 5.0, 'importance_sampling_level': 'token'}
        >>> loss.pointwise, loss.metric_names
        (True, ('clip_fraction', 'clip_ratio_high', 'ratio_mean', ...))
        >>> BoundBaseLoss.resolve("ppo", {"rollout_is": "token"}).correction.rollout_is_threshold
        2.0
        >>> BoundBaseLoss.resolve("ppoo", None)
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.base_loss: unknown base loss 'ppoo'; did you mean 'ppo'? (...)
    """

    entry: BaseLoss
    params: dict[str, Any] = field(default_factory=dict)
    correction: RolloutCorrection | None = None

    @classmethod
    def resolve(
        cls, name: str, args: Mapping[str, Any] | None, where: str = "model.base_loss"
    ) -> BoundBaseLoss:
        """The base loss ``name`` (a registered name or an import path) with ``args`` checked.

        Raises:
            ConfigError: an unknown name (with the closest one), bad ``args`` (`BaseLoss.bind`), a bad
                rollout correction (`RolloutCorrectionOptions.resolve`) or one the base loss cannot take.
        """
        entry = BASE_LOSSES.get(name, where)
        own, correction_args = split_correction_args(entry, args, f"{where}_args")
        correction = None
        if correction_args:
            options = RolloutCorrectionOptions.from_mapping(correction_args, where=f"{where}_args")
            correction = options.resolve(f"{where}_args")
            check_correction(entry, correction, args=correction_args, where=f"{where}_args")
        return cls(entry, entry.bind(own, f"{where}_args"), correction)

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def plain_ce(self) -> bool:
        """The built-in ``cross_entropy``: the head's plain-CE fast path computes it."""
        return self.entry.fn is builtins.cross_entropy

    @property
    def weight_inside(self) -> bool:
        """The base loss takes a rollout correction's importance weight inside its formula (``vespo``: in
        its sequence ratio, as TRL does) instead of having its per-token loss multiplied by it."""
        return self.entry.fn is soft.vespo

    @property
    def pointwise(self) -> bool:
        """Token ``t``'s loss depends on token ``t`` alone (the fused pointwise path may compute it)."""
        own = self.entry.is_pointwise(self.params)
        return own and (self.correction is None or self.correction.pointwise)

    def pointwise_for(self, batch: Mapping[str, Any]) -> bool:
        """`pointwise` on ``batch``: with its ``old_logprobs`` a rollout correction's weights are known
        before the loss runs (computed once per micro-batch), so a sequence-level weight keeps the loss
        pointwise; the off-policy mask always needs the current policy's whole sequences."""
        correction = self.correction
        if correction is None or correction.pointwise or OLD_LOGPROBS not in batch:
            return self.pointwise
        return self.entry.is_pointwise(self.params) and correction.off_policy_mask_threshold is None

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The telemetry keys of this base loss (its own metrics, then `TELEMETRY`'s for its reads, then
        its rollout correction's)."""
        reads = [key for key in TELEMETRY if key in self.entry.reads]
        correction = self.correction.metric_names if self.correction is not None else ()
        return (*self.entry.metrics, *(name for key in reads for name in TELEMETRY[key]), *correction)

    def reject(self, batch: dict[str, Any], ignore_index: int) -> dict[str, Any]:
        """``batch`` with the rollout correction's rejected tokens taken out of its labels
        (`reject_rollouts`), to be applied before the step's tokens are counted; ``batch`` itself without
        a rejection."""
        if self.correction is None or not self.correction.rejects:
            return batch
        return reject_rollouts(batch, self.correction, ignore_index, reader=f"base loss {self.name!r}")

    def for_batch(self, batch: Mapping[str, Any], mask: Tensor, dtype: torch.dtype) -> BaseLossBatch:
        """The base loss bound to one micro-batch (its ``reads`` checked and taken at the valid tokens, and
        ``old_logprobs`` when the batch has them and the loss reads ``sampling_logprobs``; a base loss that
        is not pointwise also gets `SEQUENCE_INDEX`)."""
        where = f"base loss {self.name!r}"
        inputs = {key: valid_values(batch, key, mask, reader=where, dtype=dtype) for key in self.entry.reads}
        if OLD_LOGPROBS in batch and SAMPLING_LOGPROBS in self.entry.reads:
            inputs[OLD_LOGPROBS] = valid_values(batch, OLD_LOGPROBS, mask, reader=where, dtype=dtype)
        if not self.pointwise_for(batch):
            inputs[SEQUENCE_INDEX] = dense_sequence_index(batch, mask)
        correction = None
        if self.correction is not None:
            correction = CorrectionBatch(
                self.correction, batch, mask=mask, dtype=dtype, weight_inside=self.weight_inside, reader=where
            )
        return BaseLossBatch(self, inputs, dtype, device=mask.device, correction=correction)


def split_correction_args(
    entry: BaseLoss, args: Mapping[str, Any] | None, where: str
) -> tuple[Mapping[str, Any] | None, dict[str, Any]]:
    """``(the base loss's own arguments, the rollout correction's)`` of ``base_loss_args``.

    Raises:
        ConfigError: a name that is neither's, closest to a correction field (``did you mean``).
    """
    if not isinstance(args, Mapping):
        return args, {}
    names = RolloutCorrectionOptions.names()
    own = {k: v for k, v in args.items() if k in entry.parameters or k not in names}
    for key in own:
        hint = closest(key, [*entry.parameters, *names])
        if key not in entry.parameters and any(hint == f"; did you mean {n!r}?" for n in names):
            raise ConfigError(
                f"{where}.{key}: base loss {entry.name!r} has no parameter {key!r}{hint} (a "
                "rollout-correction option)"
            )
    return own, {k: v for k, v in args.items() if k not in own}


def check_correction(
    entry: BaseLoss, correction: RolloutCorrection | None, args: Mapping[str, Any], where: str
) -> None:
    """Refuse a rollout correction on a base loss without sampling log-probabilities, and a
    sequence-level importance weight with ``vespo`` (TRL requires ``token_truncate`` or ``token_mask``)."""
    if SAMPLING_LOGPROBS not in entry.reads:
        key = next(iter(args))
        raise ConfigError(
            f"{where}.{key}: base loss {entry.name!r} reads no sampling log-probabilities; a rollout "
            "correction applies to the RL base losses (importance_sampling, ppo, cispo, dro, sapo, vespo)"
        )
    if entry.fn is soft.vespo and correction is not None and correction.level == "sequence":
        key, value = (
            ("vllm_importance_sampling_mode", correction.vllm_mode)
            if correction.vllm_mode is not None
            else ("rollout_is", correction.rollout_is)
        )
        raise ConfigError(
            f"{where}.{key}={value!r}: base loss 'vespo' takes the importance weight into its sequence ratio "
            "token by token; give a token-level one (TRL: token_truncate or token_mask)"
        )


class BaseLossBatch:
    """``L`` for the valid tokens ``[start, end)`` of one micro-batch (row-major order of the labels mask,
    the fused head's order), and the sums of its telemetry.

    Called as ``batch_loss(start, end, logprobs)`` once per range (the fused head: once per chunk; the
    general path: once for all tokens). Its output is checked: one finite value per token, with a
    gradient with respect to ``logprobs`` when they have one. With a rollout correction (``correction``)
    each token's loss is multiplied by its weight ``w_t`` (or the base loss takes ``w_t`` itself:
    ``vespo``), and ``π_old`` is the batch's ``old_logprobs`` or, without them, ``logprobs`` detached.

    Example:
        >>> import torch
        >>> loss = BoundBaseLoss.resolve("importance_sampling", None)
        >>> batch = {"sampling_logprobs": torch.tensor([[-1.0, -2.0]]), "advantages": torch.ones(1, 2)}
        >>> on_batch = loss.for_batch(batch, torch.tensor([[True, True]]), torch.float64)
        >>> on_batch(0, 2, torch.tensor([-1.0, -2.0], dtype=torch.float64))  # r = 1: L = −A
        tensor([-1., -1.], dtype=torch.float64)
        >>> on_batch.metrics(num_tokens=2)["approx_kl"]
        tensor(0., dtype=torch.float64)
    """

    def __init__(
        self,
        loss: BoundBaseLoss,
        inputs: dict[str, Tensor],
        dtype: torch.dtype,
        device: torch.device | None = None,
        correction: CorrectionBatch | None = None,
    ) -> None:
        self.loss = loss
        self.inputs = inputs
        self.fn = loss.entry.function(loss.params)
        theirs = set(loss.correction.metric_names) if loss.correction is not None else set()
        own = [name for name in loss.metric_names if name not in theirs]
        self.sums = {name: torch.zeros((), dtype=dtype, device=device) for name in own}
        self.correction = correction

    def __call__(self, start: int, end: int, logprobs: Tensor) -> Tensor:
        inputs = {key: value[start:end] for key, value in self.inputs.items()}
        multiplier = None
        if self.correction is not None:
            if self.loss.correction.uses_old and OLD_LOGPROBS not in inputs:
                inputs[OLD_LOGPROBS] = logprobs.detach()
            multiplier, inside = self.correction(start, end, logprobs, inputs)
            if inside is not None:
                inputs[ROLLOUT_IS_WEIGHTS] = inside
        out = self.fn(logprobs, inputs)
        loss, metrics = out if isinstance(out, tuple) else (out, {})
        if multiplier is not None and isinstance(loss, Tensor) and loss.shape == multiplier.shape:
            loss = loss * multiplier.to(loss.dtype)
        self._check(loss, metrics, logprobs)
        with torch.no_grad():
            self._add(metrics, logprobs.detach(), inputs)
        return loss

    def _check(self, loss: Any, metrics: Mapping[str, Tensor], logprobs: Tensor) -> None:
        where = f"base loss {self.loss.name!r}"
        if not isinstance(loss, Tensor) or loss.shape != logprobs.shape:
            got = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                f"{where} returned {got} for tokens of shape {tuple(logprobs.shape)}; a base loss returns "
                "one value per token"
            )
        unknown = sorted(set(metrics) - set(self.loss.entry.metrics))
        if unknown:
            declared = list(self.loss.entry.metrics)
            raise ValueError(f"{where} returned metrics {unknown} it did not declare (declared: {declared})")
        if not bool(torch.isfinite(loss.detach()).all()):
            bad = int((~torch.isfinite(loss.detach())).sum())
            raise ValueError(f"{where} returned a non-finite value (NaN/Inf) at {bad} token(s)")
        if logprobs.requires_grad and torch.is_grad_enabled() and not loss.requires_grad:
            raise ValueError(
                f"{where} returned a value without gradient with respect to the log-probabilities: it would "
                "train with zero gradient"
            )

    def _add(self, metrics: Mapping[str, Tensor], logprobs: Tensor, inputs: Mapping[str, Tensor]) -> None:
        sums = self.sums
        for name, value in metrics.items():
            sums[name] += value.to(sums[name].dtype).sum()
        if SAMPLING_LOGPROBS in inputs:
            log_ratio = logprobs - inputs[SAMPLING_LOGPROBS]
            ratio = torch.exp(log_ratio)
            sums["ratio_mean"] += ratio.sum()
            sums["approx_kl"] += (ratio - 1 - log_ratio).sum()
        if ADVANTAGES in inputs:
            sums["advantage_mean"] += inputs[ADVANTAGES].sum()
            sums["advantage_logprob"] += (inputs[ADVANTAGES] * logprobs).sum()

    def metrics(self, num_tokens: int, rollout_tokens: int | None = None) -> dict[str, Tensor]:
        """Each metric's sum over this micro-batch divided by ``num_tokens`` (the step's global count of
        valid tokens): summed over the micro-batches and ranks of the step, the global mean. The rollout
        correction's divide by ``rollout_tokens`` (the step's completion tokens before a rejection;
        default ``num_tokens``), but for its maxima (``…_max``), which are this micro-batch's."""
        out = {name: value / max(num_tokens, 1) for name, value in self.sums.items()}
        if self.correction is not None:
            count = max(num_tokens if rollout_tokens is None else rollout_tokens, 1)
            for name, value in self.correction.sums.items():
                out[name] = value if name.endswith("_max") else value / count
        return out
