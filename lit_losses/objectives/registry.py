"""The base-loss registry: ``@register_base_loss("name", reads=(...))``, and a base loss's parameters
(``model.base_loss_args``) checked against its signature when the model is built."""

from __future__ import annotations

import functools
import inspect
import math
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from torch import Tensor

from lit_losses.errors import ConfigError
from lit_losses.registry import Registry, closest
from lit_losses.validation import check_names

BaseLossFn = Callable[..., "Tensor | tuple[Tensor, Mapping[str, Tensor]]"]
"""``fn(logprobs, inputs, **params)``: per-token loss ``L_t`` (shaped like ``logprobs``), optionally with
``{metric name: per-token value}``."""


class BaseLossArgError(ValueError):
    """A base-loss parameter with a bad value (raised by a ``check``; reported as a `ConfigError`)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name
        self.message = message


@dataclass(frozen=True)
class BaseLoss:
    """A registered base loss: a per-token function of the current log-probability and batch values.

    Attributes:
        name: the name ``model.base_loss`` gives.
        fn: ``fn(logprobs, inputs, **params) -> L`` with ``inputs`` the ``reads`` batch values at the same
            positions as ``logprobs`` (both 1-D: the valid tokens of a range), ``L`` shaped like
            ``logprobs``, or ``(L, {metric: per-token values})``.
        reads: the batch keys ``fn`` reads (``[B, T]`` float tensors aligned with ``labels``).
        metrics: names of the per-token metrics ``fn`` returns (logged as token means).
        pointwise: token ``t``'s loss depends on token ``t``'s values only (elementwise code), so the
            fused head can evaluate it chunk by chunk with every gradient computed in forward; or a
            function of the bound parameters saying so (``ppo`` with sequence-level ratios is not).
            A base loss that is not pointwise is called once per micro-batch on every valid token and
            finds in ``inputs["sequence_index"]`` each token's sequence (`SEQUENCE_INDEX`).
        check: ``check(params)`` raising `BaseLossArgError` for values the types allow but the loss does
            not (a negative clip threshold).
    """

    name: str
    fn: BaseLossFn
    reads: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()
    pointwise: bool | Callable[[Mapping[str, Any]], bool] = True
    check: Callable[[Mapping[str, Any]], None] | None = None
    parameters: dict[str, inspect.Parameter] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.parameters:
            object.__setattr__(self, "parameters", _parameters(self.fn))

    def bind(self, args: Mapping[str, Any] | None, where: str = "model.base_loss_args") -> dict[str, Any]:
        """``args`` checked against ``fn``'s keyword parameters and ``check``, defaults filled in.

        Raises:
            ConfigError: naming ``<where>.<parameter>``: an unknown parameter (with the closest name), a
                value of the wrong type, a missing required one, or one ``check`` refuses.
        """
        if args is None:
            args = {}
        if not isinstance(args, Mapping) or not all(isinstance(k, str) for k in args):
            raise ConfigError(f"{where} must be a mapping of parameter names to values, got {args!r}")
        own = f"base loss {self.name!r}"
        known = list(self.parameters)
        bound: dict[str, Any] = {}
        for key, value in args.items():
            if key not in self.parameters:
                listed = f"its parameters are {known}" if known else "it takes no parameter"
                raise ConfigError(
                    f"{where}.{key}: {own} has no parameter {key!r}{closest(key, known)}; {listed}"
                )
            bound[key] = _typed(value, _hint(self.fn, key), f"{where}.{key}", own=own)
        for key, parameter in self.parameters.items():
            if key not in bound:
                if parameter.default is inspect.Parameter.empty:
                    raise ConfigError(f"{where}.{key} is required by {own} (no default value)")
                bound[key] = parameter.default
        bound = {key: bound[key] for key in self.parameters}  # in the signature's order
        if self.check is not None:
            try:
                self.check(bound)
            except BaseLossArgError as exc:
                value = bound.get(exc.name)
                raise ConfigError(f"{where}.{exc.name}={value!r} {exc.message} ({own})") from exc
        return bound

    def is_pointwise(self, params: Mapping[str, Any]) -> bool:
        """Whether the loss with ``params`` (from `bind`) is pointwise (see ``pointwise``)."""
        return self.pointwise(params) if callable(self.pointwise) else bool(self.pointwise)

    def function(self, params: Mapping[str, Any]) -> Callable[[Tensor, Mapping[str, Tensor]], Any]:
        """``fn`` with ``params`` (from `bind`) bound."""
        return functools.partial(self.fn, **params) if params else self.fn


def _parameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """``fn``'s parameters after ``(logprobs, inputs)``: the ones ``model.base_loss_args`` may set."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no readable signature
        return {}
    if len(params) < 2 or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params[2:]):
        raise TypeError(
            f"a base loss is fn(logprobs, inputs, **named parameters); {getattr(fn, '__qualname__', fn)} "
            f"has parameters {[p.name for p in params]}"
        )
    return {p.name: p for p in params[2:]}


def _hint(fn: Callable[..., Any], name: str) -> Any:
    try:
        return typing.get_type_hints(fn).get(name)
    except Exception:  # unresolvable annotations: no type check
        return None


