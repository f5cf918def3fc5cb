"""Controllers that can never act in this run, found before training: their events never fire, the
metrics their rules read are computed only on such events, or their operation validates in a run without
validation.

The user need: a rule on ``on_validation_end`` (or on a metric computed there, such as `EvalMetrics`) in
a run without validation (``trainer.limit_val_batches=0``, or data without a validation split) is skipped
silently at every step: the run goes on as if the rule were not there. `check_reachable` tells it before
the first step: an error for a controller with ``on_error: raise`` (the default), else a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import lightning as L

from lit_losses.controller.config import ControllerConfig
from lit_losses.errors import ConfigError

VALIDATION_EVENTS = (
    "on_validation_start",
    "on_validation_batch_end",
    "on_validation_epoch_end",
    "on_validation_end",
)
"""The events of the validation loop: they never fire in a fit without validation batches."""

VALIDATING_ACTIONS = ("should_validate", "should_evaluate")
"""Actions that run the validation loop (``lightning.should_validate``, ``hfcontrols.should_evaluate``)."""

NO_VALIDATION = (
    "this run has no validation batches (trainer.limit_val_batches=0, or data without a validation split)"
)


def silent_events(trainer: L.Trainer) -> tuple[str, ...]:
    """The events that will not fire in this fit (call it when training starts, once Lightning has counted
    the validation batches)."""
    return () if sum(trainer.num_val_batches or [0]) else VALIDATION_EVENTS


def unreachable(config: ControllerConfig, silent: Sequence[str]) -> list[tuple[str, str]]:
    """``(controller name, why)`` for each controller that can never act when the events ``silent``
    never fire.

    Example:
        >>> from lit_losses.controller import parse_config
        >>> config = parse_config({
        ...     "controller-metrics": [{"name": "ev", "class": "EvalMetrics"}],
        ...     "controllers": [{"name": "val-rise", "triggers": ["on_optimizer_step_end"],
        ...                      "rule": 'ev["val/loss_total"] > 5',
        ...                      "operations": ["lightning.should_training_stop"]}]})
        >>> unreachable(config, VALIDATION_EVENTS)
        [('val-rise', "its rule reads metric(s) ['ev'], computed only on ['on_validation_end']")]
    """
    silent = set(silent)
    dead = {
        name: sorted(h.events) for name, h in config.metrics.items() if h.events and set(h.events) <= silent
    }
    found = []
    for controller in config.controllers:
        if set(controller.triggers) <= silent:
            found.append((controller.name, f"its triggers {sorted(controller.triggers)} never fire"))
            continue
        reads = sorted(controller.names & dead.keys())
        validates = [f"{t}.{a}" for t, a in controller.operations if a in VALIDATING_ACTIONS]
        if reads:
            events = sorted({e for name in reads for e in dead[name]})
            found.append((controller.name, f"its rule reads metric(s) {reads}, computed only on {events}"))
        elif validates and silent >= set(VALIDATION_EVENTS):
            found.append((controller.name, f"its operation {validates[0]} would validate"))
    return found


def check_reachable(config: ControllerConfig, trainer: L.Trainer) -> None:
    """Refuse (``on_error: raise``) or warn about (``on_error: warn``) controllers that can never act.

    Raises:
        ConfigError: one line naming the controller, why and the run's setting.
    """
    on_error = {c.name: c.on_error for c in config.controllers}
    for name, why in unreachable(config, silent_events(trainer)):
        message = f"controller {name!r} can never act: {why}; {NO_VALIDATION}"
        if on_error[name] == "raise":
            raise ConfigError(f"{message} (on_error: warn makes this a warning)")
        warnings.warn(message, UserWarning, stacklevel=2)
