"""The regularizer registry: ``@register_regularizer("name")`` for functions and classes."""

from __future__ import annotations

import difflib
import functools
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lit_losses.errors import ConfigError

NEEDS = ("logprobs", "lse", "entropy", "hidden")
"""What a term may consume: head outputs (``logprobs``, ``lse``, ``entropy``) and ``hidden`` states."""


@dataclass(frozen=True)
class RegistryEntry:
    """A registered term: a function ``fn(ctx, **args)`` or a class ``cls(**args)(ctx)``."""

    name: str
    target: Callable[..., Any]
    needs: tuple[str, ...] = ("logprobs",)
    differentiable: bool = True
    pointwise: bool = False

    def build(self, args: dict[str, Any]) -> Callable[..., Any]:
        """The callable ``term(ctx)`` with ``args`` bound."""
        if isinstance(self.target, type):
            return self.target(**args)
        if not args:
            return self.target
        return functools.partial(self.target, **args)


REGISTRY: dict[str, RegistryEntry] = {}


def check_needs(needs: Sequence[str], where: str) -> tuple[str, ...]:
    unknown = [n for n in needs if n not in NEEDS]
    if unknown:
        raise ConfigError(f"{where}: unknown needs {unknown}; choose among {NEEDS}")
    return tuple(needs)


def register_regularizer(
    name: str, *, needs: Sequence[str] = ("logprobs",), differentiable: bool = True, pointwise: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a loss term under ``name`` (usable from YAML as ``{name: <name>, weight: ...}``).

    A function is called as ``fn(ctx, **args)``; a class is instantiated with ``cls(**args)`` once
    and called as ``instance(ctx)``. Either may be ``async``. It returns a per-token tensor ``[B, T]``
    (aggregated with the term's mode and the global counts), or a scalar taken as a mean over this
    micro-batch's valid units, optionally as ``(value, {"custom_key": number, ...})``.

    Args:
        name: registry name (unique).
        needs: head outputs consumed (``logprobs``, ``lse``, ``entropy``, ``hidden``).
        differentiable: ``False`` for a term that has no gradient on purpose (it warns once instead of
            raising when its value has no gradient path).
        pointwise: the output at each token depends only on that token's head outputs and batch
            values (elementwise code). Such terms can be evaluated chunk by chunk inside the fused head,
            with every gradient computed in forward (no logits recompute).
    """
    check_needs(needs, f"register_regularizer({name!r})")

    def decorator(target: Callable[..., Any]) -> Callable[..., Any]:
        previous = REGISTRY.get(name)
        if previous is not None and _qualified(previous.target) != _qualified(target):
            raise ValueError(f"a regularizer named {name!r} is already registered ({previous.target!r})")
        # the same definition run again (a re-executed notebook cell or script) replaces the entry
        REGISTRY[name] = RegistryEntry(name, target, tuple(needs), differentiable, pointwise)
        return target

    return decorator


def _qualified(target: Any) -> str:
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"


def resolve(fn: str | Callable[..., Any], where: str) -> RegistryEntry:
    """A registry entry from a registry name, an import path ``pkg.module.function``, or a callable."""
    if callable(fn):
        for entry in REGISTRY.values():
            if entry.target is fn:
                return entry
        return RegistryEntry(getattr(fn, "__name__", repr(fn)), fn)
    if fn in REGISTRY:
        return REGISTRY[fn]
    if "." in fn:
        module_name, _, attr = fn.rpartition(".")
        try:
            target = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"{where}: cannot import regularizer {fn!r} ({exc})") from exc
        return resolve(target, where)
    close = difflib.get_close_matches(fn, list(REGISTRY), n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ConfigError(f"{where}: unknown regularizer {fn!r}{hint} (registered: {sorted(REGISTRY)})")
