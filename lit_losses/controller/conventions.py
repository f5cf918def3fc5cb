"""How handler methods are called: lit_losses' own convention (Lightning objects), and the registry of the
others that a config's handlers may follow (`lit_losses.controller.fms` registers fms-hf-tuning's).

lit_losses' convention: a metric handler's ``compute(event, trainer, pl_module)`` and an action's
``should_x(trainer, pl_module, context)``, three required positional parameters (`lightning_style`). A
method written otherwise is called through the first registered `CallingConvention` that accepts it.
"""

from __future__ import annotations

import inspect
from typing import Any

import lightning as L


def lightning_style(method: Any) -> bool:
    """Whether ``method`` (bound) is called the lit_losses way, ``method(a, b, c)``: it has at least three
    required positional parameters.

    Example:
        >>> class Ours:
        ...     def compute(self, event, trainer, pl_module): ...
        >>> class Theirs:
        ...     def compute(self, state=None, **kwargs): ...
        >>> lightning_style(Ours().compute), lightning_style(Theirs().compute)
        (True, False)
    """
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [
        p
        for p in inspect.signature(method).parameters.values()
        if p.kind in positional and p.default is inspect.Parameter.empty
    ]
    return len(required) >= 3


class CallingConvention:
    """Another way of calling handler methods, and what its handlers need besides the call.

    ``firing`` is the event being handled (`lit_losses.controller.perform.Firing`: the callback, the
    event, the trainer, the module, the event's keyword arguments ``extras``, the fractional epoch, the
    `TrainerControl`). The hooks run for every registered convention, except `before_event`, which runs
    only for the conventions of a config's metric handlers.
    """

    def accepts(self, method: Any) -> bool:
        """Whether ``method`` (a bound ``compute`` or action not in lit_losses' style) follows it."""
        return False

    def event_arguments(self, event: str, trainer: L.Trainer) -> dict[str, Any]:
        """Keyword arguments the event gives its handlers (``firing.extras``)."""
        return {}

    def before_event(self, firing: Any) -> None:
        """Runs before the metric handlers compute on an event (e.g. to keep a history)."""

    def action_context(self, firing: Any) -> dict[str, Any]:
        """Entries added to the ``context`` of lit_losses-style actions."""
        return {}

    def compute(self, handler: Any, firing: Any) -> Any:
        """Call ``handler.compute`` this convention's way; its value (``None``: not available yet)."""
        raise NotImplementedError

    def act(self, method: Any, firing: Any, controller: Any) -> None:
        """Call the action ``method`` of ``controller`` (a `Controller`) this convention's way."""
        raise NotImplementedError


CALLING_CONVENTIONS: list[CallingConvention] = []
"""The registered conventions, in registration order."""


def register_calling_convention(convention: CallingConvention) -> CallingConvention:
    """Add ``convention`` to `CALLING_CONVENTIONS` (once); returns it."""
    if convention not in CALLING_CONVENTIONS:
        CALLING_CONVENTIONS.append(convention)
    return convention


def convention_for(method: Any) -> CallingConvention:
    """The registered convention that accepts ``method``.

    Raises:
        TypeError: none does (and ``method`` is not in lit_losses' style either).
    """
    for convention in CALLING_CONVENTIONS:
        if convention.accepts(method):
            return convention
    raise TypeError(
        f"{getattr(method, '__qualname__', method)!r} takes neither lit_losses' arguments "
        "(event, trainer, pl_module) / (trainer, pl_module, context) nor those of a registered calling "
        "convention"
    )


def event_arguments(event: str, trainer: L.Trainer) -> dict[str, Any]:
    """The keyword arguments every registered convention gives the event's handlers, merged."""
    merged: dict[str, Any] = {}
    for convention in CALLING_CONVENTIONS:
        merged.update(convention.event_arguments(event, trainer))
    return merged
