"""The options a class given by ``class_path`` takes (``model``, ``data``, and the dataclasses among their
options: ``model.init_args.dpo``, ``model.init_args.optimizer``), read from its signature as jsonargparse
reads it: a dataclass's fields, else the keyword parameters of its ``__init__`` and of its bases' while
each passes ``**kwargs`` on."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import typing
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Option:
    """One option of a class: its type (its text when the names of its module do not resolve it) and its
    default (`inspect.Parameter.empty` when it has none)."""

    type: Any
    default: Any


def class_options(cls: type) -> dict[str, Option]:
    """``{name: Option}`` of the options ``cls`` takes (the module docstring).

    Example:
        >>> from lit_losses import TinyLM
        >>> options = class_options(TinyLM)
        >>> options["d_model"], options["dpo"].default
        (Option(type=<class 'int'>, default=256), None)
    """
    if dataclasses.is_dataclass(cls):
        hints = _type_hints(cls)
        return {
            f.name: Option(hints.get(f.name, f.type), _field_default(f))
            for f in dataclasses.fields(cls)
            if f.init
        }
    found: dict[str, Option] = {}
    for base in cls.__mro__:
        init = base.__dict__.get("__init__")
        if init is None:
            continue
        try:
            parameters = list(inspect.signature(init).parameters.values())[1:]
        except (TypeError, ValueError):
            break
        hints = _type_hints(init)
        for p in parameters:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                found.setdefault(p.name, Option(hints.get(p.name, p.annotation), p.default))
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return found


def accepted_options(cls: type) -> list[str]:
    """The options ``cls`` takes: a dataclass's fields, else the keyword parameters of its ``__init__`` and
    of its bases' while each passes ``**kwargs`` on.

    Example:
        >>> from lit_losses import TinyLM
        >>> {"d_model", "loss_agg", "dpo"} <= set(accepted_options(TinyLM))
        True
    """
    return list(class_options(cls))


def option_class(cls: type, name: str) -> type | None:
    """The class of option ``name`` of ``cls`` (``X | None`` read as ``X``), or ``None``.

    Example:
        >>> from lit_losses import TinyLM
        >>> option_class(TinyLM, "optimizer").__name__, option_class(TinyLM, "loss_agg")
        ('OptimizerConfig', None)
    """
    option = class_options(cls).get(name)
    hint = option.type if option is not None else None
    if hint is None or isinstance(hint, str):  # an annotation that the module's names do not resolve
        return None
    options = [t for t in typing.get_args(hint) if t is not type(None)] if typing.get_args(hint) else [hint]
    classes = [t for t in options if inspect.isclass(t)]
    return classes[0] if len(classes) == 1 and len(options) == 1 else None


def _field_default(field: dataclasses.Field) -> Any:
    """A dataclass field's default (built by its factory), or `inspect.Parameter.empty`."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return inspect.Parameter.empty


def _type_hints(obj: Any) -> dict[str, Any]:
    """``typing.get_type_hints(obj)``, or ``{}`` when an annotation does not resolve."""
    try:
        return typing.get_type_hints(obj)
    except Exception:  # any failure to resolve an annotation leaves it as text
        return {}


def import_class(class_path: str) -> Any:
    """The class at ``class_path``, or ``None``."""
    if class_path == "NoneType":
        return type(None)
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
