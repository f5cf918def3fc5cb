"""Models: a small built-in causal transformer, any Hugging Face causal LM (the ``[hf]`` extra), and the
frozen auxiliary models of a `RegularizedLM` (a preference reference, a distillation teacher: `frozen`).

Names are imported on first use (PEP 562 ``__getattr__``, as the root package): `lit_losses.module` uses
`lit_losses.models.frozen`, whose package must not import the models built on `RegularizedLM` first (not
even for type checkers: the import graph counts those imports; the API pages document the models by their
top-level names).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["FrozenModel", "HFCausalLM", "TinyLM", "TinyTransformer"]

_EXPORTS = {
    "FrozenModel": "lit_losses.models.frozen",
    "HFCausalLM": "lit_losses.models.hf",
    "TinyLM": "lit_losses.models.tiny_lm",
    "TinyTransformer": "lit_losses.models.tiny_lm",
}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module now."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
