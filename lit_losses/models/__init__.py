"""Models: a small built-in causal transformer."""

from lit_losses.models.tiny_lm import TinyLM, TinyTransformer

__all__ = ["TinyLM", "TinyTransformer"]
