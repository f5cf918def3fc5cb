"""Hyper-parameters as plain data, so that checkpoints load with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


def plain_data(value: Any) -> Any:
    """``value`` with dataclasses as dicts and callables as import paths (``module.qualname``).

    Example:
        >>> from lit_losses.optim import OptimizerConfig
        >>> plain_data({"optimizer": OptimizerConfig(lr=0.1), "fn": len})["fn"]
        'builtins.len'
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: plain_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(plain_data(v) for v in value)
    if callable(value) and not isinstance(value, type):
        module, name = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
        if module and name and "<" not in name:
            return f"{module}.{name}"
        return repr(value)
    return value
