"""Models: a small built-in causal transformer, and any Hugging Face causal LM (the ``[hf]`` extra)."""

from lit_losses.models.hf import HFCausalLM
from lit_losses.models.tiny_lm import TinyLM, TinyTransformer

__all__ = ["HFCausalLM", "TinyLM", "TinyTransformer"]
