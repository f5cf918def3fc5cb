"""The reference backend: materializes ``[N, V]`` logits and lets autograd differentiate."""

from __future__ import annotations

import torch
from torch import Tensor

from lit_losses.heads.output import HeadOutput


def naive_head(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    outputs: tuple[str, ...],
    ignore_index: int = -100,
    accum_dtype: torch.dtype = torch.float32,
) -> HeadOutput:
    """Per-token log-probabilities / log-sum-exp / entropy from full logits (memory ``O(N·V)``)."""
    valid = targets != ignore_index
    dtype = torch.promote_types(hidden.dtype, accum_dtype)
    logits = torch.nn.functional.linear(hidden, weight, bias).to(dtype)
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
