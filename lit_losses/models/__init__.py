"""Models: a small built-in causal transformer, any Hugging Face causal LM (the ``[hf]`` extra), and the
frozen auxiliary models of a `RegularizedLM` (a preference reference, a distillation teacher: `frozen`).

Names are imported on first use (PEP 562 ``__getattr__``, as the root package): `lit_losses.module` uses
`lit_losses.models.frozen`, whose package must not import the models built on `RegularizedLM` first (not
even for type checkers: the import graph counts those imports; the API pages document the models by their
top-level names).
"""

from __future__ import annotations

from lit_losses.lazy import lazy_exports

__all__ = ["FrozenModel", "HFCausalLM", "TinyLM", "TinyTransformer"]

_EXPORTS = {
    "FrozenModel": "lit_losses.models.frozen",
    "HFCausalLM": "lit_losses.models.hf",
    "TinyLM": "lit_losses.models.tiny_lm",
    "TinyTransformer": "lit_losses.models.tiny_lm",
}


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
