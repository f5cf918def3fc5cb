"""Metric handlers: what rules can read. Each value is a dict that carries the ``step`` it was computed at."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

import lightning as L

from lit_losses.errors import ConfigError

ALL_EVENTS = (
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_validation_start",
    "on_validation_epoch_end",
    "on_validation_end",
    "on_train_end",
)
"""Lightning hooks usable as triggers (and as events metric handlers compute on)."""


def _number(value: Any) -> float:
    return float(value.item() if hasattr(value, "item") else value)


class MetricHandler:
    """A named source of values for rules.

    Subclasses set `events` (the hooks they can compute on), check their arguments in `validate`
    and return a dict from `compute`; the controller adds ``step`` (the global step of the
    computation). ``None`` means "not available yet": rules that use it skip.
    """

    events: tuple[str, ...] = ALL_EVENTS

    def __init__(self, name: str, **arguments: Any) -> None:
        self.name, self.arguments = name, arguments

    def validate(self) -> None:
        """Raise `ConfigError` for bad arguments."""

    def compute(self, event: str, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any] | None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def _unknown_arguments(self, allowed: tuple[str, ...]) -> None:
        unknown = sorted(set(self.arguments) - set(allowed))
        if unknown:
            raise ConfigError(f"unknown arguments {unknown} (allowed: {list(allowed)})")


class Loss(MetricHandler):
    """The latest logged training loss ``{"loss": value}`` (argument ``key``: ``train/loss_total``)."""

    events = ("on_train_batch_end", "on_train_epoch_end", "on_validation_end")

    def validate(self) -> None:
        self._unknown_arguments(("key",))

    def compute(self, event, trainer, pl_module):
        key = self.arguments.get("key", "train/loss_total")
        value = trainer.callback_metrics.get(key)
        return None if value is None else {"loss": _number(value)}


class EvalMetrics(MetricHandler):
    """Validation metrics: every logged ``val/…`` value, keyed without the prefix (``{"loss": …}``)."""

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
    """The last ``window`` values of logged metric ``key``: ``{"window": [...], "full": bool}``."""

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


class TrainingState(MetricHandler):
    """``{"epoch", "global_step", "max_steps", "max_epochs", "should_stop"}`` of the trainer."""

    def validate(self) -> None:
        self._unknown_arguments(())

    def compute(self, event, trainer, pl_module):
        return {
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "max_steps": trainer.max_steps,
            "max_epochs": trainer.max_epochs,
            "should_stop": bool(trainer.should_stop),
        }


class PerProcessState(MetricHandler):
    """``{"rank", "local_rank", "world_size"}`` of this process (rules on it differ across ranks)."""

    def validate(self) -> None:
        self._unknown_arguments(())

    def compute(self, event, trainer, pl_module):
        return {
            "rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "world_size": trainer.world_size,
        }


class RegularizerState(MetricHandler):
    """Per regularizer of a `RegularizedLM`: ``{name: {"weight", "enabled", "value", "contribution"}}``.

    ``weight`` is the effective weight (schedule included) at the current step; ``value`` and
    ``contribution`` are those of the last optimizer step (NaN before the first one).
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


METRIC_HANDLERS: dict[str, Callable[..., MetricHandler]] = {
    "Loss": Loss,
    "EvalMetrics": EvalMetrics,
    "HistoryBasedMetric": HistoryBasedMetric,
    "TrainingState": TrainingState,
    "PerProcessState": PerProcessState,
    "RegularizerState": RegularizerState,
}


def register_metric_handlers(*handlers: type[MetricHandler], **named: type[MetricHandler]) -> None:
    """Register metric handler classes (by class name, or under the given names)."""
    for handler in handlers:
        named[handler.__name__] = handler
    for name, handler in named.items():
        if not (isinstance(handler, type) and issubclass(handler, MetricHandler)):
            raise TypeError(f"metric handler {name!r} must be a MetricHandler subclass, got {handler!r}")
        METRIC_HANDLERS[name] = handler
