"""`RegularizerSpec`: one loss term's configuration (a YAML list entry of ``model.regularizers``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from lit_losses.aggregation import AggMode, check_mode
from lit_losses.choices import check_choice
from lit_losses.errors import ConfigError
from lit_losses.registry import closest
from lit_losses.regularizers.arguments import check_args
from lit_losses.regularizers.registry import resolve
from lit_losses.regularizers.scalar import ScalarRule
from lit_losses.schedule import Schedule

OnError = Literal["raise", "skip", "warn"]
Executor = Literal["none", "thread", "process"]
DEFAULT_TIMEOUT = "default"
"""``timeout_s``'s default: `lit_losses.regularizers.executors.DEFAULT_TIMEOUT_S`, read when the term runs."""


@dataclass
class RegularizerSpec:
    """One named, weighted, schedulable loss term.

    ``total = base + Σ_i weight_i · schedule_i(step) · term_i`` where ``term_i`` is the term's output
    aggregated with ``agg`` and the global counts of ``mask_key``. A dict in the sequence form,
    ``{"fn": f, "weight": 0.1, "name": "topology"}`` with ``f(data, logprobs_list) -> (loss, metrics)``
    (sync or async), is a spec as it stands.

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
    """Registry name, import path ``pkg.module.function``, or (Python) a callable: ``fn(ctx)`` or the
    sequence form ``fn(data, logprobs_list)`` (told apart by its signature, see ``legacy``)."""
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
    timeout_s: float | Literal["default"] | None = DEFAULT_TIMEOUT
    """Time limit in seconds of an async, thread or process term, counted from the start of the step
    (past it: an error of that term, handled by ``on_error``). ``"default"``:
    `lit_losses.regularizers.executors.DEFAULT_TIMEOUT_S` (60 s); ``None`` (YAML ``null``): no limit.
    A sync term on the main thread cannot be interrupted."""
    executor: Executor = "none"
    """Where a sync term runs: ``none`` (main thread), ``thread`` (a daemon thread, concurrently with the
    others) or ``process`` (a process pool, for CPU-bound code: ``fn`` must be picklable, i.e. defined at
    module level, and return a scalar; its gradient w.r.t. its inputs is computed in the worker and
    applied exactly)."""
    needs: list[str] | None = None
    """Head outputs consumed (default: the registry entry's)."""
    differentiable: bool | None = None
    """``False``: no gradient on purpose (warns once); default: the registry entry's."""
    pointwise: bool | None = None
    """Token-separable elementwise term (fusable into the head); default: the registry entry's."""
    allow_negative_weight: bool = False
    """Allow ``weight < 0`` (e.g. a bonus written as a negative penalty)."""
    legacy: bool | None = None
    """``fn``'s calling convention: ``True``: the sequence form ``fn(data, logprobs_list) -> (loss, metrics)``
    (one `Datum` and one aligned 1-D log-probability tensor per sequence); ``False``: ``fn(ctx)``
    (a `LossContext`); ``None``: from the signature (two required positional parameters: the
    sequence form)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the term (a class's constructor, or the function's extra arguments)."""
    run_in_executor: bool = False
    """``True`` runs a sync term in a thread (``executor: thread``)."""
    scalar: ScalarRule = "share"
    """How a scalar output ``r_m`` of micro-batch ``m`` enters the optimizer step (`scalar_value`):
    ``share``: ``r_m`` is this micro-batch's value in the term's mode (a mean over its tokens or
    sequences; for ``token-sum`` their sum), weighted by its share of the step's global count (as is
    for ``token-sum``); ``sum``: ``r_m`` as is in every micro-batch (the step
    sums them, as successive ``forward_backward_custom`` calls before one optimizer step). With one
    micro-batch per step both use the value as returned."""

    def __post_init__(self) -> None:
        where = f"regularizer {self.name!r}"
        if not self.name or "/" in self.name:
            raise ConfigError(f"regularizer name {self.name!r} must be non-empty and contain no '/'")
        if self.agg is not None:
            check_mode(self.agg, f"{where}.agg")
        check_choice(self.on_error, OnError, f"{where}.on_error")
        check_choice(self.executor, Executor, f"{where}.executor")
        check_choice(self.scalar, ScalarRule, f"{where}.scalar")
        if self.run_in_executor and self.executor == "none":
            self.executor = "thread"
        timeout = self.timeout_s
        if timeout != DEFAULT_TIMEOUT and timeout is not None and not _positive(timeout):
            raise ConfigError(
                f"{where}.timeout_s must be a number of seconds > 0, 'default' or null, got {timeout!r}"
            )
        if not isinstance(self.args, dict):
            raise ConfigError(f"{where}.args must be a mapping of keyword arguments, got {self.args!r}")
        if isinstance(self.schedule, dict):
            self.schedule = Schedule(**self.schedule)
        check_weight(self.name, self.weight, self.allow_negative_weight)


def as_spec(value: RegularizerSpec | Mapping[str, Any], where: str) -> RegularizerSpec:
    """``value`` as a `RegularizerSpec` (a dict in the sequence form ``{"fn", "weight", "name"}`` or with
    any other spec field); an unknown or missing field, an unknown term and ``args`` the term does not
    take (`check_args`) are a `ConfigError` naming ``where``.

    Example:
        >>> as_spec({"fn": "z_loss", "weight": 0.1, "name": "z"}, "regularizers[0]").weight
        0.1
        >>> as_spec({"name": "z", "wieght": 0.1}, "regularizers[0]")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: regularizers[0]: unknown field 'wieght'; did you mean 'weight'? ...
        >>> as_spec({"name": "entropy", "args": {"mode": "bonuss"}}, "regs[1]")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: regs[1].args.mode='bonuss': regularizer 'entropy' takes one of ...
    """
    if not isinstance(value, RegularizerSpec):
        value = _from_mapping(value, where)
    entry = resolve(value.fn if value.fn is not None else value.name, where)
    check_args(entry.target, value.args, where, name=value.name, legacy=value.legacy)
    return value


def _from_mapping(value: Any, where: str) -> RegularizerSpec:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a dict of RegularizerSpec fields, got {type(value).__name__}")
    known = [f.name for f in fields(RegularizerSpec)]
    for key in value:
        if key not in known:
            raise ConfigError(f"{where}: unknown field {key!r}{closest(key, known)} (fields: {known})")
    if "name" not in value:
        raise ConfigError(
            f"{where}: a regularizer needs a 'name' (it names its telemetry), got {dict(value)}"
        )
    return RegularizerSpec(**value)


def _positive(value: Any) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


def check_weight(name: str, weight: float, allow_negative: bool) -> float:
    """``weight`` as a float if finite (and >= 0 unless ``allow_negative``), else a `ConfigError`."""
    if not isinstance(weight, int | float) or isinstance(weight, bool) or not math.isfinite(weight):
        raise ConfigError(f"regularizer {name!r}: weight must be a finite number, got {weight!r}")
    if weight < 0 and not allow_negative:
        raise ConfigError(
            f"regularizer {name!r}: negative weight {weight} (set allow_negative_weight: true if intended)"
        )
    return float(weight)
