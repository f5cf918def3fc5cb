"""Argument checks of the aggregation functions: types, shapes, ranges and finiteness, one line each.

`aggregate`, `token_weights`, `count_masks` and `GlobalStatsLoader` are public: a user may call them with
a list, a 1-D or empty tensor, float segment ids or a NaN weight. Each check raises a ``TypeError`` (wrong
type) or ``ValueError`` (wrong shape, range or value) naming the argument and the value, instead of a
raw error from inside torch or a silently wrong loss.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


def check_tensor(value: Any, name: str) -> Tensor:
    """``value`` if it is a ``[B, T]`` tensor with no zero-size dimension.

    Example:
        >>> check_tensor(torch.ones(0, 3), "mask")
        Traceback (most recent call last):
        ...
        ValueError: mask has shape (0, 3): an empty batch (a zero-size dimension) has nothing to count
    """
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a [B, T] tensor, got {type(value).__name__}")
    if value.dim() != 2:
        raise ValueError(f"{name} must be a [B, T] tensor (rows × positions), got shape {tuple(value.shape)}")
    if value.numel() == 0:
        raise ValueError(
            f"{name} has shape {tuple(value.shape)}: an empty batch (a zero-size dimension) has nothing "
            "to count"
        )
    return value


def check_ids(value: Tensor, name: str) -> Tensor:
    """``value`` if it holds integers (segment ids, labels): a float id would be rounded or compared
    silently.

    Example:
        >>> check_ids(torch.tensor([[0.5, 1.0]]), "segment_ids")
        Traceback (most recent call last):
        ...
        ValueError: segment_ids must hold integers, got dtype torch.float32
    """
    if value.dtype.is_floating_point or value.dtype.is_complex:
        raise ValueError(f"{name} must hold integers, got dtype {value.dtype}")
    return value


def check_weights(value: Any, name: str) -> Tensor:
    """``value`` if it is a tensor of finite weights >= 0 (a NaN or negative weight has no meaning as a
    share of the loss).

    Example:
        >>> check_weights(torch.tensor([1.0, float("nan")]), "sample_weights")
        Traceback (most recent call last):
        ...
        ValueError: sample_weights holds 1 non-finite value(s) (NaN/Inf); weights must be finite and >= 0
    """
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
    bad = int((~torch.isfinite(value)).sum()) if value.is_floating_point() else 0
    if bad:
        raise ValueError(f"{name} holds {bad} non-finite value(s) (NaN/Inf); weights must be finite and >= 0")
    if bool((value < 0).any()):
        raise ValueError(f"{name} holds a negative weight ({float(value.min())}); weights must be >= 0")
    return value


def check_count(value: Any, name: str) -> int:
    """``value`` as an ``int`` if it is an integer >= 0 (not a bool).

    Example:
        >>> check_count(2.5, "MaskStats.num_tokens")
        Traceback (most recent call last):
        ...
        TypeError: MaskStats.num_tokens must be an integer >= 0, got 2.5
    """
    try:
        count = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        count = None
    if count is None:
        raise TypeError(f"{name} must be an integer >= 0, got {value!r}")
    if count < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {count}")
    return count


def check_batch(batch: Any, where: str) -> Mapping[str, Any]:
    """``batch`` if it is a mapping of batch keys (a dict micro-batch)."""
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"{where} needs a dict micro-batch (batch keys → tensors), got {type(batch).__name__}"
        )
    return batch


def check_index(value: Any, name: str) -> int:
    """``value`` if it is an integer (a label value such as ``ignore_index``; not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer label value, got {value!r}")
    return value


def check_mask(value: Any, name: str) -> Tensor:
    """``value`` if it is a ``[B, T]`` boolean tensor, or one holding only 0 and 1 (a 0.5 would be
    taken as ``True`` silently)."""
    check_tensor(value, name)
    if value.dtype != torch.bool and not bool(((value == 0) | (value == 1)).all()):
        raise ValueError(f"{name} holds values other than 0 and 1; a mask is boolean")
    return value
