"""A value given on the command line to an option nested in a class's option (``--model.init_args.X.Y=…``)
reaches the class's parser as what it is, ``null`` included.

jsonargparse hands such an option (``--model.init_args.distillation.teacher=null``: the field ``teacher``
of the dataclass option ``distillation`` of the class ``model``) to the class's own parser as the text
``--distillation.teacher=<str(value)>`` of the value it has already read: ``null`` arrives as ``None``,
which YAML reads as the string ``'None'`` (``{"a": null}`` as ``{'a': None}``, the same). `parser_argument`
writes such a value back as JSON, so that ``null`` stays null. It applies to the single argument of such
a class parser (`lit_losses.cli.app.LitLossesParser`); every other value passes unchanged.
"""

from __future__ import annotations

import ast
import json
from typing import Any


def parser_argument(arg: str) -> str:
    """``--key=value`` with a value written as Python text that holds ``None`` rewritten as JSON.

    ``value`` is read as a Python literal (``None``, ``{'a': None}``, ``['x', None]``); when it holds a
    ``None`` it is written as JSON (``null``); any other argument is returned unchanged.

    Example:
        >>> parser_argument("--distillation.teacher=None")
        '--distillation.teacher=null'
        >>> parser_argument("--distillation.teacher={'model_type': 'llama', 'rope_scaling': None}")
        '--distillation.teacher={"model_type": "llama", "rope_scaling": null}'
        >>> parser_argument("--distillation.teacher=runs/teacher"), parser_argument("--dpo.beta=0.1")
        ('--distillation.teacher=runs/teacher', '--dpo.beta=0.1')
    """
    key, equals, value = arg.partition("=")
    if not (key.startswith("--") and equals):
        return arg
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return arg
    if not _holds_none(parsed):
        return arg
    try:
        return f"{key}={json.dumps(parsed)}"
    except (TypeError, ValueError):
        return arg


def _holds_none(value: Any) -> bool:
    """Whether ``value`` is ``None`` or a list, tuple or dict holding one (at any depth)."""
    if value is None:
        return True
    if isinstance(value, dict):
        return any(_holds_none(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_none(v) for v in value)
    return False
