"""One event of a `TrainingController`: handlers computed and operations performed with the arguments each
expects (lit_losses' Lightning objects or fms-hf-tuning's keywords), and the trainer doing what they ask."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import lightning as L

from lit_losses.controller.decisions import (
    ELSEWHERE,
    any_rank,
    combine_across_ranks,
    evaluate,
    patience_reached,
)
from lit_losses.controller.entries import Controller
from lit_losses.controller.fms import TrainerControl, TrainerStateView, takes_lightning_arguments
from lit_losses.controller.loop import log_now, save_now, validate_inside_fit
from lit_losses.controller.metrics import MetricHandler, _number
from lit_losses.controller.rules import RuleFailure

log = logging.getLogger("lit_losses.controller")


def eval_metrics(trainer: L.Trainer, prefix: str = "val/") -> dict[str, float]:
    """The logged validation scalars as Hugging Face names them: ``val/<x>`` as ``eval_<x>``."""
    return {
        f"eval_{key[len(prefix) :]}": _number(value)
        for key, value in trainer.callback_metrics.items()
        if key.startswith(prefix) and getattr(value, "numel", lambda: 1)() == 1
    }


@dataclass
class Firing:
    """What one event of a controller needs: the event, the Lightning objects, the event's keyword
    arguments (``metrics`` on validation end; ``path``, ``hf_path``, ``is_final`` on checkpoint save),
    the fractional epoch, and the `TrainerControl` that the event's operations set."""

    callback: Any
    event: str
    trainer: L.Trainer
    pl_module: L.LightningModule
    extras: dict[str, Any]
    epoch: float
    control: TrainerControl = field(default_factory=TrainerControl)
    requested_by: list[str] = field(default_factory=list)

    def state(self) -> TrainerStateView:
        return TrainerStateView.of(self.trainer, self.epoch, self.callback.log_history)

    def fms_arguments(self, event_name: str) -> dict[str, Any]:
        """fms-hf-tuning's keyword arguments: every metric by name (``None``: not available yet), the
        event's arguments, ``event_name``, ``args`` (the trainer), ``state`` and ``control``."""
        metrics = {name: self.callback.values.get(name) for name in self.callback.config.metrics}
        return {
            **metrics,
            **self.extras,
            "event_name": event_name,
            "args": self.trainer,
            "state": self.state(),
            "control": self.control,
        }

    def compute(self, handler: MetricHandler) -> Any:
        if handler.lightning_style():
            return handler.compute(self.event, self.trainer, self.pl_module)
        return handler.compute(**self.fms_arguments(handler.event_names.get(self.event, self.event)))

    def record_history(self) -> None:
        """Append this event's logged values to ``log_history`` (what fms-hf-tuning handlers read)."""
        step, metrics = self.trainer.global_step, self.trainer.callback_metrics
        if self.event == "on_optimizer_step_end" and "train/loss_total" in metrics:
            entry = {"loss": _number(metrics["train/loss_total"])}
        elif self.event == "on_validation_end":
            entry = dict(self.extras.get("metrics", {}))
        else:
            return
        self.callback.log_history.append({**entry, "epoch": self.epoch, "step": step})


def handle(firing: Firing) -> None:
    """One event: the metric handlers that compute on it recompute, the controllers it triggers evaluate
    their rules (outcomes combined across ranks), patience counts, the operations run, the trainer does
    what they asked; after an optimizer step, the operation handlers' `after_step`."""
    callback, event, trainer, pl_module = firing.callback, firing.event, firing.trainer, firing.pl_module
    step = trainer.global_step
    if callback._keeps_history:
        firing.record_history()
    recompute_metrics(firing)
    controllers = callback._by_event.get(event, [])
    outcomes = [evaluate(c, callback.evaluator, callback.values, step, event) for c in controllers]
    acted = False
    for controller, outcome in zip(
        controllers, combine_across_ranks(trainer, pl_module, outcomes), strict=True
    ):
        if outcome.error is not None:
            report_rule_error(firing, controller, outcome.error)
        elif not outcome.evaluated:
            missing = sorted(controller.names - callback.values.keys())
            callback._once(
                controller.name,
                f"controller {controller.name!r}: metrics {missing} not available yet; rule skipped",
            )
        elif patience_reached(callback.counters, controller, outcome.holds):
            perform(firing, controller)
            acted = True
    if acted:
        obey(firing)
    if event == "on_optimizer_step_end":
        for handler in callback.config.operations.values():
            handler.after_step(trainer, pl_module, callback)


def recompute_metrics(firing: Firing) -> None:
    """Recompute the metric handlers that compute on the event (a dict value gets the global ``step``)."""
    values, step = firing.callback.values, firing.trainer.global_step
    for name, handler in firing.callback.config.metrics.items():
        if firing.event in handler.events:
            value = firing.compute(handler)
            if value is not None:
                values[name] = {**value, "step": step} if isinstance(value, Mapping) else value


def report_rule_error(firing: Firing, controller: Controller, error: str) -> None:
    """Raise `RuleFailure` (``on_error: raise``) or log a warning for a rule that failed to evaluate."""
    if error == ELSEWHERE:
        where = f"at step {firing.trainer.global_step} on {firing.event}"
        error = f"controller {controller.name!r}: rule {controller.rule!r} {error} {where}"
    if controller.on_error == "raise":
        raise RuleFailure(error)
    log.warning(error)


def perform(firing: Firing, controller: Controller) -> None:
    """Run ``controller``'s operations, each action with the arguments it expects; record the firing."""
    callback, trainer = firing.callback, firing.trainer
    event_name = controller.trigger_names.get(firing.event, firing.event)
    context = {
        "controller": controller.name,
        "event": firing.event,
        "event_name": event_name,
        "metrics": callback.values,
        "callback": callback,
        "control": firing.control,
        "trainer": trainer,
        "state": firing.state(),
        "event_kwargs": firing.extras,
    }
    if trainer.is_global_zero:
        log.log(
            controller.log_level,
            "controller %r fired at step %d on %s",
            controller.name,
            trainer.global_step,
            event_name,
        )
    for target, action in controller.operations:
        handler = callback.config.operations[target]
        if not (action in handler.every_rank or trainer.is_global_zero):
            continue
        method = getattr(handler, action)
        if takes_lightning_arguments(method):
            method(trainer, firing.pl_module, context)
        else:
            method(**{**firing.fms_arguments(event_name), "control_name": controller.name})
    firing.requested_by.append(controller.name)
    callback.fired.append(
        {
            "controller": controller.name,
            "step": trainer.global_step,
            "event": firing.event,
            "operations": [f"{t}.{a}" for t, a in controller.operations],
        }
    )


def obey(firing: Firing) -> None:
    """Do what the event's operations asked of the trainer, on every rank: the `TrainerControl` flags and
    ``trainer.should_stop``, set on any rank (rank-0-only actions included), are combined in one
    reduction first."""
    trainer, control = firing.trainer, firing.control
    names = [f.name for f in fields(control)]
    flags = any_rank(trainer, firing.pl_module, [*(getattr(control, n) for n in names), trainer.should_stop])
    asked = dict(zip(names, flags, strict=False))
    who = firing.requested_by[0]
    if asked["should_training_stop"] or flags[-1]:
        trainer.should_stop = True
    if asked["should_epoch_stop"]:
        firing.callback._end_epoch = True
    if asked["should_save"] and firing.event != "on_save_checkpoint":
        save_now(trainer, None, who)
    if asked["should_evaluate"]:
        validate_inside_fit(trainer, who)
    if asked["should_log"]:
        log_now(trainer)
