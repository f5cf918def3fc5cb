"""A ``null`` given to an option whose type has none (``--data.init_args.seq_len=null``) is refused before
anything is built.

jsonargparse hands ``null`` to a class given by ``class_path`` (``model``, ``data``) whatever the type of
the parameter, so that ``TextDataModule(seq_len=None)`` would fail inside its constructor with a
traceback, and ``TinyLM(tie_embeddings=None)`` would read as false. `check_null_options` refuses such a
value with one line naming the option, its type and its default; the same in the dataclasses among the
options (``model.init_args.dpo.loss_type``).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Mapping
from typing import Any

from jsonargparse import Namespace

from lit_losses.cli.class_options import Option, class_options, import_class, option_class
from lit_losses.errors import ConfigError


def check_null_options(section: Any, where: str, linked: Mapping[str, str] | None = None) -> None:
    """Refuse a ``null`` in the parsed ``section`` (``model`` or ``data``: ``class_path`` and
    ``init_args``) for an option whose type has no ``None``.

    Args:
        section: the parsed option.
        where: its path (``model``).
        linked: the options whose value is another's (``{"model.init_args.vocab_size":
            "data.init_args.vocab_size"}``), named in the message as where the value comes from.

    Raises:
        ConfigError: ``<where>.init_args.<option>=null: expected <type>; remove the option for its default
            (<default>)``.

    Example:
        >>> tiny = {"class_path": "lit_losses.TinyLM"}
        >>> check_null_options({**tiny, "init_args": {"d_ff": None}}, "model")  # int | None
        >>> check_null_options({**tiny, "init_args": {"tie_embeddings": None}}, "model")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.init_args.tie_embeddings=null: expected bool; remove the ...
    """
    values = section.as_dict() if isinstance(section, Namespace) else section
    if not isinstance(values, Mapping) or not isinstance(values.get("class_path"), str):
        return
    cls = import_class(values["class_path"])
    if cls is not None:
        _check(cls, values.get("init_args") or {}, where=f"{where}.init_args", linked=dict(linked or {}))


def _check(cls: type, values: Mapping[str, Any], where: str, linked: dict[str, str]) -> None:
    options = class_options(cls)
    for name, value in values.items():
        option = options.get(name)
        if option is None:
            continue
        if value is None and not admits_none(option):
            raise ConfigError(_null_line(f"{where}.{name}", option, linked))
        inner = option_class(cls, name)
        if isinstance(value, Mapping) and inner is not None and dataclasses.is_dataclass(inner):
            _check(inner, value, where=f"{where}.{name}", linked=linked)


def _null_line(path: str, option: Option, linked: dict[str, str]) -> str:
    """The error of a ``null`` for option ``path``, which takes none."""
    expected = type_text(option.type)
    if path in linked:
        return (
            f"{path}=null: {path} is set from {linked[path]} when the data module is built (it expects "
            f"{expected}); remove it, and set {linked[path]} if needed"
        )
    shown = "" if option.default is inspect.Parameter.empty else repr(option.default)
    default = f" ({shown})" if shown and len(shown) <= 60 else ""  # not a whole dataclass's fields
    return f"{path}=null: expected {expected}; remove the option for its default{default}"


def admits_none(option: Option) -> bool:
    """Whether ``None`` is a value of the option: its type is unknown, ``Any`` or holds ``None``, or its
    default is ``None``.

    Example:
        >>> admits_none(Option(int | None, 3)), admits_none(Option(int, 3)), admits_none(Option(int, None))
        (True, False, True)
    """
    hint = option.type
    if option.default is None or isinstance(hint, str) or hint in (Any, inspect.Parameter.empty, None):
        return True
    if hint is type(None):
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(admits_none(Option(arg, inspect.Parameter.empty)) for arg in typing.get_args(hint))
    if origin is typing.Literal:
        return None in typing.get_args(hint)
    return False


def type_text(hint: Any) -> str:
    """A type as it reads in a config: ``int``, ``list[str]``, ``one of ('a', 'b')``.

    Example:
        >>> from typing import Literal
        >>> type_text(int), type_text(Literal["a", "b"] | list[str])
        ('int', "one of ('a', 'b') or list[str]")
    """
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_text(arg) for arg in typing.get_args(hint))
    if origin is typing.Literal:
        return f"one of {typing.get_args(hint)}"
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__name__
    return str(hint).replace("typing.", "")
