"""Griffe extensions for the API reference: a Google-style ``Example:`` section (singular, as the
package's docstrings write it) is read as ``Examples:``, so that its ``>>>`` lines render as code; a
function object documented at run time gets its docstring (`RuntimeDocstrings`)."""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.M)


class SingularExamples(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)


class RuntimeDocstrings(griffe.Extension):
    """An attribute made by a factory and documented at run time (``round_ste = straight_through(…)``, then
    ``round_ste.__doc__ = …``) gets that docstring, so that its page shows what it computes."""

    def on_attribute_instance(self, *, attr: griffe.Attribute, **kwargs: Any) -> None:
        if attr.docstring is not None or not attr.path.startswith("lit_losses."):
            return
        module, _, name = attr.path.rpartition(".")
        try:
            value = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return
        doc = getattr(value, "__doc__", None)
        if isinstance(doc, str) and doc != type(value).__doc__ and callable(value):
            attr.docstring = griffe.Docstring(inspect.cleandoc(doc), parent=attr)
