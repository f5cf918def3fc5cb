"""The events a controller can fire on: Lightning hooks, one event per optimizer step, and Hugging Face's
event names (fms-hf-tuning's configs) as aliases of the Lightning hooks that mean the same thing."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, get_args

from lit_losses.errors import ConfigError
from lit_losses.registry import closest

Trigger = Literal[
    "on_fit_start",
    "on_train_start",
    "on_train_epoch_start",
    "on_optimizer_step_start",
    "on_train_batch_start",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_optimizer_step_end",
    "on_train_epoch_end",
    "on_validation_start",
    "on_validation_batch_end",
    "on_validation_epoch_end",
    "on_validation_end",
    "on_save_checkpoint",
    "on_train_end",
]
"""An event usable as a controller trigger (and as an event metric handlers compute on).

Lightning hooks keep their meaning (``on_train_batch_end``: every micro-batch), plus two events per
*optimizer step* whatever ``accumulate_grad_batches`` is: ``on_optimizer_step_start`` (before the first
micro-batch of the step's accumulation window) and ``on_optimizer_step_end`` (after its last one, once
the optimizer stepped and the step's values are logged)."""

ALL_EVENTS: tuple[Trigger, ...] = get_args(Trigger)
"""Every `Trigger`, in the order Lightning calls them."""

STEP_EVENTS: tuple[Trigger, ...] = ("on_optimizer_step_start", "on_optimizer_step_end")
"""The events that fire once per optimizer step (not Lightning hooks)."""

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

``on_log``: lit_losses logs a step's values at every optimizer step, so it is ``on_optimizer_step_end``."""

_NO_EQUIVALENT = {
    "on_substep_end": "Lightning has no hook for a micro-batch that does not end an accumulation window; "
    "use on_train_batch_end (every micro-batch) or on_optimizer_step_end",
    "on_predict": "prediction is not part of fit in Lightning",
    "on_push_begin": "Lightning does not push to a hub",
}


def resolve_event(name: object, where: str) -> Trigger:
    """The event ``name`` stands for (itself, or the Lightning event of a Hugging Face name).

    Args:
        name: a `Trigger` or a key of `HF_EVENTS`.
        where: what names it, for the message (``controllers[0] (c).triggers``).

    Raises:
        ConfigError: an unknown name, or a Hugging Face event without an equivalent.

    Example:
        >>> resolve_event("on_log", "triggers"), resolve_event("on_validation_end", "triggers")
        ('on_optimizer_step_end', 'on_validation_end')
        >>> resolve_event("on_predict", "triggers")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: triggers: Hugging Face event 'on_predict' has no Lightning equivalent \
(prediction is not part of fit in Lightning)
    """
    if isinstance(name, str) and name in ALL_EVENTS:
        return name  # type: ignore[return-value]
    if isinstance(name, str) and name in HF_EVENTS:
        event = HF_EVENTS[name]
        if event is None:
            raise ConfigError(
                f"{where}: Hugging Face event {name!r} has no Lightning equivalent ({_NO_EQUIVALENT[name]})"
            )
        return event
    known = (*ALL_EVENTS, *(k for k, v in HF_EVENTS.items() if v))
    raise ConfigError(
        f"{where}: unknown trigger {name!r}{closest(str(name), known)}; choose among {list(known)}"
    )


def resolve_handler_events(names: Iterable[str], where: str) -> dict[Trigger, str]:
    """The events a metric handler computes on, each with the name it was declared with.

    Hugging Face names without a Lightning equivalent are left out (a handler written for fms-hf-tuning
    lists every event it supports); unknown names are an error.

    Example:
        >>> resolve_handler_events(["on_log", "on_evaluate", "on_predict"], "m")
        {'on_optimizer_step_end': 'on_log', 'on_validation_end': 'on_evaluate'}
    """
    events: dict[Trigger, str] = {}
    for name in names:
        if name in HF_EVENTS and HF_EVENTS[name] is None:
            continue
        events.setdefault(resolve_event(name, where), name)
    return events
