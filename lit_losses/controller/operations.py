"""Operation handlers: what controllers do. Actions are methods named ``should_<something>``."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

import lightning as L

from lit_losses.controller.handler import Handler
from lit_losses.controller.loop import log_now, save_now, scale_learning_rate, validate_inside_fit
from lit_losses.controller.registration import register_classes, subclass_of
from lit_losses.errors import ConfigError
from lit_losses.registry import Registry

log = logging.getLogger("lit_losses.controller")

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
"""A logging level (case-insensitive in the YAML)."""

LOG_LEVELS: tuple[LogLevel, ...] = get_args(LogLevel)

_ACTION = re.compile(r"should_.+")


@dataclass(frozen=True)
class ControllerStop:
    """A controller's ``should_training_stop``: which controller, at which optimizer step, and the exit
    status it asks ``lit-losses`` for (``None``: 0, as a finished run)."""

    controller: str
    step: int
    exit_code: int | None = None


class OperationHandler(Handler):
    """A named set of actions: methods ``should_<action>(trainer, pl_module, context)``.

    ``context`` holds the controller name (``"controller"``), the event (``"event"``), the metric values
    (``"metrics"``), the controller itself (``"callback"``) and a `TrainerControl` (``"control"``) whose
    flags the controller obeys on every rank once the event's controllers have run; actions may add
    entries to it. `every_rank` lists the actions that must run on every rank (collectives such as
    checkpointing, changes to the model or optimizer); the others run on rank 0 only. Register a
    subclass with `register_operation_handlers` to use it as ``class`` in the YAML.

    An action written in another calling convention is called through it
    (`lit_losses.controller.conventions`; fms-hf-tuning's ``should_x(self, control, **kwargs)``:
    `lit_losses.controller.fms`).

    Hooks for handlers that keep state across steps: `setup` (before training; check the module),
    `start` (training starts), `after_step` (after every optimizer step's controllers), `state_dict`.

    Args:
        name: the name controllers use (``<name>.<action>`` in their ``operations``).
        **arguments: the entry's ``arguments`` mapping, checked by `validate`.
    """

    every_rank: tuple[str, ...] = ()
    """Actions that run on every rank; the others run on rank 0 only."""
    action_triggers: Mapping[str, tuple[str, ...]] = {}
    """Actions that may only run on some events: action -> the allowed triggers."""
    action_arguments: Mapping[str, tuple[str, ...]] = {}
    """Arguments some actions need: action -> the arguments (a controller using the action on an
    operation without them is refused when the config is parsed)."""

    def __init__(self, name: str, **arguments: Any) -> None:
        self.name = name
        self.arguments = arguments
        self.kwargs = arguments  # fms-hf-tuning's name of `arguments`

    def actions(self) -> tuple[str, ...]:
        """The action names (methods ``should_<something>``), sorted."""
        return tuple(sorted(a for a in dir(self) if _ACTION.fullmatch(a) and callable(getattr(self, a))))

    def get_name(self) -> str:
        """The operation's name (fms-hf-tuning's accessor)."""
        return self.name

    def get_actions(self) -> tuple[str, ...]:
        """fms-hf-tuning's name of `actions`."""
        return self.actions()

    def validate(self, metric_names: tuple[str, ...]) -> None:
        """Check the arguments, once, when the config is parsed.

        Args:
            metric_names: the metric names in scope of rules (and of message placeholders).

        Raises:
            ConfigError: bad arguments (the message is prefixed with the entry's YAML path).
        """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Check the operation against the module before training (raise `ConfigError`)."""

    def start(self, trainer: L.Trainer, pl_module: L.LightningModule, controller: Any) -> None:
        """Training starts (the data, the optimizers and a resumed checkpoint's state are in place)."""

    def after_step(self, trainer: L.Trainer, pl_module: L.LightningModule, controller: Any) -> None:
        """An optimizer step ended and the controllers triggered by it have run."""


class LightningOperations(OperationHandler):
    """The trainer's own operations (always available as ``lightning``).

    - ``should_training_stop``: ``trainer.should_stop = True`` (Lightning stops after this step).
    - ``should_save_checkpoint``: ``trainer.save_checkpoint`` on every rank, to
      ``<dirpath>/controller-<controller>-step<N>.ckpt`` (argument ``dirpath``, default
      ``<default_root_dir>/controller-checkpoints``).
    - ``should_validate``: run the validation loop now (during training only; an error without
      validation data).
    - ``should_log``: send the current scalar metrics to the loggers at this step.

    Argument ``exit_code`` (an integer in [1, 125], default none): a stop by ``should_training_stop``
    makes ``lit-losses`` exit with this status (the controller's `TrainingController.stop` records it), so
    that a scheduler or a script tells a run a rule stopped from one that finished.
    """

    every_rank = ("should_training_stop", "should_save_checkpoint", "should_validate")

    def validate(self, metric_names):
        self._unknown_arguments(("dirpath", "exit_code"))
        code = self.arguments.get("exit_code")
        if code is not None and (isinstance(code, bool) or not isinstance(code, int) or not 1 <= code <= 125):
            raise ConfigError(
                f"exit_code={code!r} must be an integer in [1, 125] (0 is a finished run; 126 and above are "
                "the shell's and signals')"
            )

    def should_training_stop(self, trainer: L.Trainer, pl_module: L.LightningModule, context: dict) -> None:
        trainer.should_stop = True
        callback = context.get("callback")
        if callback is not None and hasattr(callback, "stop"):
            callback.stop = ControllerStop(
                controller=context["controller"],
                step=trainer.global_step,
                exit_code=self.arguments.get("exit_code"),
            )

    def should_save_checkpoint(self, trainer, pl_module, context) -> None:
        if context["event"] == "on_save_checkpoint":
            return  # already saving one
        context["checkpoint_path"] = save_now(trainer, self.arguments.get("dirpath"), context["controller"])

    def should_validate(self, trainer, pl_module, context) -> None:
        validate_inside_fit(trainer, context["controller"])

    def should_log(self, trainer, pl_module, context) -> None:
        log_now(trainer)


class RegularizerControl(OperationHandler):
    """Change a `RegularizedLM`'s regularizer ``regularizer`` (argument) at run time.

    - ``should_set_weight`` (argument ``value``), ``should_scale_weight`` (argument ``factor``),
    - ``should_enable``, ``should_disable``.

    Runs on every rank (the weights must stay identical across ranks). The regularizer name is
    checked against the module by `check_module` (at the controller's ``setup``).
    """

    every_rank = ("should_set_weight", "should_scale_weight", "should_enable", "should_disable")
    action_arguments: ClassVar[dict[str, tuple[str, ...]]] = {
        "should_set_weight": ("value",),
        "should_scale_weight": ("factor",),
    }

    def validate(self, metric_names):
        self._unknown_arguments(("regularizer", "value", "factor"))
        if not isinstance(self.arguments.get("regularizer"), str):
            raise ConfigError("RegularizerControl needs arguments.regularizer (a regularizer name)")
        for key in ("value", "factor"):
            value = self.arguments.get(key, 0.0)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ConfigError(
                    f"RegularizerControl: arguments.{key} must be a finite number, got {value!r}"
                )

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
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
        scale_learning_rate(trainer, float(self.arguments["factor"]))


OPERATION_HANDLERS: Registry[type[OperationHandler]] = Registry(
    "operation class", adapt=subclass_of(OperationHandler, "operation handler")
)
"""Operation handler classes by name (the YAML ``class`` of an ``operations`` entry)."""


def register_operation_handlers(
    *handlers: type[OperationHandler] | list[type[OperationHandler]], **named: type[OperationHandler]
) -> None:
    """Register `OperationHandler` subclasses (a YAML ``operations`` entry's ``class``), under their class
    name, or under the keyword's name; a list of classes is accepted too. The rules and errors are
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


register_operation_handlers(LightningOperations, RegularizerControl, LRControl)
