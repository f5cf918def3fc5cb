"""The fms-hf-tuning adapter: what lets fms-hf-tuning's trainer-controller configs and handlers run unchanged
on the Lightning-native controller, in one place. Importing it (``lit_losses.controller`` does) registers:

- Hugging Face's event names as aliases of the Lightning events that mean the same thing (`HF_EVENTS`);
- ``hfcontrols`` (`HFControls`), an operation every config has, setting `TrainerControl` flags;
- fms-hf-tuning's calling convention (`FmsConvention`): ``compute(state=None, **kwargs)`` and actions
  ``should_x(control, **kwargs)``, called with keyword arguments in the Hugging Face style, ``state`` a
  `TrainerStateView` whose ``log_history`` it keeps, the event's arguments (``metrics`` on ``on_evaluate``,
  ``path``/``hf_path``/``is_final`` on ``on_save``);
- `LogControl`'s ``log_format`` (``str.format`` fields over the metrics and `FORMAT_FIELDS`) and
  ``log_level``; ``Operation``, fms-hf-tuning's name of `OperationHandler`.

The schema itself (``controller-metrics``, ``operations``, ``controllers``, patience and its modes
``reset_on_failure``/``no_reset_on_failure``, ``config.trigger_log_level``) is fms-hf-tuning's and the
native controller's alike. Without this module a config naming a Hugging Face event, ``hfcontrols`` or
``log_format``, or a handler written for fms-hf-tuning, is refused.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from typing import Any

import lightning as L

from lit_losses.controller.config import reserve_operation
from lit_losses.controller.control import TrainerControl
from lit_losses.controller.conventions import CallingConvention, lightning_style, register_calling_convention
from lit_losses.controller.entries import Controller
from lit_losses.controller.events import Trigger, register_event_aliases
from lit_losses.controller.log_control import MessageForm, check_format_spec, register_message_form
from lit_losses.controller.metrics import (
    MetricHandler,
    as_number,
    epoch_progress,
    is_final,
    logged_scalars,
)
from lit_losses.controller.operations import OperationHandler, register_operation_handlers
from lit_losses.errors import ConfigError

__all__ = [
    "FORMAT_FIELDS",
    "HF_EVENTS",
    "FmsConvention",
    "HFControls",
    "Operation",
    "TrainerControl",
    "TrainerStateView",
    "eval_metrics",
    "takes_lightning_arguments",
]

# ---- event names -------------------------------------------------------------------------------

HF_EVENTS: dict[str, Trigger | None] = {
    "on_init_end": "on_fit_start",
    "on_train_begin": "on_train_start",
    "on_epoch_begin": "on_train_epoch_start",
    "on_step_begin": "on_optimizer_step_start",
    "on_pre_optimizer_step": "on_before_optimizer_step",
    "on_optimizer_step": "on_optimizer_step_end",
    "on_step_end": "on_optimizer_step_end",
    "on_log": "on_optimizer_step_end",
    "on_substep_end": None,
    "on_epoch_end": "on_train_epoch_end",
    "on_evaluate": "on_validation_end",
    "on_prediction_step": "on_validation_batch_end",
    "on_save": "on_save_checkpoint",
    "on_train_end": "on_train_end",
    "on_predict": None,
    "on_push_begin": None,
}
"""Hugging Face ``TrainerCallback`` event names (as fms-hf-tuning configs use them) and the event they
stand for here (``None``: no Lightning equivalent during ``fit``; using it is an error).

``on_log``: lit_losses logs a step's values at every optimizer step, so it is ``on_optimizer_step_end``.

Example:
    >>> from lit_losses.controller.events import resolve_event
    >>> resolve_event("on_log", "triggers"), resolve_event("on_evaluate", "triggers")
    ('on_optimizer_step_end', 'on_validation_end')
    >>> resolve_event("on_predict", "triggers")
    Traceback (most recent call last):
    ...
    lit_losses.errors.ConfigError: triggers: Hugging Face event 'on_predict' has no Lightning equivalent \
