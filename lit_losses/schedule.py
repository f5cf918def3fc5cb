"""`Schedule`: a factor of the optimizer step, used for learning rates and regularizer weights alike."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from lit_losses.choices import check_choice
from lit_losses.errors import ConfigError

ScheduleKind = Literal["constant", "linear_warmup", "cosine", "linear", "step"]


@dataclass
class Schedule:
    """``value(step) = base × factor(step)``.

    With ``w = warmup_steps``, ``s₀ = start`` and ``u = min(1, (step − w) / (total_steps − w))``:

    - ``constant``: 1.
    - warmup (``linear_warmup``, ``cosine``, ``linear``): ``s₀ + (1 − s₀)·step/w`` while ``step < w``.
    - ``linear_warmup``: then 1.
    - ``cosine``: then ``final + (1 − final)·(1 + cos(π·u))/2`` (``final`` at and after ``total_steps``).
    - ``linear``: then ``1 − (1 − final)·u``.
    - ``step``: ``gamma ** (step // step_size)``.

    Example:
        >>> s = Schedule("cosine", warmup_steps=2, total_steps=6, final=0.1)
        >>> [round(s.factor(k), 3) for k in range(8)]
        [0.0, 0.5, 1.0, 0.868, 0.55, 0.232, 0.1, 0.1]
    """

    kind: ScheduleKind = "constant"
    """Schedule shape."""
    warmup_steps: int = 0
    """Steps of linear warmup (``linear_warmup``, ``cosine``, ``linear``)."""
    start: float = 0.0
    """Factor at step 0 of the warmup."""
    total_steps: int | None = None
    """Last step of the decay (``cosine``, ``linear``)."""
    final: float = 0.0
    """Factor at and after ``total_steps`` (``cosine``, ``linear``)."""
    step_size: int = 1
    """Steps between decays (``step``)."""
    gamma: float = 0.5
    """Decay per ``step_size`` steps (``step``)."""

    def __post_init__(self) -> None:
        check_choice(self.kind, ScheduleKind, "schedule.kind")
        if self.warmup_steps < 0 or self.step_size < 1:
            raise ConfigError(f"schedule: warmup_steps must be >= 0 and step_size >= 1, got {self}")
        decays = self.kind in ("cosine", "linear")
        if decays and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise ConfigError(
                f"schedule: {self.kind} needs total_steps > warmup_steps, got total_steps={self.total_steps}"
            )

    def factor(self, step: int) -> float:
        """The multiplier at optimizer step ``step``."""
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
        if self.kind == "linear":
            return 1.0 - (1.0 - self.final) * progress
        return self.final + (1.0 - self.final) * 0.5 * (1.0 + math.cos(math.pi * progress))
