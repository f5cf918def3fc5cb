"""A base loss with its parameters (`BoundBaseLoss`), and bound to one micro-batch (`BaseLossBatch`): its
inputs at the valid tokens, the per-token loss of a range of them, and the step's RL telemetry."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lit_losses.aggregation.stats import batch_segment_ids, sequence_ids
from lit_losses.objectives import builtins
from lit_losses.objectives.inputs import ADVANTAGES, SAMPLING_LOGPROBS, SEQUENCE_INDEX, valid_values
from lit_losses.objectives.registry import BASE_LOSSES, BaseLoss

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
    ``model.base_loss_args`` configure.

    Example:
        >>> loss = BoundBaseLoss.resolve("cispo", {"clip_high_threshold": 5})
        >>> loss.params
        {'clip_low_threshold': 0.0, 'clip_high_threshold': 5.0, 'importance_sampling_level': 'token'}
        >>> loss.pointwise, loss.metric_names
        (True, ('clip_fraction', 'clip_ratio_high', 'ratio_mean', ...))
        >>> BoundBaseLoss.resolve("ppoo", None)
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.base_loss: unknown base loss 'ppoo'; did you mean 'ppo'? (...)
    """

    entry: BaseLoss
    params: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def resolve(
        cls, name: str, args: Mapping[str, Any] | None, where: str = "model.base_loss"
    ) -> BoundBaseLoss:
        """The base loss ``name`` (a registered name or an import path) with ``args`` checked.

        Raises:
            ConfigError: an unknown name (with the closest one), or bad ``args`` (`BaseLoss.bind`).
        """
        entry = BASE_LOSSES.get(name, where)
        return cls(entry, entry.bind(args, f"{where}_args"))

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def plain_ce(self) -> bool:
        """The built-in ``cross_entropy``: the head's plain-CE fast path computes it."""
        return self.entry.fn is builtins.cross_entropy

    @property
    def pointwise(self) -> bool:
        """Token ``t``'s loss depends on token ``t`` alone (the fused pointwise path may compute it)."""
        return self.entry.is_pointwise(self.params)

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The telemetry keys of this base loss (its own metrics, then `TELEMETRY`'s for its reads)."""
        reads = [key for key in TELEMETRY if key in self.entry.reads]
        return (*self.entry.metrics, *(name for key in reads for name in TELEMETRY[key]))

    def for_batch(self, batch: Mapping[str, Any], mask: Tensor, dtype: torch.dtype) -> BaseLossBatch:
        """The base loss bound to one micro-batch (its ``reads`` checked and taken at the valid tokens; a
        base loss that is not pointwise also gets `SEQUENCE_INDEX`)."""
        where = f"base loss {self.name!r}"
        inputs = {key: valid_values(batch, key, mask, reader=where, dtype=dtype) for key in self.entry.reads}
        if not self.pointwise:
            ids = sequence_ids(mask, batch_segment_ids(batch))[mask]
            inputs[SEQUENCE_INDEX] = torch.unique(ids, return_inverse=True)[1]
        return BaseLossBatch(self, inputs, dtype, device=mask.device)


class BaseLossBatch:
    """``L`` for the valid tokens ``[start, end)`` of one micro-batch (row-major order of the labels mask,
    the fused head's order), and the sums of its telemetry.

    Called as ``batch_loss(start, end, logprobs)`` once per range (the fused head: once per chunk; the
    general path: once for all tokens). Its output is checked: one finite value per token, with a
    gradient with respect to ``logprobs`` when they have one.

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
    ) -> None:
        self.loss = loss
        self.inputs = inputs
        self.fn = loss.entry.function(loss.params)
        self.sums = {name: torch.zeros((), dtype=dtype, device=device) for name in loss.metric_names}

    def __call__(self, start: int, end: int, logprobs: Tensor) -> Tensor:
        inputs = {key: value[start:end] for key, value in self.inputs.items()}
        out = self.fn(logprobs, inputs)
        loss, metrics = out if isinstance(out, tuple) else (out, {})
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

    def metrics(self, num_tokens: int) -> dict[str, Tensor]:
        """Each metric's sum over this micro-batch divided by ``num_tokens`` (the step's global count of
        valid tokens): summed over the micro-batches and ranks of the step, the global mean."""
        return {name: value / max(num_tokens, 1) for name, value in self.sums.items()}
