"""Operation handlers: what controllers do. Actions are methods named ``should_*``."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Literal, get_args

import lightning as L

from lit_losses.controller.registration import register_classes, subclass_of
from lit_losses.controller.rules import RuleEvaluator, check_rule
from lit_losses.errors import ConfigError
from lit_losses.registry import Registry

log = logging.getLogger("lit_losses.controller")

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
"""A `LogControl` level (case-insensitive in the YAML)."""

LOG_LEVELS: tuple[LogLevel, ...] = get_args(LogLevel)


class OperationHandler:
    """A named set of actions (methods ``should_<action>(trainer, pl_module, context)``).

    ``context`` holds the controller name (``"controller"``), the hook (``"event"``) and the metric
    values (``"metrics"``) of the firing rule; actions may add entries to it. `every_rank` lists the
    actions that must run on every rank (collectives such as checkpointing); the others run on rank 0
    only. Register a subclass with `register_operation_handlers` to use it as ``class`` in the YAML.

    Args:
        name: the name controllers use (``<name>.<action>`` in their ``operations``).
        **arguments: the entry's ``arguments`` mapping, checked by `validate`.
    """

    every_rank: tuple[str, ...] = ()
    """Actions that run on every rank; the others run on rank 0 only."""

    def __init__(self, name: str, **arguments: Any) -> None:
        self.name, self.arguments = name, arguments

    @classmethod
    def actions(cls) -> tuple[str, ...]:
        """The action names (methods ``should_*``), sorted."""
        return tuple(sorted(a for a in dir(cls) if a.startswith("should_") and callable(getattr(cls, a))))

    def validate(self, metric_names: tuple[str, ...]) -> None:
        """Check the arguments, once, when the config is parsed.

        Args:
            metric_names: the metric names in scope of rules (and of message placeholders).

        Raises:
            ConfigError: bad arguments (the message is prefixed with the entry's YAML path).
        """

    def _unknown_arguments(self, allowed: tuple[str, ...]) -> None:
        unknown = sorted(set(self.arguments) - set(allowed))
        if unknown:
            raise ConfigError(f"unknown arguments {unknown} (allowed: {list(allowed)})")


class LightningOperations(OperationHandler):
    """The trainer's own operations (always available as ``lightning``).

    - ``should_training_stop``: ``trainer.should_stop = True`` (Lightning stops after this step).
    - ``should_save_checkpoint``: ``trainer.save_checkpoint`` on every rank, to
      ``<dirpath>/controller-<controller>-step<N>.ckpt`` (argument ``dirpath``, default
      ``<default_root_dir>/controller-checkpoints``).
    - ``should_validate``: run the validation loop now (during training only; an error without
      validation data).
    - ``should_log``: send the current scalar metrics to the loggers at this step.
    """

    every_rank = ("should_training_stop", "should_save_checkpoint", "should_validate")

    def validate(self, metric_names):
        self._unknown_arguments(("dirpath",))

    def should_training_stop(self, trainer: L.Trainer, pl_module: L.LightningModule, context: dict) -> None:
        trainer.should_stop = True

    def should_save_checkpoint(self, trainer, pl_module, context) -> None:
        dirpath = Path(
            self.arguments.get("dirpath") or Path(trainer.default_root_dir) / "controller-checkpoints"
        )
        path = dirpath / f"controller-{context['controller']}-step{trainer.global_step}.ckpt"
        trainer.save_checkpoint(path)
        context["checkpoint_path"] = str(path)

    def should_validate(self, trainer, pl_module, context) -> None:
        if not trainer.training or trainer.validating or trainer.sanity_checking:
            return
        if not _has_validation_data(trainer):
            raise RuntimeError(
                f"controller {context['controller']!r}: should_validate without validation data"
            )
        _validate_inside_fit(trainer)

    def should_log(self, trainer, pl_module, context) -> None:
        metrics = {
            k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


# ---- Lightning internals ------------------------------------------------------------------------
# Lightning has no public API to run the validation loop in the middle of `fit` (checked against
# lightning 2.6.6): `Trainer.validate` starts a run of its own, and when validation happens is fixed by
# `val_check_interval` / `check_val_every_n_epoch` at the start of fit. So `should_validate` does what
# `_TrainingEpochLoop.on_advance_end` does around a scheduled validation, private attributes included.
# Re-check these two helpers (and tests/controller/test_operations.py) when upgrading Lightning.


def _has_validation_data(trainer: L.Trainer) -> bool:
    """Whether fit was given validation data (loaded lazily, so `val_dataloaders` may still be None)."""
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    return bool(trainer.val_dataloaders) or val_loop._data_source.is_defined()


def _validate_inside_fit(trainer: L.Trainer) -> None:
    """Run the validation loop now, as Lightning does for ``val_check_interval < 1``.

    The logger connector's ``_first_loop_iter`` tells whether logged values are step- or epoch-level;
    the validation loop resets it, so it is saved and restored (else the training metrics logged after
    the validation would be taken as epoch-level).
    """
    trainer.validating = True  # so that the trainer's active loop is the validation loop
    first_loop_iter = trainer._logger_connector._first_loop_iter
    trainer.fit_loop.epoch_loop.val_loop.run()
    trainer.training = True
    trainer._logger_connector._first_loop_iter = first_loop_iter


_PLACEHOLDER = re.compile(r"\{([^{}]+)\}")


class LogControl(OperationHandler):
    """``should_log``: a message at ``level`` (a `LogLevel`, default ``INFO``) with ``{expr}`` placeholders.

    Placeholders are rule expressions over the metrics (validated like rules), e.g.
    ``"loss {train_loss['loss']:.3f} at step {state['global_step']}"`` (a format spec may follow ``:``).
    A placeholder that cannot be evaluated yet renders as ``<expression: ErrorName>``. The message is
    logged on the ``lit_losses.controller`` logger and stored as ``context["message"]``.
    """

    def validate(self, metric_names):
        self._unknown_arguments(("message", "level"))
        level = str(self.arguments.get("level", "INFO")).upper()
        if level not in LOG_LEVELS:
            raise ConfigError(f"arguments.level {level!r} is not a logging level")
        message = self.arguments.get("message")
        if not isinstance(message, str):
            raise ConfigError("LogControl needs arguments.message (a string)")
        for expression in _PLACEHOLDER.findall(message):
            check_rule(_split_format(expression)[0], metric_names)
        self._evaluator = RuleEvaluator()

    def should_log(self, trainer, pl_module, context) -> None:
        def render(match: re.Match) -> str:
            expression, spec = _split_format(match.group(1))
            try:
                return format(self._evaluator.evaluate(expression, context["metrics"]), spec)
            except Exception as exc:  # a metric not available yet: say so in the message
                return f"<{expression}: {type(exc).__name__}>"

        message = _PLACEHOLDER.sub(render, self.arguments["message"])
        level = getattr(logging, str(self.arguments.get("level", "INFO")).upper())
        log.log(level, "[controller %s] %s", context["controller"], message)
        context["message"] = message


def _split_format(expression: str) -> tuple[str, str]:
    head, sep, spec = expression.rpartition(":")
    if sep and re.fullmatch(r"[<>=^+\- #0-9,._a-zA-Z%]*", spec) and head.count("[") == head.count("]"):
        return head, spec
    return expression, ""


class RegularizerControl(OperationHandler):
    """Change a `RegularizedLM`'s regularizer ``regularizer`` (argument) at run time.

    - ``should_set_weight`` (argument ``value``), ``should_scale_weight`` (argument ``factor``),
    - ``should_enable``, ``should_disable``.

    Runs on every rank (the weights must stay identical across ranks). The regularizer name is
    checked against the module by `check_module` (at the controller's ``setup``).
    """

    every_rank = ("should_set_weight", "should_scale_weight", "should_enable", "should_disable")

    def validate(self, metric_names):
        self._unknown_arguments(("regularizer", "value", "factor"))
        if not isinstance(self.arguments.get("regularizer"), str):
            raise ConfigError("RegularizerControl needs arguments.regularizer (a regularizer name)")

    def check_module(self, pl_module: L.LightningModule) -> None:
        """Check that ``pl_module`` has the regularizer.

        Raises:
            ConfigError: a module without regularizers, or without this one.
        """
        terms = getattr(pl_module, "regularizer_set", None)
        if terms is None:
            raise ConfigError(
                f"{type(pl_module).__name__} has no regularizers (RegularizerControl needs a RegularizedLM)"
            )
        if self.arguments["regularizer"] not in terms:
            raise ConfigError(
                f"unknown regularizer {self.arguments['regularizer']!r}; known: {sorted(terms.terms)}"
            )

    def should_set_weight(self, trainer, pl_module, context) -> None:
        pl_module.regularizer_set.set_weight(self.arguments["regularizer"], float(self._require("value")))

    def should_scale_weight(self, trainer, pl_module, context) -> None:
        pl_module.regularizer_set.scale_weight(self.arguments["regularizer"], float(self._require("factor")))

    def should_enable(self, trainer, pl_module, context) -> None:
        pl_module.regularizer_set.set_enabled(self.arguments["regularizer"], True)

    def should_disable(self, trainer, pl_module, context) -> None:
        pl_module.regularizer_set.set_enabled(self.arguments["regularizer"], False)

    def _require(self, key: str) -> Any:
        if key not in self.arguments:
            raise ConfigError(f"operation {self.name!r} needs arguments.{key}")
        return self.arguments[key]


class LRControl(OperationHandler):
    """``should_scale_lr``: multiply the learning rate of every optimizer by ``factor`` (argument).

    The schedulers' base rates are scaled too, so that the schedule continues from the new level.
    """

    every_rank = ("should_scale_lr",)

    def validate(self, metric_names):
        self._unknown_arguments(("factor",))
        factor = self.arguments.get("factor")
        if not isinstance(factor, int | float) or factor <= 0:
            raise ConfigError(f"LRControl needs arguments.factor > 0, got {factor!r}")

    def should_scale_lr(self, trainer, pl_module, context) -> None:
        factor = float(self.arguments["factor"])
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] *= factor
        for config in trainer.lr_scheduler_configs:
            if hasattr(config.scheduler, "base_lrs"):
                config.scheduler.base_lrs = [lr * factor for lr in config.scheduler.base_lrs]


OPERATION_HANDLERS: Registry[type[OperationHandler]] = Registry(
    "operation class", adapt=subclass_of(OperationHandler, "operation handler")
)
"""Operation handler classes by name (the YAML ``class`` of an ``operations`` entry)."""


def register_operation_handlers(
    *handlers: type[OperationHandler] | list[type[OperationHandler]], **named: type[OperationHandler]
) -> None:
    """Register `OperationHandler` subclasses (a YAML ``operations`` entry's ``class``), under their class
    name, or under the keyword's name; lists are accepted as in fms-hf-tuning. The rules and errors are
    those of `register_metric_handlers`.

    Example:
        >>> from lit_losses.controller import OPERATION_HANDLERS, OperationHandler
        >>> class Notify(OperationHandler):
        ...     def should_notify(self, trainer, pl_module, context):
        ...         print("rule fired at step", trainer.global_step)
        >>> register_operation_handlers([Notify])
        >>> "Notify" in OPERATION_HANDLERS
        True
    """
    register_classes(OPERATION_HANDLERS, handlers, named)


register_operation_handlers(LightningOperations, LogControl, RegularizerControl, LRControl)