_PLAIN_TYPES: tuple[tuple[type, Callable[[Any], bool], str], ...] = (
    (int, lambda value: isinstance(value, int) and not isinstance(value, bool), "an integer"),
    (bool, lambda value: isinstance(value, bool), "true or false"),
    (str, lambda value: isinstance(value, str), "a string"),
)
"""The plain types a parameter's value is checked against: the type, the check, what the value must be."""


def _plain_type(hint: Any) -> tuple[type, Callable[[Any], bool], str] | None:
    return next((plain for plain in _PLAIN_TYPES if plain[0] is hint), None)


def _typed(value: Any, hint: Any, where: str, own: str) -> Any:
    """``value`` if it fits ``hint`` (``float`` takes an int, as YAML writes ``2`` for ``2.0``; ``X | None``
    takes ``None`` (YAML ``null``) or what ``X`` takes)."""
    args = get_args(hint)
    if get_origin(hint) in (Union, UnionType) and len(args) == 2 and type(None) in args:
        inner = next(a for a in args if a is not type(None))
        return None if value is None else _typed_plain(value, inner, where, own=own, nullable=True)
    return _typed_plain(value, hint, where, own=own)


def _typed_plain(value: Any, hint: Any, where: str, own: str, nullable: bool = False) -> Any:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if hint is float:
        if number and math.isfinite(value):
            return float(value)
        expected = "a finite number"
    elif (plain := _plain_type(hint)) is not None:
        if plain[1](value):
            return value
        expected = plain[2]
    elif get_origin(hint) is Literal:
        if value in get_args(hint):
            return value
        expected = f"one of {get_args(hint)}{closest(value, get_args(hint))}"
    else:
        return value
    raise ConfigError(f"{where}={value!r} must be {expected}{' or null' if nullable else ''} ({own})")


def _as_base_loss(name: str, obj: Any) -> BaseLoss:
    if isinstance(obj, BaseLoss):
        return obj
    if not callable(obj):
        raise TypeError(
            f"base loss {name!r} must be a function fn(logprobs, inputs), got {type(obj).__name__}"
        )
    return BASE_LOSSES.find(obj) or BaseLoss(name, obj)


BASE_LOSSES: Registry[BaseLoss] = Registry("base loss", adapt=_as_base_loss, identity=lambda e: e.fn)
"""Every registered base loss, by name (`register_base_loss`)."""


def register_base_loss(
    name: str,
    *,
    reads: Sequence[str] = (),
    metrics: Sequence[str] = (),
    pointwise: bool | Callable[[Mapping[str, Any]], bool] = True,
    check: Callable[[Mapping[str, Any]], None] | None = None,
) -> Callable[[BaseLossFn], BaseLossFn]:
    """Register a base loss under ``name`` (from YAML: ``model.init_args.base_loss: <name>``).

    The function is ``fn(logprobs, inputs, **params)``: ``logprobs`` the current log-probabilities of the
    labels at some valid tokens (1-D, with gradient), ``inputs`` the batch values of ``reads`` at the same
    tokens, ``params`` its keyword parameters (set by ``model.init_args.base_loss_args``, checked against
    the signature's annotations and defaults when the model is built). It returns the per-token loss
    ``L_t`` (shaped like ``logprobs``), or ``(L, {name: per-token value})`` for the ``metrics`` it
    declares (logged as exact means over the step's valid tokens, ``train/base_loss/<name>``).
    ``L`` is then weighted by the batch's ``loss_weights`` and ``sample_weights`` (when present) and
    aggregated with ``model.loss_agg`` and the step's global counts, like every term.

    Args:
        name: registry name (unique).
        reads: batch keys read (``[B, T]`` float tensors aligned with ``labels``); a missing key is an
            error naming it, the base loss and the keys the batch has.
        metrics: the per-token metrics ``fn`` returns.
        pointwise: ``True`` when token ``t``'s loss depends on token ``t``'s values only: the fused head
            then evaluates it chunk by chunk, every gradient computed in forward (no logits recompute).
            ``False``: the general path (per-token head outputs, autograd), one call per micro-batch
            with ``inputs["sequence_index"]``, the sequence of each token (a (row, segment) pair in
            packed rows, numbered densely). A function of the bound parameters: either, by parameters.
        check: ``check(params)`` raising `BaseLossArgError` for values the loss refuses.

    Example:
        >>> import torch
        >>> from lit_losses import register_base_loss
        >>> @register_base_loss("doc_reinforce", reads=("advantages",))
        ... def reinforce(logprobs, inputs, scale: float = 1.0):
        ...     return -scale * inputs["advantages"] * logprobs  # REINFORCE: −A_t · log p_t
        >>> from lit_losses.objectives import BASE_LOSSES
        >>> entry = BASE_LOSSES["doc_reinforce"]
        >>> entry.reads, entry.bind({"scale": 2})
        (('advantages',), {'scale': 2.0})
    """

    def decorator(fn: BaseLossFn) -> BaseLossFn:
        where = f"register_base_loss({name!r})"
        keys = check_names(reads, f"{where}: reads", "batch keys")
        names = check_names(metrics, f"{where}: metrics", "metric names")
        entry = BaseLoss(name, fn, keys, metrics=names, pointwise=pointwise, check=check)
        BASE_LOSSES.register(name, entry)
        return fn

    return decorator
