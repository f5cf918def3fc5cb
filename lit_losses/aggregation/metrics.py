"""Distributed-exact logged values: torchmetrics states that sum over micro-batches and ranks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor
from torchmetrics import Metric

from lit_losses.aggregation.modes import AggMode, check_mode
from lit_losses.aggregation.stats import MaskStats

MAX_SUFFIX = "_max"
"""A logged value whose name ends so is a maximum over the step, not a sum."""


class StepSums(Metric):
    """Named values summed over the micro-batches of an optimizer step and over the ranks.

    Each micro-batch's loss is already normalized by the *global* counts of its step, so the
    global-batch loss is ``Σ_{ranks} Σ_{micro-batches} loss`` (sum semantics). One vector state with
    ``dist_reduce_fx="sum"`` holds every key, so `compute` costs one collective for all of them; keys
    ending in ``_max`` (`MAX_SUFFIX`) are maxima instead, in a second vector state reduced with ``max``.
    The keys are fixed at construction so that every rank reduces the same vectors.

    Example:
        >>> sums = StepSums(("loss", "diff_max"))
        >>> sums.update({"loss": 1.0, "diff_max": 0.5})
        >>> sums.update({"loss": 2.0, "diff_max": 0.25})
        >>> {k: float(v) for k, v in sums.compute().items()}
        {'loss': 3.0, 'diff_max': 0.5}
    """

    full_state_update = False

    def __init__(self, keys: Sequence[str], **kwargs) -> None:
        super().__init__(**kwargs)
        if len(set(keys)) != len(keys):
            raise ValueError(f"StepSums keys must be unique, got {list(keys)}")
        self.keys = tuple(keys)
        self.sum_keys = tuple(k for k in self.keys if not k.endswith(MAX_SUFFIX))
        self.max_keys = tuple(k for k in self.keys if k.endswith(MAX_SUFFIX))
        self.add_state(
            "sums", default=torch.zeros(len(self.sum_keys), dtype=torch.float64), dist_reduce_fx="sum"
        )
        lowest = torch.full((len(self.max_keys),), -torch.inf, dtype=torch.float64)
        self.add_state("maxima", default=lowest, dist_reduce_fx="max")

    def update(self, values: Mapping[str, Tensor | float]) -> None:
        """Add one micro-batch's ``values`` (every key must be present)."""
        missing = set(self.keys) - set(values)
        if missing:
            raise KeyError(f"StepSums.update is missing keys {sorted(missing)}")
        self.sums += self._row(values, self.sum_keys)
        if self.max_keys:
            self.maxima = torch.maximum(self.maxima, self._row(values, self.max_keys))

    def _row(self, values: Mapping[str, Tensor | float], keys: Sequence[str]) -> Tensor:
        row = [
            torch.as_tensor(values[k]).detach().to(self.sums.device, torch.float64).reshape(()) for k in keys
        ]
        return torch.stack(row) if row else self.sums.new_zeros(0)

    def compute(self) -> dict[str, Tensor]:
        out = {k: self.sums[i] for i, k in enumerate(self.sum_keys)}
        out |= {k: self.maxima[i] for i, k in enumerate(self.max_keys)}
        return {k: out[k] for k in self.keys}


def mode_denominator(mode: AggMode, local: MaskStats) -> int:
    """The count a micro-batch's locally normalized value was divided by, in ``mode``.

    ``value × denominator`` summed over micro-batches and ranks, divided by the summed denominators,
    is the global value (used for validation logging with torchmetrics' weighted `MeanMetric`). For
    ``token-sum`` the denominator is 1: the logged value is the mean per micro-batch. ``token-mean``
    divides by the valid tokens; every ``seq-*`` mode by the sequences (``seq-mean-token-sum-norm``
    by ``S · C`` with a constant ``C``, so the sequences are its weight as well).

    Example:
        >>> from lit_losses.aggregation import MaskStats
        >>> modes = ("token-mean", "token-sum", "seq-mean-token-sum-norm")
        >>> [mode_denominator(m, MaskStats(num_tokens=7, num_sequences=2)) for m in modes]
        [7, 1, 2]
    """
    check_mode(mode)
    if mode == "token-sum":
        return 1
    return local.num_tokens if mode == "token-mean" else local.num_sequences
