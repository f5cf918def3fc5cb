"""The checks that the option dataclasses of the base losses share (``model.grpo``, ``model.dpo``,
``model.kto``, ``model.cpo``, ``model.orpo``, ``model.distillation``): a number within its bound
(`check_number`), a true-or-false field (`check_flag`), a preset from a mapping of its fields
(`coerce_fields`), and the options of `lit_losses.loss.objective.Objective` that a preset replaces
(`first_set_option`). Each failure is one `ConfigError` naming the option's path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any, Literal, TypeVar

from lit_losses.errors import ConfigError
from lit_losses.registry import closest
from lit_losses.trl_fields import trl_hint

Preset = TypeVar("Preset")

NumberBound = Literal["> 0", ">= 0", "in [0, 1]"]
"""The bounds a numeric option is checked against (`check_number`)."""

WITHIN: dict[str, Callable[[float], bool]] = {
    "> 0": lambda value: value > 0,
    ">= 0": lambda value: value >= 0,
    "in [0, 1]": lambda value: 0 <= value <= 1,
}
"""Whether a finite number lies within each `NumberBound`."""

OPTION_IS_SET: dict[str, Callable[[Any], bool]] = {
    "base_loss": lambda value: value != "cross_entropy",
    "base_loss_args": bool,
    "loss_agg": lambda value: value != "token-mean",
    "loss_agg_norm": lambda value: value is not None,
    "grpo": lambda value: value is not None,
}
"""The options ``model.<name>`` that a preset replaces, each with whether a value differs from its
default (``base_loss_args``: a non-empty mapping)."""


def is_number(value: object) -> bool:
    """A finite int or float, not a bool.

    Example:
        >>> is_number(0.5), is_number(True), is_number(float("nan"))
        (True, False, False)
    """
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_number(value: Any, where: str, bound: NumberBound | None = None) -> float:
    """``value`` as a float if it is a finite number (`is_number`) within ``bound`` (any, without one).

    Raises:
        ConfigError: ``<where> must be a finite number <bound>, got <value>``.

    Example:
        >>> check_number(2, "model.distillation.temperature", "> 0")
        2.0
        >>> check_number(0.0, "model.kto.beta", "> 0")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.kto.beta must be a finite number > 0, got 0.0
    """
    if not (is_number(value) and (bound is None or WITHIN[bound](value))):
        rule = "" if bound is None else f" {bound}"
        raise ConfigError(f"{where} must be a finite number{rule}, got {value!r}")
    return float(value)


def check_flag(value: Any, where: str) -> bool:
    """``value`` if it is a bool.

    Raises:
        ConfigError: ``<where> must be true or false, got <value>``.

    Example:
        >>> check_flag("yes", "model.distillation.tail")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.distillation.tail must be true or false, got 'yes'
    """
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    return value


def coerce_fields(
    cls: type[Preset], value: Preset | Mapping[str, Any] | None, where: str, expected: str = "its fields"
) -> Preset | None:
    """``value`` as a ``cls`` dataclass: ``None`` and a ``cls`` as they are, a mapping of its fields (from
    YAML, or a checkpoint's hyper-parameters) as ``cls(**value)``, which checks them.

    Args:
        cls: the option's dataclass.
        value: what the option was given.
        where: the option's path (``model.grpo``).
        expected: what a mapping must hold, for the message (``GRPOConfig fields``).

    Raises:
        ConfigError: ``value`` is no mapping, or has a key that is not a field (the option a TRL field name
            is here, else the closest field named).

    Example:
        >>> from lit_losses.objectives.distillation import DistillationConfig
        >>> coerce_fields(DistillationConfig, {"loss": "jsd"}, "model.distillation").loss
        'jsd'
        >>> coerce_fields(DistillationConfig, {"temprature": 2.0}, "model.distillation")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.distillation.temprature: not a field of model.distillation; ...
    """
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a mapping of {expected}, got {value!r}")
    names = [field.name for field in fields(cls)]
    unknown = sorted(set(value) - set(names))
    if unknown:
        hint = trl_hint(unknown[0]) or f"{closest(unknown[0], names)}; its fields are {names}"
        raise ConfigError(f"{where}.{unknown[0]}: not a field of {where}{hint}")
    return cls(**value)


def first_set_option(**given: Any) -> str | None:
    """The first of the options ``given`` (by their names in `OPTION_IS_SET`, in the order given) whose
    value differs from its default, or ``None``: what a preset that replaces them refuses.

    Example:
        >>> first_set_option(base_loss="cross_entropy", base_loss_args={}, loss_agg="seq-mean-token-mean")
        'loss_agg'
        >>> first_set_option(base_loss="cross_entropy", grpo=None) is None
        True
    """
    return next((name for name, value in given.items() if OPTION_IS_SET[name](value)), None)


__all__ = ["NumberBound", "check_flag", "check_number", "coerce_fields", "first_set_option", "is_number"]
