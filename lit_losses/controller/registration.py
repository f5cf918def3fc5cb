"""Registering handler classes: the one implementation behind `register_metric_handlers` and
`register_operation_handlers`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lit_losses.registry import Registry


def subclass_of(base: type, kind: str) -> Callable[[str, Any], type]:
    """An ``adapt`` function for a `Registry` of classes: accept subclasses of ``base`` only.

    Args:
        base: the class every entry must derive from.
        kind: what the entries are, for the message (``"metric handler"``).

    Returns:
        ``adapt(name, obj)``, which returns ``obj`` unchanged or raises `TypeError`.
    """

    article = "an" if base.__name__[:1] in "AEIOU" else "a"

    def adapt(name: str, obj: Any) -> type:
        if not (isinstance(obj, type) and issubclass(obj, base)):
            raise TypeError(f"{kind} {name!r} must be {article} {base.__name__} subclass, got {obj!r}")
        return obj

    return adapt


def register_classes(registry: Registry[type], handlers: tuple[Any, ...], named: Mapping[str, Any]) -> None:
    """Register classes in ``registry``: positional ones by class name, keyword ones under their key.

    A positional argument may also be a list or tuple of classes (fms-hf-tuning passes one list).
    Classes are registered in order: those before a wrong one stay registered.

    Args:
        registry: where the classes go.
        handlers: classes, or lists/tuples of classes, registered under ``cls.__name__``.
        named: classes registered under the given names.

    Raises:
        TypeError: a class of the wrong kind.
        ValueError: a name already registered for a different class.
    """
    flat: list[Any] = []
    for handler in handlers:
        flat.extend(handler if isinstance(handler, list | tuple) else [handler])
    entries = [(getattr(h, "__name__", repr(h)), h) for h in flat] + list(named.items())
    for name, handler in entries:
        registry.register(name, handler)
