"""Metric handlers: what rules can read. Each value is a dict that carries the ``step`` it was computed at."""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Literal, get_args

import lightning as L

from lit_losses.controller.registration import register_classes, subclass_of
from lit_losses.errors import ConfigError
from lit_losses.registry import Registry

Trigger = Literal[
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_validation_start",
    "on_validation_epoch_end",
    "on_validation_end",
    "on_train_end",
]
"""A Lightning hook usable as a controller trigger (and as an event metric handlers compute on)."""

ALL_EVENTS: tuple[Trigger, ...] = get_args(Trigger)
"""Every `Trigger`, in the order Lightning calls the hooks."""


def _number(value: Any) -> float:
    return float(value.item() if hasattr(value, "item") else value)


class MetricHandler:
    """A named source of values for rules.

    Subclasses set `events` (the hooks they can compute on), check their arguments in `validate`
    and return a dict from `compute`; the controller adds ``step`` (the global step of the
    computation). ``None`` means "not available yet": rules that use it skip. Register a subclass
    with `register_metric_handlers` to use it as ``class`` in the YAML (or give its import path).

    Args:
        name: the name rules use for the values (``name`` in the YAML).
        **arguments: the entry's ``arguments`` mapping, checked by `validate`.

    Example:
        >>> from lit_losses.controller import MetricHandler
        >>> class Constant(MetricHandler):
        ...     def compute(self, event, trainer, pl_module):
        ...         return {"value": self.arguments["value"]}
        >>> Constant("const", value=3).compute("on_train_batch_end", None, None)
        {'value': 3}
    """

    events: tuple[Trigger, ...] = ALL_EVENTS
    """The hooks on which `compute` may be called."""

    def __init__(self, name: str, **arguments: Any) -> None:
        self.name, self.arguments = name, arguments

    def validate(self) -> None:
        """Check the arguments, once, when the config is parsed.

        Raises:
            ConfigError: bad arguments (the message is prefixed with the entry's YAML path).
        """

    def compute(self, event: str, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any] | None:
        """The current values, or ``None`` when they are not available yet.

        Args:
            event: the hook being run (one of `events`).
            trainer: the running trainer.
            pl_module: the module being trained.

        Returns:
            A dict of values (the controller adds ``step``), or ``None``.
        """
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """State to save in checkpoints (e.g. a window of past values); empty by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    def _unknown_arguments(self, allowed: tuple[str, ...]) -> None:
        unknown = sorted(set(self.arguments) - set(allowed))
        if unknown:
            raise ConfigError(f"unknown arguments {unknown} (allowed: {list(allowed)})")


class Loss(MetricHandler):
    """The latest logged training loss: ``{"loss": value}``.

    Arguments (YAML): ``key``, the logged metric to read (default ``train/loss_total``).
    Not available until the metric was logged.
    """

    events = ("on_train_batch_end", "on_train_epoch_end", "on_validation_end")

    def validate(self) -> None:
        self._unknown_arguments(("key",))

    def compute(self, event, trainer, pl_module):
        key = self.arguments.get("key", "train/loss_total")
        value = trainer.callback_metrics.get(key)
        return None if value is None else {"loss": _number(value)}


class EvalMetrics(MetricHandler):
    """Validation metrics: every logged ``val/…`` value, keyed without the prefix (``{"loss": …}``).

    Arguments (YAML): ``prefix`` (default ``val/``). Not available before the first validation.
    """

    events = ("on_validation_end", "on_validation_epoch_end", "on_train_epoch_end", "on_train_batch_end")

    def validate(self) -> None:
        self._unknown_arguments(("prefix",))

    def compute(self, event, trainer, pl_module):
        prefix = self.arguments.get("prefix", "val/")
        values = {
            k[len(prefix) :]: _number(v) for k, v in trainer.callback_metrics.items() if k.startswith(prefix)
        }
        return values or None


class HistoryBasedMetric(MetricHandler):
    """The last ``window`` values of logged metric ``key``: ``{"window": [...], "full": bool}``.

    Arguments (YAML): ``key`` (required, a logged metric name) and ``window`` (an integer >= 1,
    default 5). One value is appended per computation on which ``key`` is logged; the window is saved
    in checkpoints.
    """

    def validate(self) -> None:
        self._unknown_arguments(("key", "window"))
        if "key" not in self.arguments:
            raise ConfigError("HistoryBasedMetric needs arguments.key (a logged metric name)")
        window = self.arguments.get("window", 5)
        if not isinstance(window, int) or window < 1:
            raise ConfigError(f"arguments.window must be an integer >= 1, got {window!r}")
        self.values: deque[float] = deque(maxlen=window)

    def compute(self, event, trainer, pl_module):
        value = trainer.callback_metrics.get(self.arguments["key"])
        if value is not None:
            self.values.append(_number(value))
        if not self.values:
            return None
        return {"window": list(self.values), "full": len(self.values) == self.values.maxlen}

    def state_dict(self):
        return {"values": list(self.values)}

    def load_state_dict(self, state):
        self.values.clear()
        self.values.extend(state.get("values", []))


class TrainerFields(MetricHandler):
    """Fields of the trainer, ``{key: trainer.<attribute>}`` for each ``(key, attribute)`` of `fields`.

    Takes no arguments; always available.
    """

    fields: tuple[tuple[str, str], ...] = ()

    def validate(self) -> None:
        self._unknown_arguments(())

    def compute(self, event, trainer, pl_module):
        return {key: getattr(trainer, attribute) for key, attribute in self.fields}


class TrainingState(TrainerFields):
    """``{"epoch", "global_step", "max_steps", "max_epochs", "should_stop"}`` of the trainer."""

    fields = (
        ("epoch", "current_epoch"),
        ("global_step", "global_step"),
        ("max_steps", "max_steps"),
        ("max_epochs", "max_epochs"),
        ("should_stop", "should_stop"),
    )


class PerProcessState(TrainerFields):
    """``{"rank", "local_rank", "world_size"}`` of this process (rules on it differ across ranks)."""

    fields = (("rank", "global_rank"), ("local_rank", "local_rank"), ("world_size", "world_size"))


class RegularizerState(MetricHandler):
    """Per regularizer of a `RegularizedLM`: ``{name: {"weight", "enabled", "value", "contribution"}}``.

    ``weight`` is the effective weight (schedule included) at the current step; ``value`` and
    ``contribution`` are those of the last optimizer step (NaN before the first one). Takes no
    arguments; not available for a module without regularizers.
    """

    def validate(self) -> None:
        self._unknown_arguments(())

    def compute(self, event, trainer, pl_module):
        terms = getattr(pl_module, "regularizer_set", None)
        if terms is None:
            return None
        telemetry = getattr(pl_module, "telemetry", {}).get("regularizers", {})
        out = {}
        for name, term in terms.terms.items():
            last = telemetry.get(name, {})
            out[name] = {
                "weight": terms.effective_weight(name, trainer.global_step),
                "enabled": term.enabled,
                "value": last.get("value", math.nan),
                "contribution": last.get("contribution", math.nan),
            }
        return out


METRIC_HANDLERS: Registry[type[MetricHandler]] = Registry(
    "metric class", adapt=subclass_of(MetricHandler, "metric handler")
)
"""Metric handler classes by name (the YAML ``class`` of a ``controller-metrics`` entry)."""


def register_metric_handlers(
    *handlers: type[MetricHandler] | list[type[MetricHandler]], **named: type[MetricHandler]
) -> None:
    """Register metric handler classes, by class name or under the given names.

    Args:
        *handlers: `MetricHandler` subclasses, registered under their class name; a list of them is
            accepted too (``register_metric_handlers([A, B])``, as in fms-hf-tuning).
        **named: subclasses registered under the keyword's name.

    Raises:
        TypeError: an object that is not a `MetricHandler` subclass.
        ValueError: a name already registered for a different class.

    Example:
        >>> from lit_losses.controller import METRIC_HANDLERS, MetricHandler, register_metric_handlers
        >>> class Ones(MetricHandler):
        ...     def compute(self, event, trainer, pl_module):
        ...         return {"one": 1}
        >>> register_metric_handlers([Ones], AllOnes=Ones)
        >>> "Ones" in METRIC_HANDLERS and "AllOnes" in METRIC_HANDLERS
        True
        >>> register_metric_handlers(dict)
        Traceback (most recent call last):
        ...
        TypeError: metric handler 'dict' must be a MetricHandler subclass, got <class 'dict'>
    """
    register_classes(METRIC_HANDLERS, handlers, named)


register_metric_handlers(
    Loss, EvalMetrics, HistoryBasedMetric, TrainingState, PerProcessState, RegularizerState
)
