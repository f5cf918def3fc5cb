"""`Registry`: one lookup table type for every extension point (regularizers, head backends, metric
handlers, controller operations)."""

from __future__ import annotations

import contextlib
import difflib
import importlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from lit_losses.errors import ConfigError

T = TypeVar("T")


def closest(value: str, choices: Any) -> str:
    """``"; did you mean 'x'?"`` for the choice closest to ``value`` (empty when none is close)."""
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def import_object(path: str, where: str, kind: str) -> Any:
    """The object at import path ``package.module.attribute`` (`ConfigError` naming ``where`` if absent)."""
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{where}: cannot import {kind} {path!r} ({exc})") from exc


def qualified_name(obj: Any) -> str:
    """``module.qualname`` of a function or class (its identity across re-executed definitions)."""
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', repr(obj))}"


class Registry(Generic[T]):
    """Entries of one kind, by name: register, look up by name or import path, suggest on a typo.

    ``adapt(name, obj)`` turns what is registered (or imported from a path) into the stored entry and
    raises `TypeError` for an object of the wrong kind. Registering a name twice with the same
    definition (a re-executed notebook cell) replaces the entry; with another definition it is an error.

    Args:
        kind: what the entries are, for messages (``"regularizer"``, ``"head backend"``, …).
        adapt: ``(name, obj) -> entry``; default: the object itself.
        identity: the object an entry stands for (compared on re-registration); default: the entry.

    Example:
        >>> from lit_losses.registry import Registry
        >>> colors = Registry("color")
        >>> colors.register("red", (255, 0, 0))
        (255, 0, 0)
        >>> colors.get("red", where="cfg")
        (255, 0, 0)
        >>> colors.get("rde", where="cfg")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: cfg: unknown color 'rde'; did you mean 'red'? (registered: ['red'])
    """

    def __init__(
        self,
        kind: str,
        adapt: Callable[[str, Any], T] | None = None,
        identity: Callable[[T], Any] | None = None,
    ) -> None:
        self.kind = kind
        self._adapt = adapt or (lambda name, obj: obj)
        self._identity = identity or (lambda entry: entry)
        self._entries: dict[str, T] = {}

    def register(self, name: str, obj: Any) -> T:
        """Store ``obj`` (adapted) under ``name`` and return the entry."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        entry = self._adapt(name, obj)
        previous = self._entries.get(name)
        if previous is not None and _identity_key(self._identity(previous)) != _identity_key(
            self._identity(entry)
        ):
            raise ValueError(
                f"a {self.kind} named {name!r} is already registered ({self._identity(previous)!r})"
            )
        self._entries[name] = entry
        return entry

    def get(self, key: str, where: str) -> T:
        """The entry registered as ``key``, or the object at import path ``key`` (adapted)."""
        if key in self._entries:
            return self._entries[key]
        if isinstance(key, str) and "." in key:
            obj = import_object(key, where, self.kind)
            try:
                return self._adapt(key, obj)
            except TypeError as exc:
                raise ConfigError(f"{where}: {exc}") from exc
        raise ConfigError(
            f"{where}: unknown {self.kind} {key!r}{closest(key, self._entries)} (registered: {self.names()})"
        )

    def find(self, obj: Any) -> T | None:
        """The entry that stands for ``obj`` (a registered function or class), if any."""
        for entry in self._entries.values():
            if self._identity(entry) is obj:
                return entry
        return None

    def unregister(self, name: str) -> T:
        """Remove and return the entry ``name`` (e.g. a test's temporary registration)."""
        if name not in self._entries:
            raise KeyError(f"no {self.kind} named {name!r} is registered")
        return self._entries.pop(name)

    @contextlib.contextmanager
    def scoped(self) -> Iterator[Registry[T]]:
        """Within the block, registrations are temporary: the entries are restored on exit (tests)."""
        saved = dict(self._entries)
        try:
            yield self
        finally:
            self._entries = saved

    def items(self) -> list[tuple[str, T]]:
        """``(name, entry)`` pairs, sorted by name."""
        return [(name, self._entries[name]) for name in self.names()]

    def values(self) -> list[T]:
        """The entries, sorted by name."""
        return [self._entries[name] for name in self.names()]

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> T:
        return self.get(name, where=self.kind)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


def _identity_key(obj: Any) -> Any:
    return qualified_name(obj) if callable(obj) else obj
