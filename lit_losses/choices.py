"""`check_choice`: one validation for every closed option typed as a ``Literal``."""

from __future__ import annotations

from typing import Any, get_args

from lit_losses.errors import ConfigError
from lit_losses.registry import closest


def check_choice(value: Any, choices: Any, where: str) -> Any:
    """``value`` if it is one of ``choices`` (a ``Literal`` type or a tuple), else a `ConfigError`.

    The message names the value, where it came from and the closest choice. LightningCLI validates
    the same ``Literal`` annotations from YAML; this covers the Python API.

    Example:
        >>> from typing import Literal
        >>> check_choice("cosine", Literal["cosine", "linear"], "optimizer.schedule")
        'cosine'
        >>> check_choice("cosin", Literal["cosine", "linear"], "kind")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: kind 'cosin' is not one of ('cosine', 'linear'); did you mean 'cosine'?
    """
    allowed = get_args(choices) or tuple(choices)
    if value not in allowed:
        raise ConfigError(f"{where} {value!r} is not one of {allowed}{closest(value, allowed)}")
    return value
