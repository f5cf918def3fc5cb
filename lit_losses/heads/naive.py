"""The ``naive`` backend, the reference: materializes ``[N, V]`` logits and lets autograd differentiate."""

from __future__ import annotations

import torch
from torch import Tensor

from lit_losses.heads.backend import HeadBackend, HeadConfig, register_backend
from lit_losses.heads.output import HeadOutput
from lit_losses.heads.precision import compute_dtype


def naive_head(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    outputs: tuple[str, ...],
    ignore_index: int = -100,
    accum_dtype: torch.dtype = torch.float32,
) -> HeadOutput:
    """Per-token log-probabilities / log-sum-exp / entropy from full logits (memory ``O(N·V)``).

    With ``z = h Wᵀ + b`` computed in ``promote(hidden, weight, bias, accum_dtype)`` (`compute_dtype`):
    ``logprobs = log_softmax(z)[y]``, ``lse = logsumexp(z)``, ``entropy = −Σ_v p_v log p_v``; autograd
    differentiates them.

    Args:
        hidden: ``[..., D]`` hidden states.
        weight: ``[V, D]`` output projection.
        bias: optional ``[V]`` bias.
        targets: ``[...]`` token ids (``ignore_index`` where none).
        outputs: the fields to compute.
        ignore_index: target value of positions without a label.
        accum_dtype: the least precise dtype the logits are computed in.

    Returns:
        A `HeadOutput` whose requested fields are shaped like ``targets``, 0 (no gradient) at ignored
        positions.
    """
    valid = targets != ignore_index
    dtype = compute_dtype(hidden, weight, bias, accum_dtype=accum_dtype)
    bias = None if bias is None else bias.to(dtype)
    logits = torch.nn.functional.linear(hidden.to(dtype), weight.to(dtype), bias)
    logp = torch.log_softmax(logits, dim=-1)
    out = HeadOutput()
    zero = logits.new_zeros(())
    if "logprobs" in outputs:
        safe_targets = torch.where(valid, targets, 0).long()
        picked = logp.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1)
        out.logprobs = torch.where(valid, picked, zero)
    if "lse" in outputs:
        out.lse = torch.where(valid, torch.logsumexp(logits, dim=-1), zero)
    if "entropy" in outputs:
        entropy = -(logp.exp() * logp).sum(-1)
        out.entropy = torch.where(valid, entropy, zero)
    return out


def naive_per_token(
    head: HeadConfig, hidden: Tensor, targets: Tensor, outputs: tuple[str, ...]
) -> HeadOutput:
    """`naive_head` with the head's weight, bias, ``ignore_index`` and ``accum_dtype`` (all positions,
    ignored ones included, go through the matmul)."""
    return naive_head(
        hidden,
        head.weight,
        head.bias,
        targets=targets,
        outputs=outputs,
        ignore_index=head.ignore_index,
        accum_dtype=head.accum_dtype,
    )


#: The ``naive`` backend (no fused losses: they are computed from its per-token outputs).
NAIVE = register_backend(
    HeadBackend(
        name="naive",
        outputs=("logprobs", "lse", "entropy"),
        per_token=naive_per_token,
        description="the reference: full logits, autograd",
    )
)
