"""Public names imported on first use (PEP 562): a package lists where each of its names lives, and
`lazy_exports` gives it the module ``__getattr__`` and ``__dir__`` that import a name's module when the
name is first read, so that importing the package imports none of them.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    namespace: dict[str, Any], exports: Mapping[str, str], *, subpackages: bool = False
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the package whose globals are ``namespace``: a name of
    ``exports`` (name → the module that defines it) is imported from its module when first read, then kept
    in ``namespace`` (read once); with ``subpackages``, any other public name that is a submodule of the
    package (``lit_losses.autograd``) is imported as well. ``__dir__`` lists the globals and ``__all__``.

    Args:
        namespace: the package's ``globals()`` (its ``__name__`` and ``__all__``).
        exports: each public name → the module it is imported from.
        subpackages: whether a submodule's name is an attribute too.

    Returns:
        ``(__getattr__, __dir__)``, to assign at the package's top level.

    Example:
        >>> namespace = {"__name__": "pkg", "__all__": ["sqrt"]}
        >>> getattr_, dir_ = lazy_exports(namespace, {"sqrt": "math"})
        >>> getattr_("sqrt")(4.0), "sqrt" in namespace, dir_()
        (2.0, True, ['__all__', '__name__', 'sqrt'])
        >>> getattr_("cbrt")
        Traceback (most recent call last):
        ...
        AttributeError: module 'pkg' has no attribute 'cbrt'
    """
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
        elif subpackages and not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}"):
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *namespace.get("__all__", ())})

    return __getattr__, __dir__
