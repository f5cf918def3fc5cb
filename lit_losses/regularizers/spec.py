"""`RegularizerSpec`: one loss term's configuration (a YAML list entry of ``model.regularizers``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from lit_losses.aggregation import AggMode, check_mode
from lit_losses.choices import check_choice
from lit_losses.errors import ConfigError
from lit_losses.schedule import Schedule

OnError = Literal["raise", "skip", "warn"]
Executor = Literal["none", "thread"]


@dataclass
class RegularizerSpec:
    """One named, weighted, schedulable loss term.

    ``total = base + Σ_i weight_i · schedule_i(step) · term_i`` where ``term_i`` is the term's output
    aggregated with ``agg`` and the global counts of ``mask_key``.

    Example:
        >>> warmup = {"kind": "linear_warmup", "warmup_steps": 10}
        >>> spec = RegularizerSpec("z_loss", weight=1e-4, schedule=warmup)
        >>> spec.schedule.factor(5) * spec.weight
        5e-05
        >>> RegularizerSpec("z", on_error="skpi")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: regularizer 'z'.on_error 'skpi' is not one of (...); did you mean...?
    """

    name: str
    """Unique name (telemetry: ``regularizers/<name>/…``); also the registry name when ``fn`` is unset."""
    fn: str | Callable[..., Any] | None = None
    """Registry name, import path ``pkg.module.function``, or (Python) a callable ``fn(ctx)``."""
    weight: float = 1.0
    """Weight (scaled by ``schedule``); changeable at run time, saved in checkpoints."""
    enabled: bool = True
    """A disabled term is not computed; changeable at run time, saved in checkpoints."""
    schedule: Schedule | None = None
    """Weight schedule over the global step (default: constant)."""
    agg: AggMode | None = None
    """Aggregation mode of a per-token output (default: the model's ``loss_agg``)."""
    mask_key: str = "labels"
    """Mask (and global counts) the term is aggregated over."""
    on_error: OnError = "raise"
    """``raise``: stop with the term's name; ``skip``: contribute 0 and log ``…/error = 1``;
    ``warn``: as ``skip``, with a warning."""
    timeout_s: float | None = None
    """Time limit of an async or thread-offloaded term (past it: an error of that term)."""
    executor: Executor = "none"
    """``thread``: run a CPU-bound sync term off the main thread, concurrently with the others."""
    needs: list[str] | None = None
    """Head outputs consumed (default: the registry entry's)."""
    differentiable: bool | None = None
    """``False``: no gradient on purpose (warns once); default: the registry entry's."""
    pointwise: bool | None = None
    """Token-separable elementwise term (fusable into the head); default: the registry entry's."""
    allow_negative_weight: bool = False
    """Allow ``weight < 0`` (e.g. a bonus written as a negative penalty)."""
    legacy: bool = False
    """``fn`` is a legacy callback ``loss_fn(data, logprobs_list) -> (loss, metrics)``."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the term (a class's constructor, or the function's extra arguments)."""

    def __post_init__(self) -> None:
        where = f"regularizer {self.name!r}"
        if not self.name or "/" in self.name:
            raise ConfigError(f"regularizer name {self.name!r} must be non-empty and contain no '/'")
        if self.agg is not None:
            check_mode(self.agg, f"{where}.agg")
        check_choice(self.on_error, OnError, f"{where}.on_error")
        check_choice(self.executor, Executor, f"{where}.executor")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ConfigError(f"{where}.timeout_s must be > 0, got {self.timeout_s}")
        if isinstance(self.schedule, dict):
            self.schedule = Schedule(**self.schedule)
        check_weight(self.name, self.weight, self.allow_negative_weight)


def check_weight(name: str, weight: float, allow_negative: bool) -> float:
    """``weight`` as a float if finite (and >= 0 unless ``allow_negative``), else a `ConfigError`."""
    if not isinstance(weight, int | float) or not math.isfinite(weight):
        raise ConfigError(f"regularizer {name!r}: weight must be a finite number, got {weight!r}")
    if weight < 0 and not allow_negative:
        raise ConfigError(
            f"regularizer {name!r}: negative weight {weight} (set allow_negative_weight: true if intended)"
        )
    return float(weight)
