"""The regularizer registry: ``@register_regularizer("name")`` for functions and classes."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from lit_losses.errors import ConfigError
from lit_losses.registry import Registry
from lit_losses.validation import check_names

Need = Literal["logprobs", "lse", "entropy", "hidden"]
"""What a term may consume (`NEEDS`)."""
NEEDS: tuple[str, ...] = get_args(Need)
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


def _as_entry(name: str, obj: Any) -> RegistryEntry:
    if isinstance(obj, RegistryEntry):
        return obj
    if not callable(obj):
        raise TypeError(f"regularizer {name!r} must be a function or a class, got {type(obj).__name__}")
    return REGISTRY.find(obj) or RegistryEntry(getattr(obj, "__name__", repr(obj)), obj)


REGISTRY: Registry[RegistryEntry] = Registry("regularizer", adapt=_as_entry, identity=lambda e: e.target)
"""Every registered loss term, by name."""


def check_needs(needs: Sequence[str], where: str) -> tuple[str, ...]:
    needs = check_names(needs, where, "needs")
    unknown = [n for n in needs if n not in NEEDS]
    if unknown:
        raise ConfigError(f"{where}: unknown needs {unknown}; choose among {NEEDS}")
    return tuple(needs)


def register_regularizer(
    name: str, *, needs: Sequence[Need] = ("logprobs",), differentiable: bool = True, pointwise: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a loss term under ``name`` (usable from YAML as ``{name: <name>, weight: ...}``).

    A function is called as ``fn(ctx, **args)``; a class is instantiated with ``cls(**args)`` once
    and called as ``instance(ctx)``. Either may be ``async``. It returns a per-token tensor ``[B, T]``
    (aggregated with the term's mode and the global counts), or a scalar taken as a mean over this
    micro-batch's valid units, optionally as ``(value, {"custom_key": number, ...})``. Registering
    the same definition again (a re-run notebook cell) replaces the entry.

    Args:
        name: registry name (unique).
        needs: head outputs consumed (``logprobs``, ``lse``, ``entropy``, ``hidden``).
        differentiable: ``False`` for a term that has no gradient on purpose (it warns once instead of
            raising when its value has no gradient path).
        pointwise: the output at each token depends only on that token's head outputs and batch
            values (elementwise code). Such terms can be evaluated chunk by chunk inside the fused head,
            with every gradient computed in forward (no logits recompute).

    Example:
        >>> from lit_losses import register_regularizer
        >>> @register_regularizer("doc_logprob_sq", pointwise=True)
        ... def logprob_sq(ctx):
        ...     return ctx.logprobs.square()
        >>> from lit_losses.regularizers import REGISTRY
        >>> "doc_logprob_sq" in REGISTRY
        True
    """
    check_needs(needs, f"register_regularizer({name!r})")

    def decorator(target: Callable[..., Any]) -> Callable[..., Any]:
        REGISTRY.register(
            name,
            RegistryEntry(name, target, tuple(needs), differentiable=differentiable, pointwise=pointwise),
        )
        return target

    return decorator


def resolve(fn: str | Callable[..., Any], where: str) -> RegistryEntry:
    """A registry entry from a registry name, an import path ``pkg.module.function``, or a callable."""
    if callable(fn):
        return _as_entry(getattr(fn, "__name__", "term"), fn)
    return REGISTRY.get(fn, where)
