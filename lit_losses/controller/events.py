"""The events a controller can fire on: Lightning hooks and one event per optimizer step, plus the aliases
other conventions give them (`register_event_aliases`; the fms-hf-tuning adapter registers Hugging Face's
event names)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
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


@dataclass(frozen=True)
class EventAlias:
    """Another convention's name of an event.

    Attributes:
        event: the event it stands for, or ``None``: it has no equivalent during ``fit`` (using it is an
            error giving ``reason``).
        source: whose name it is, for messages (``"Hugging Face"``).
        reason: why there is no equivalent (with ``event`` ``None``).
    """

    event: Trigger | None
    source: str
    reason: str = ""


EVENT_ALIASES: dict[str, EventAlias] = {}
"""Every registered alias, by name (`register_event_aliases`)."""


def register_event_aliases(
    aliases: Mapping[str, Trigger | None], source: str, reasons: Mapping[str, str] | None = None
) -> None:
    """Accept the names of ``aliases`` wherever an event is named (triggers, a handler's events).

    Args:
        aliases: name -> the event it stands for (``None``: no equivalent; an error naming ``reasons``).
        source: whose names they are, for messages.
        reasons: for the names without an equivalent, why.

    Raises:
        ValueError: a name that is another event already or an alias of another event, or a target that
            is not an event.
    """
    reasons = reasons or {}
    for name, event in aliases.items():
        if name in ALL_EVENTS:
            if event != name:
                raise ValueError(f"event alias {name!r} is an event already")
            continue  # the same name in both conventions
        if event is not None and event not in ALL_EVENTS:
            raise ValueError(f"event alias {name!r} stands for an unknown event {event!r}")
        alias = EventAlias(event, source, reasons.get(name, ""))
        if EVENT_ALIASES.setdefault(name, alias) != alias:
            raise ValueError(f"event alias {name!r} is registered for {EVENT_ALIASES[name]} already")


def aliases_of(events: Iterable[str]) -> list[str]:
    """The registered aliases of ``events``, in registration order."""
    wanted = set(events)
    return [name for name, alias in EVENT_ALIASES.items() if alias.event in wanted]


def resolve_event(name: object, where: str) -> Trigger:
    """The event ``name`` stands for (itself, or the event of a registered alias).

    Args:
        name: a `Trigger` or a key of `EVENT_ALIASES`.
        where: what names it, for the message (``controllers[0] (c).triggers``).

    Raises:
        ConfigError: an unknown name, or an alias without an equivalent.

    Example:
        >>> resolve_event("on_validation_end", "triggers")
        'on_validation_end'
        >>> resolve_event("on_validation", "triggers")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: triggers: unknown trigger 'on_validation'; did you mean ...
    """
    if isinstance(name, str) and name in ALL_EVENTS:
        return name  # type: ignore[return-value]
    if isinstance(name, str) and name in EVENT_ALIASES:
        alias = EVENT_ALIASES[name]
        if alias.event is None:
            raise ConfigError(
                f"{where}: {alias.source} event {name!r} has no Lightning equivalent ({alias.reason})"
            )
        return alias.event
    known = (*ALL_EVENTS, *(k for k, v in EVENT_ALIASES.items() if v.event))
    raise ConfigError(
        f"{where}: unknown trigger {name!r}{closest(str(name), known)}; choose among {list(known)}"
    )


def resolve_handler_events(names: Iterable[str], where: str) -> dict[Trigger, str]:
    """The events a metric handler computes on, each with the name it was declared with.

    Aliases without an equivalent are left out (a handler written for another convention lists every
    event it supports); unknown names are an error.

    Example:
        >>> resolve_handler_events(["on_validation_end", "on_train_end"], "m")
        {'on_validation_end': 'on_validation_end', 'on_train_end': 'on_train_end'}
    """
    events: dict[Trigger, str] = {}
    for name in names:
        if name in EVENT_ALIASES and EVENT_ALIASES[name].event is None:
            continue
        events.setdefault(resolve_event(name, where), name)
    return events