(prediction is not part of fit in Lightning)
"""

_NO_EQUIVALENT = {
    "on_substep_end": "Lightning has no hook for a micro-batch that does not end an accumulation window; "
    "use on_train_batch_end (every micro-batch) or on_optimizer_step_end",
    "on_predict": "prediction is not part of fit in Lightning",
    "on_push_begin": "Lightning does not push to a hub",
}

register_event_aliases(HF_EVENTS, source="Hugging Face", reasons=_NO_EQUIVALENT)

# ---- the calling convention --------------------------------------------------------------------

takes_lightning_arguments = lightning_style
"""Whether a handler method is called the lit_losses way (else fms-hf-tuning's); see `lightning_style`."""


@dataclass
class TrainerStateView:
    """What fms-hf-tuning handlers read from Hugging Face's ``TrainerState``, taken from a Lightning trainer.

    ``epoch`` is fractional (1.0 at the end of the first epoch); ``log_history`` holds one entry per
    optimizer step (``loss``, ``epoch``, ``step``) and per validation (``eval_<metric>``, ``epoch``,
    ``step``) since the controller started (kept only when a metric handler of the config is written for
    fms-hf-tuning).
    """

    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = -1
    num_train_epochs: int = -1
    log_history: list[dict[str, Any]] = field(default_factory=list)
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    best_model_checkpoint: str | None = None

    @classmethod
    def of(cls, trainer: L.Trainer, epoch: float, log_history: list[dict[str, Any]]) -> TrainerStateView:
        checkpoint = getattr(trainer, "checkpoint_callback", None)
        return cls(
            epoch=epoch,
            global_step=trainer.global_step,
            max_steps=trainer.max_steps,
            num_train_epochs=trainer.max_epochs if trainer.max_epochs is not None else -1,
            log_history=log_history,
            is_local_process_zero=trainer.local_rank == 0,
            is_world_process_zero=trainer.is_global_zero,
            best_model_checkpoint=getattr(checkpoint, "best_model_path", None) or None,
        )


def eval_metrics(trainer: L.Trainer, prefix: str = "val/") -> dict[str, float]:
    """The logged validation scalars as Hugging Face names them: ``val/<x>`` as ``eval_<x>``."""
    return {f"eval_{name}": value for name, value in logged_scalars(trainer, prefix).items()}


class FmsConvention(CallingConvention):
    """fms-hf-tuning's calling convention: handler methods take keyword arguments in the Hugging Face style.

    ``compute(state=None, **kwargs)`` and ``should_x(control, **kwargs)`` get every metric value by name
    (``None``: not available yet), the event's arguments, ``event_name`` (as the handler or the controller
    names the event), ``args`` (the trainer), ``state`` (a `TrainerStateView`) and ``control`` (the event's
    `TrainerControl`); actions also ``control_name``.
    """

    def accepts(self, method: Any) -> bool:
        return not lightning_style(method)

    def event_arguments(self, event: str, trainer: L.Trainer) -> dict[str, Any]:
        """``metrics`` (``eval_<x>``) on ``on_validation_end``; ``path``, ``hf_path`` (the checkpoint
        folder) and ``is_final`` on ``on_save_checkpoint``."""
        if event == "on_validation_end":
            return {"metrics": eval_metrics(trainer)}
        if event == "on_save_checkpoint":
            folder = getattr(trainer.checkpoint_callback, "dirpath", None) or trainer.default_root_dir
            return {"path": folder, "hf_path": folder, "is_final": is_final(trainer, epoch_progress(trainer))}
        return {}

    @staticmethod
    def log_history(callback: Any) -> list[dict[str, Any]]:
        """The ``log_history`` kept for ``callback`` (a `TrainingController`)."""
        return callback.convention_state.setdefault("fms_log_history", [])

    def before_event(self, firing: Any) -> None:
        """Append the event's logged values to ``log_history``: the step's loss after an optimizer step,
        the validation metrics after a validation."""
        step, metrics = firing.trainer.global_step, firing.trainer.callback_metrics
        if firing.event == "on_optimizer_step_end" and "train/loss_total" in metrics:
            entry = {"loss": as_number(metrics["train/loss_total"])}
        elif firing.event == "on_validation_end":
            entry = dict(firing.extras.get("metrics", {}))
        else:
            return
        self.log_history(firing.callback).append({**entry, "epoch": firing.epoch, "step": step})

    def state(self, firing: Any) -> TrainerStateView:
        """The `TrainerStateView` of the event."""
        return TrainerStateView.of(firing.trainer, firing.epoch, self.log_history(firing.callback))

    def action_context(self, firing: Any) -> dict[str, Any]:
        """``state``, for lit_losses-style actions too (e.g. `LogControl`'s ``log_format``)."""
        return {"state": self.state(firing)}

    def keyword_arguments(self, firing: Any, event_name: str) -> dict[str, Any]:
        """Every metric by name, the event's arguments, ``event_name``, ``args``, ``state``, ``control``."""
        callback = firing.callback
        metrics = {name: callback.values.get(name) for name in callback.config.metrics}
        named = {"event_name": event_name, "args": firing.trainer, "state": self.state(firing)}
        return {**metrics, **firing.extras, **named, "control": firing.control}

    def compute(self, handler: MetricHandler, firing: Any) -> Any:
        event_name = handler.event_names.get(firing.event, firing.event)
        return handler.compute(**self.keyword_arguments(firing, event_name))

    def act(self, method: Any, firing: Any, controller: Controller) -> None:
        event_name = controller.trigger_names.get(firing.event, firing.event)
        method(**{**self.keyword_arguments(firing, event_name), "control_name": controller.name})


FMS_CONVENTION = register_calling_convention(FmsConvention())

# ---- hfcontrols ----------------------------------------------------------------------------------


class HFControls(OperationHandler):
    """Hugging Face's ``TrainerControl`` flags, as fms-hf-tuning's ``hfcontrols`` (always available under
    that name): each action sets its flag and the controller does what it asks, on every rank, once the
    event's controllers have run.

    - ``should_training_stop``: stop after this step.
    - ``should_epoch_stop``: end the epoch after this optimizer step (requested mid-window, at the end
      of the window).
    - ``should_save``: save a checkpoint (as ``lightning.should_save_checkpoint``).
    - ``should_evaluate``: run the validation loop now (as ``lightning.should_validate``).
    - ``should_log``: send the current metrics to the loggers.
    """

    every_rank = ("should_training_stop", "should_epoch_stop", "should_save", "should_evaluate", "should_log")

    def validate(self, metric_names):
        self._unknown_arguments(())

    def _flag(self, context: dict, flag: str) -> None:
        setattr(context["control"], flag, True)

    def should_training_stop(self, trainer, pl_module, context) -> None:
        self._flag(context, "should_training_stop")

    def should_epoch_stop(self, trainer, pl_module, context) -> None:
        self._flag(context, "should_epoch_stop")

    def should_save(self, trainer, pl_module, context) -> None:
        self._flag(context, "should_save")

    def should_evaluate(self, trainer, pl_module, context) -> None:
        self._flag(context, "should_evaluate")

    def should_log(self, trainer, pl_module, context) -> None:
        self._flag(context, "should_log")


register_operation_handlers(HFControls)
reserve_operation("hfcontrols", HFControls)

Operation = OperationHandler
"""fms-hf-tuning's name of `OperationHandler`."""

# ---- log_format ----------------------------------------------------------------------------------

FORMAT_FIELDS = (
    "event_name",
    "control_name",
    "args",
    "state",
    "control",
    "path",
    "hf_path",
    "is_final",
    "metrics",
)
"""The ``log_format`` fields besides the metric names (fms-hf-tuning's keyword arguments): the event as
the controller names it, the controller, the trainer (``args``), a `TrainerStateView`, the
`TrainerControl`; on ``on_save``: the checkpoint folder (``path``, ``hf_path``) and ``is_final``; on
``on_evaluate``: the validation ``metrics`` (``eval_<x>``)."""


def _check_log_format(text: str, metric_names: tuple[str, ...]) -> None:
    allowed = {*metric_names, *FORMAT_FIELDS}
    try:
        fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(text) if f is not None]
    except ValueError as exc:
        raise ConfigError(f"arguments.log_format is not a format string: {exc}") from None
    for name, spec, conversion in fields:
        root = re.split(r"[.\[]", name, maxsplit=1)[0]
        if root not in allowed:
            raise ConfigError(f"arguments.log_format: unknown field {{{name}}}; known: {sorted(allowed)}")
        if conversion not in (None, "r", "s", "a"):
            raise ConfigError(
                f"arguments.log_format: {{{name}!{conversion}}} has an unknown conversion; use !r, !s or !a"
            )
        check_format_spec(spec or "", name, "arguments.log_format")


def _render_log_format(text: str, context: dict[str, Any]) -> str:
    formatter = string.Formatter()
    names: dict[str, Any] = {
        **context["metrics"],
        "event_name": context["event_name"],
        "control_name": context["controller"],
        "args": context.get("trainer"),
        "state": context.get("state"),
        "control": context.get("control"),
        **context.get("event_kwargs", {}),
    }
    parts = []
    for literal, name, spec, conversion in formatter.parse(text):
        parts.append(literal)
        if name is None:
            continue
        try:
            value = formatter.convert_field(formatter.get_field(name, (), names)[0], conversion)
            parts.append(formatter.format_field(value, spec or ""))
        except Exception as exc:  # a field not available on this event
            parts.append(f"<{name}: {type(exc).__name__}>")
    return "".join(parts)


register_message_form(MessageForm("log_format", "log_level", _check_log_format, render=_render_log_format))
