"""Metric handlers: what rules can read. A dict value carries the ``step`` it was computed at."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lightning as L

from lit_losses.controller.conventions import lightning_style
from lit_losses.controller.events import ALL_EVENTS, EVENT_ALIASES, aliases_of, resolve_event
from lit_losses.controller.handler import Handler
from lit_losses.controller.registration import register_classes, subclass_of
from lit_losses.errors import ConfigError
from lit_losses.registry import Registry


def as_number(value: Any) -> float:
    """A logged value (a tensor of one element or a number) as a float."""
    return float(value.item() if hasattr(value, "item") else value)


def logged_scalars(trainer: L.Trainer, prefix: str) -> dict[str, float]:
    """The logged scalars whose name starts with ``prefix``, by the rest of their name."""
    return {
        key[len(prefix) :]: as_number(value)
        for key, value in trainer.callback_metrics.items()
        if key.startswith(prefix) and getattr(value, "numel", lambda: 1)() == 1
    }


def epoch_progress(trainer: L.Trainer) -> float:
    """The fractional epoch, as Hugging Face counts it: ``e + b / n`` during epoch ``e`` after ``b`` of its
    ``n`` micro-batches, so 1.0 at the end of the first epoch (Lightning's ``current_epoch`` is still 0
    there)."""
    epochs = trainer.fit_loop.epoch_progress.current
    if epochs.started <= epochs.processed:  # between epochs
        return float(epochs.processed)
    total = trainer.num_training_batches
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    if not total or total == float("inf"):
        return float(epochs.processed)
    return epochs.processed + min(done, total) / total


class MetricHandler(Handler):
    """A named source of values for rules.

    Subclasses set `events` (the events they compute on: they compute on each of them, whatever the
    controllers' triggers, so that a window of past values is unaffected by when rules run), check
    their arguments in `validate` and return the values from `compute` (a dict gets the ``step`` of
    the computation added). ``None`` means "not available yet": rules that use it skip. Register a
    subclass with `register_metric_handlers` to use it as ``class`` in the YAML (or give its import
    path).

    A ``compute`` written in another calling convention is called through it
    (`lit_losses.controller.conventions`; fms-hf-tuning's: ``compute(state=None, **kwargs)``,
    `lit_losses.controller.fms`).

    Args:
        name: the name rules use for the values (``name`` in the YAML).
        events: overrides the class's `events` (events or their registered aliases).
        **arguments: the entry's ``arguments`` mapping, checked by `validate`.

    Example:
        >>> from lit_losses.controller import MetricHandler
        >>> class Constant(MetricHandler):
        ...     def compute(self, event, trainer, pl_module):
        ...         return {"value": self.arguments["value"]}
        >>> Constant("const", value=3).compute("on_train_batch_end", None, None)
        {'value': 3}
    """

    events: Sequence[str] = ALL_EVENTS
    """The events on which `compute` is called (registered aliases, such as Hugging Face's, are accepted)."""

    def __init__(self, name: str, events: Sequence[str] | None = None, **arguments: Any) -> None:
        self.name = name
        self.arguments = arguments
        self.kwargs = arguments  # fms-hf-tuning's name of `arguments`
        if events is not None:
            self.events = tuple(events)
        self.event_names: dict[str, str] = {}
        """Each event this handler computes on and the name it declared it with (set by the config)."""

    def get_name(self) -> str:
        """The handler's name (fms-hf-tuning's accessor)."""
        return self.name

    def lightning_style(self) -> bool:
        """Whether `compute` takes ``(event, trainer, pl_module)`` (else another calling convention's)."""
        return lightning_style(self.compute)

    def get_events(self) -> list[str]:
        """The events it declared (fms-hf-tuning's accessor)."""
        return list(self.events)

    def validate(self) -> bool | None:
        """Check the arguments, once, when the config is parsed.

        Returns:
            ``False`` to refuse them (as fms-hf-tuning handlers do); anything else accepts them.

        Raises:
            ConfigError: bad arguments (the message is prefixed with the entry's YAML path).
        """
        return None

    def compute(self, event: str, trainer: L.Trainer, pl_module: L.LightningModule) -> Any:
        """The current values, or ``None`` when they are not available yet.

        Args:
            event: the event being run (one of `events`).
            trainer: the running trainer.
            pl_module: the module being trained.

        Returns:
            The values (usually a dict; the controller adds ``step`` to a dict), or ``None``.
        """
        raise NotImplementedError


class Loss(MetricHandler):
    """The latest logged training loss: ``{"loss": value, "epoch": fractional epoch}``.

    Arguments (YAML): ``key``, the logged metric to read (default ``train/loss_total``, logged once per
    optimizer step). Computed after each optimizer step and at the end of each epoch; not available
    until the metric was logged.
    """

    events = ("on_optimizer_step_end", "on_train_epoch_end")

    def validate(self) -> None:
        self._unknown_arguments(("key",))

    def compute(self, event, trainer, pl_module):
        value = trainer.callback_metrics.get(self.arguments.get("key", "train/loss_total"))
        return None if value is None else {"loss": as_number(value), "epoch": epoch_progress(trainer)}


EVAL_EVENTS = ("on_validation_end", "on_validation_epoch_end")
"""``EvalMetrics``' ``source_event`` choices (their registered aliases are accepted too)."""


class EvalMetrics(MetricHandler):
    """Validation metrics: each logged ``val/<x>`` as ``x`` and, as Hugging Face names them, ``eval_<x>``
    (``{"loss": …, "eval_loss": …}``).

    Arguments (YAML): ``prefix`` (default ``val/``) and ``source_event``, when to read them:
    ``on_validation_end`` (default) or ``on_validation_epoch_end``, or an alias of them (`EVENT_ALIASES`).
    Not available before the first validation.
    """

    events = ("on_validation_end",)

    def validate(self) -> None:
        self._unknown_arguments(("prefix", "source_event"))
        source = self.arguments.get("source_event", "on_validation_end")
        if source in EVENT_ALIASES and EVENT_ALIASES[source].event is None:
            resolve_event(source, "source_event")  # the alias's own error: no equivalent during fit
        choices = [*EVAL_EVENTS, *aliases_of(EVAL_EVENTS)]
        if source not in choices:
            raise ConfigError(f"source_event {source!r} is invalid for EvalMetrics; choose among {choices}")
        self.events = (resolve_event(source, "source_event"),)

    def compute(self, event, trainer, pl_module):
        values: dict[str, float] = {}
        for name, value in logged_scalars(trainer, self.arguments.get("prefix", "val/")).items():
            values[name] = values[f"eval_{name}"] = value
        return values or None


def is_final(trainer: L.Trainer, epoch: float) -> bool:
    """Whether training ends after this step (``max_steps``, ``max_epochs`` or a requested stop)."""
    max_steps, max_epochs = trainer.max_steps, trainer.max_epochs
    return bool(
        trainer.should_stop
        or (max_steps is not None and max_steps >= 0 and trainer.global_step >= max_steps)
        or (max_epochs is not None and max_epochs >= 0 and epoch >= max_epochs)
    )


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
    """The trainer's state, with Hugging Face's ``TrainerState`` names where they exist:

    ``epoch`` (fractional: 1.0 at the end of the first epoch, as fms-hf-tuning rules expect),
    ``current_epoch`` (Lightning's, an integer), ``global_step`` (optimizer steps), ``max_steps``,
    ``max_epochs`` (= ``num_train_epochs``), ``should_stop``, ``is_final`` (training ends after this step),
    ``is_world_process_zero``, ``is_local_process_zero``.
    """

    fields = (
        ("current_epoch", "current_epoch"),
        ("global_step", "global_step"),
        ("max_steps", "max_steps"),
        ("max_epochs", "max_epochs"),
        ("num_train_epochs", "max_epochs"),
        ("should_stop", "should_stop"),
        ("is_world_process_zero", "is_global_zero"),
    )

    def compute(self, event, trainer, pl_module):
        epoch = epoch_progress(trainer)
        values = super().compute(event, trainer, pl_module)
        values.update(
            epoch=epoch, is_final=is_final(trainer, epoch), is_local_process_zero=trainer.local_rank == 0
        )
        return values


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


register_metric_handlers(Loss, EvalMetrics, TrainingState, PerProcessState, RegularizerState)
