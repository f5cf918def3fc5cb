"""`check_args`: a regularizer's ``args`` checked against its signature when the model is built.

A name the term does not take, a required argument left out and a value outside an annotated type
(``Literal`` choices, ``int``, ``float``, ``bool``, ``str``, ``None`` and unions of them) are one
`ConfigError` naming the argument's config path, the regularizer and what it accepts, instead of a
``TypeError`` or a silently wrong branch at the first training step. Other annotations are not checked.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

from lit_losses.errors import ConfigError
from lit_losses.registry import closest
from lit_losses.regularizers.sequences import takes_sequences

_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_SCALARS = (bool, int, float, str, type(None))


def check_args(
    target: Callable[..., Any], args: Mapping[str, Any], where: str, name: str, legacy: bool | None = None
) -> None:
    """Refuse ``args`` that ``target`` (a registered function or class) would not accept.

    A function is called as ``fn(ctx, **args)`` or, in the sequence form, ``fn(data, logprobs_list,
    **args)`` (``legacy``, or told from the signature with ``args`` bound); a class is built with
    ``cls(**args)``. The leading parameters the call supplies are not arguments.

    Args:
        target: the registered function or class.
        args: the spec's ``args``.
        where: the spec's config path (``model.regularizers[0]``); messages say ``<where>.args.<key>``.
        name: the regularizer's name.
        legacy: the spec's ``legacy`` (``None``: from the signature).

    Raises:
        ConfigError: one line naming ``<where>.args.<key>``, the regularizer and what it accepts.

    Example:
        >>> from typing import Literal
        >>> def entropy(ctx, mode: Literal["penalty", "bonus"] = "penalty"): ...
        >>> check_args(entropy, {"mode": "bonus"}, "model.regularizers[0]", "entropy")
        >>> check_args(entropy, {"mod": "bonus"}, "model.regularizers[0]", "entropy")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.regularizers[0].args.mod: regularizer 'entropy' takes no argument 'mod'; did you mean 'mode'? (its arguments: ['mode'])
        >>> check_args(entropy, {"mode": "bonuss"}, "model.regularizers[0]", "entropy")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.regularizers[0].args.mode='bonuss': regularizer 'entropy' takes one of ('penalty', 'bonus'); did you mean 'bonus'?
    """  # noqa: E501
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin or C callable without a readable signature: its call tells
        return
    parameters = list(signature.parameters.values())
    if not isinstance(target, type):
        parameters = parameters[_supplied(target, parameters, args, legacy=legacy) :]
    accepted = [p.name for p in parameters if p.kind in _KEYWORD]
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        for key in args:
            if key not in accepted:
                raise ConfigError(
                    f"{where}.args.{key}: regularizer {name!r} takes no argument {key!r}"
                    f"{closest(key, accepted)} (its arguments: {accepted})"
                )
    required = [p.name for p in parameters if p.kind in _KEYWORD and p.default is p.empty]
    missing = [key for key in required if key not in args]
    if missing:
        raise ConfigError(
            f"{where}.args: regularizer {name!r} needs the argument(s) {missing}, got {sorted(args)}"
        )
    function = target.__init__ if isinstance(target, type) else target
    for key, hint in _hints(function, [k for k in args if k in accepted]).items():
        if not _matches(args[key], hint):
            expected = _expected(args[key], hint)
            raise ConfigError(f"{where}.args.{key}={args[key]!r}: regularizer {name!r} {expected}")


def _supplied(
    target: Callable[..., Any],
    parameters: list[inspect.Parameter],
    args: Mapping[str, Any],
    legacy: bool | None,
) -> int:
    """How many leading positional parameters the call fills (``ctx``, or ``data, logprobs_list``): the
    form `build_term` will tell, from the signature with the arguments it takes bound."""
    if legacy is None:
        known = {k: v for k, v in args.items() if any(p.name == k for p in parameters)}
        legacy = takes_sequences(functools.partial(target, **known) if known else target)
    count = 0
    for p in parameters[: 2 if legacy else 1]:
        if p.kind not in _POSITIONAL:
            break
        count += 1
    return count


def _hints(fn: Callable[..., Any], names: list[str]) -> dict[str, Any]:
    """The resolved annotations of ``fn``'s parameters ``names`` (each on its own: one annotation that
    cannot be resolved, e.g. a name imported under ``TYPE_CHECKING``, leaves the others checked)."""
    annotations = getattr(fn, "__annotations__", None) or {}
    globalns = getattr(inspect.unwrap(fn), "__globals__", {})
    hints = {}
    for name in names:
        if name not in annotations:
            continue
        holder = types.SimpleNamespace(__annotations__={name: annotations[name]})
        try:
            hints[name] = typing.get_type_hints(holder, globalns=globalns)[name]
        except Exception:  # an unresolvable annotation is not checked
            continue
    return hints


def _members(hint: Any) -> tuple[Any, ...] | None:
    """The members of a union (``X | Y``, ``Optional[X]``), else ``None``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return None


def _matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` fits ``hint``; annotations other than scalars, ``Literal`` and their unions pass."""
    members = _members(hint)
    if members is not None:
        return any(_matches(value, m) for m in members)
    if typing.get_origin(hint) is Literal:
        return any(value == c and type(value) is type(c) for c in typing.get_args(hint))
    if hint is Any or hint not in _SCALARS:
        return True
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _expected(value: Any, hint: Any) -> str:
    """``takes one of (...)`` or ``takes <type>, got <type>``, with a suggestion for a near-miss choice."""
    members = _members(hint) or (hint,)
    choices = tuple(c for m in members if typing.get_origin(m) is Literal for c in typing.get_args(m))
    others = [_type_name(m) for m in members if typing.get_origin(m) is not Literal]
    if choices and not others:
        return f"takes one of {choices}{closest(value, choices)}"
    allowed = ([f"one of {choices}"] if choices else []) + others
    return f"takes {' or '.join(allowed)}, got {type(value).__name__}{closest(value, choices)}"


def _type_name(hint: Any) -> str:
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))
