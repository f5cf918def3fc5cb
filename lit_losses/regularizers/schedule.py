"""Weight schedules: a factor of the global (optimizer) step that multiplies a term's weight."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from lit_losses.errors import ConfigError


@dataclass
class Schedule:
    """``weight(step) = weight × factor(step)``.

    - ``constant``: 1.
    - ``linear_warmup``: from ``start`` to 1 over ``warmup_steps``, then 1.
    - ``cosine``: linear warmup, then ``final + (1 − final)·(1 + cos(π·progress))/2`` until
      ``total_steps``, then ``final``.
    - ``step``: ``gamma ** (step // step_size)``.
    """

    kind: Literal["constant", "linear_warmup", "cosine", "step"] = "constant"
    """Schedule shape."""
    warmup_steps: int = 0
    """Steps of linear warmup (``linear_warmup``, ``cosine``)."""
    start: float = 0.0
    """Factor at step 0 of the warmup."""
    total_steps: int | None = None
    """Last step of the cosine decay (``cosine``)."""
    final: float = 0.0
    """Factor at and after ``total_steps`` (``cosine``)."""
    step_size: int = 1
    """Steps between decays (``step``)."""
    gamma: float = 0.5
    """Decay per ``step_size`` steps (``step``)."""

    def __post_init__(self) -> None:
        kinds = ("constant", "linear_warmup", "cosine", "step")
        if self.kind not in kinds:
            raise ConfigError(f"schedule.kind {self.kind!r} is not one of {kinds}")
        if self.warmup_steps < 0 or self.step_size < 1:
            raise ConfigError(f"schedule: warmup_steps must be >= 0 and step_size >= 1, got {self}")
        if self.kind == "cosine" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise ConfigError(
                f"schedule: cosine needs total_steps > warmup_steps, got total_steps={self.total_steps}"
            )

    def factor(self, step: int) -> float:
        if self.kind == "constant":
            return 1.0
        if self.kind == "step":
            return self.gamma ** (step // self.step_size)
        if step < self.warmup_steps:
            return self.start + (1.0 - self.start) * step / self.warmup_steps
        if self.kind == "linear_warmup":
            return 1.0
        assert self.total_steps is not None
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.final + (1.0 - self.final) * 0.5 * (1.0 + math.cos(math.pi * progress))
