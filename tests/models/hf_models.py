"""Tiny Hugging Face models built from configs (random weights, nothing downloaded) for the HF tests."""

from __future__ import annotations

import torch

V = 97  # a vocabulary size no other dimension of these models has
COMMON = dict(vocab_size=V, bos_token_id=0, eos_token_id=1, pad_token_id=2)

#: ``model_type`` → config (tiny, no dropout); ``phi`` has an output layer with a bias, ``gpt2`` a tied one.
CONFIGS = {
    "llama": dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "qwen2": dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "gpt2": dict(
        n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    ),
    "phi": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4),
}


def hf_config(model_type: str, **overrides) -> dict:
    return {"model_type": model_type, **COMMON, **CONFIGS[model_type], **overrides}


def batch_of(rows: int = 2, length: int = 12, seed: int = 0, ignore_tail: int = 3) -> dict:
    """``input_ids`` and aligned labels (the last ``ignore_tail`` positions of row 1 unlabelled)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, V, (rows, length), generator=g)
    labels = input_ids.clone()
    labels[1, length - ignore_tail :] = -100
    return {"input_ids": input_ids, "labels": labels}


def next_token(labels: torch.Tensor) -> torch.Tensor:
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
