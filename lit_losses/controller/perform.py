"""One event of a `TrainingController`: its metric handlers computed, its controllers' rules decided, their
operations performed, and the trainer doing what they ask. Handler methods written in another calling
convention than lit_losses' are called through it (`lit_losses.controller.conventions`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import lightning as L

from lit_losses.controller.control import TrainerControl
from lit_losses.controller.conventions import CALLING_CONVENTIONS, convention_for, lightning_style
from lit_losses.controller.decisions import (
    ELSEWHERE,
    any_rank,
    combine_across_ranks,
    evaluate,
    patience_reached,
)
from lit_losses.controller.entries import Controller
from lit_losses.controller.loop import log_now, save_now, validate_inside_fit
from lit_losses.controller.metrics import MetricHandler
from lit_losses.controller.rules import RuleFailure

log = logging.getLogger("lit_losses.controller")


@dataclass
class Firing:
    """What one event of a controller needs: the event, the Lightning objects, the event's keyword
    arguments (`event_arguments` of the calling conventions), the fractional epoch, and the
    `TrainerControl` that the event's operations set."""

    callback: Any
    event: str
    trainer: L.Trainer
    pl_module: L.LightningModule
    extras: dict[str, Any]
    epoch: float
    control: TrainerControl = field(default_factory=TrainerControl)
    requested_by: list[str] = field(default_factory=list)

    def compute(self, handler: MetricHandler) -> Any:
        """``handler``'s value on this event, called in its own convention."""
        if lightning_style(handler.compute):
            return handler.compute(self.event, self.trainer, self.pl_module)
        return convention_for(handler.compute).compute(handler, self)


def handle(firing: Firing) -> None:
    """One event: the metric handlers that compute on it recompute, the controllers it triggers evaluate
    their rules (outcomes combined across ranks), patience counts, the operations run, the trainer does
    what they asked; after an optimizer step, the operation handlers' `after_step`."""
    callback, event, trainer, pl_module = firing.callback, firing.event, firing.trainer, firing.pl_module
    step = trainer.global_step
    for convention in callback.conventions:
        convention.before_event(firing)
    recompute_metrics(firing)
    controllers = callback.controllers_on(event)
    outcomes = [evaluate(c, callback.evaluator, callback.values, step=step, event=event) for c in controllers]
    acted = False
    for controller, outcome in zip(
        controllers, combine_across_ranks(trainer, pl_module, outcomes), strict=True
    ):
        if outcome.error is not None:
            report_rule_error(firing, controller, outcome.error)
        elif not outcome.evaluated:
            note_skipped(firing, controller)
        elif patience_reached(callback.counters, controller, outcome.holds):
            perform(firing, controller)
            acted = True
    if acted:
        obey(firing)
    if event == "on_optimizer_step_end":
        for handler in callback.config.operations.values():
            handler.after_step(trainer, pl_module, callback)


def note_skipped(firing: Firing, controller: Controller) -> None:
    """Note, once per controller, a rule skipped because metrics it reads have no value yet: at INFO,
    or as a warning when those metrics were computed on this event after an optimizer step and still
    gave nothing (e.g. a `HistoryBasedMetric` ``key`` that is never logged: the logged keys are listed)."""
    callback = firing.callback
    missing = sorted(controller.names - callback.values.keys())
    handlers = callback.config.metrics
    computed_now = [n for n in missing if n in handlers and firing.event in handlers[n].events]
    if firing.event == "on_optimizer_step_end" and computed_now:
        logged = sorted(firing.trainer.callback_metrics)
        callback.note_once(
            controller.name,
            f"controller {controller.name!r}: metric(s) {computed_now} got no value after optimizer step "
            f"{firing.trainer.global_step} (a metric key never logged? logged keys: {logged}); rule skipped",
            warn=True,
        )
        return
    callback.note_once(
        controller.name, f"controller {controller.name!r}: metrics {missing} not available yet; rule skipped"
    )


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
        "event_kwargs": firing.extras,
    }
    for convention in CALLING_CONVENTIONS:
        context.update(convention.action_context(firing))
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
        if lightning_style(method):
            method(trainer, firing.pl_module, context)
        else:
            convention_for(method).act(method, firing, controller)
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
        firing.callback.request_epoch_end()
    if asked["should_save"] and firing.event != "on_save_checkpoint":
        save_now(trainer, None, who)
    if asked["should_evaluate"]:
        validate_inside_fit(trainer, who)
    if asked["should_log"]:
        log_now(trainer)
