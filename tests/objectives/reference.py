"""Float64 references for the base losses, written independently of `lit_losses.objectives`.

Each formula is the documented per-token loss in another form than the package's code (PPO through the
sign of the advantage, CISPO's clip through ``where``), and the aggregation is done sequence by sequence
in Python loops, so that a shared mistake cannot hide.
"""

from __future__ import annotations

import torch

ARGS = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.25},
    "cispo": {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3},
    "dro": {"beta": 0.4},
}


def per_token(name: str, lp: torch.Tensor, q: torch.Tensor, adv: torch.Tensor, args: dict) -> torch.Tensor:
    """``L_t`` of base loss ``name`` from the learner's ``lp``, the sampler's ``q`` and advantages."""
    if name == "cross_entropy":
        return -lp
    ratio = torch.exp(lp - q)
    if name == "importance_sampling":
        return -ratio * adv
    if name == "ppo":  # −min(rA, clip(r)A) = −A·min(r, hi) for A ≥ 0, −A·max(r, lo) for A < 0
        lo, hi = args["clip_low_threshold"], args["clip_high_threshold"]
        bounded = torch.where(adv >= 0, torch.clamp(ratio, max=hi), torch.clamp(ratio, min=lo))
        return -adv * bounded
    if name == "cispo":
        lo, hi = args["clip_low_threshold"], args["clip_high_threshold"]
        r = ratio.detach()
        coefficient = torch.where(
            r < lo, torch.full_like(r, lo), torch.where(r > hi, torch.full_like(r, hi), r)
        )
        return -coefficient * lp * adv
    if name == "dro":
        return -lp * adv + args["beta"] / 2 * (lp - q) ** 2
    raise KeyError(name)


def sequences(labels: torch.Tensor, segment_ids: torch.Tensor | None) -> list[list[tuple[int, int]]]:
    """The valid positions of each sequence (a row, or a (row, segment) pair), sequences without a valid
    position left out."""
    out = []
    for b in range(labels.shape[0]):
        segs = [0] * labels.shape[1] if segment_ids is None else segment_ids[b].tolist()
        for seg in dict.fromkeys(segs):
            positions = [(b, t) for t in range(labels.shape[1]) if segs[t] == seg and labels[b, t] != -100]
            if positions:
                out.append(positions)
    return out


def aggregate(
    loss: torch.Tensor,
    labels: torch.Tensor,
    mode: str,
    segment_ids: torch.Tensor | None = None,
    norm: float | None = None,
    sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The global value of ``mode`` over ``loss [B, T]`` by loops over sequences (ROLL's/verl's formulas,
    each sequence's contribution times its sample weight)."""
    seqs = sequences(labels, segment_ids)
    S, N = len(seqs), sum(len(s) for s in seqs)
    total = loss.new_zeros(())
    for positions in seqs:
        u = 1.0 if sample_weights is None else sample_weights[positions[0]]
        seq_sum = sum(loss[p] for p in positions)
        if mode == "token-mean":
            total = total + u * seq_sum / N
        elif mode == "token-sum":
            total = total + u * seq_sum
        elif mode == "seq-mean-token-sum":
            total = total + u * seq_sum / S
        elif mode == "seq-mean-token-mean":
            total = total + u * seq_sum / len(positions) / S
        elif mode == "seq-mean-token-sum-norm":
            total = total + u * seq_sum / norm / S
        else:
            raise KeyError(mode)
    return total


def head_logprobs(hidden, weight, bias, labels) -> torch.Tensor:
    """``log p(label)`` ``[B, T]`` from materialized float64 logits (0 where there is no label)."""
    logits = hidden @ weight.T + (0 if bias is None else bias)
    logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    return torch.where(labels != -100, logp, torch.zeros_like(logp))


def head_entropy(hidden, weight, bias, labels) -> torch.Tensor:
    logits = hidden @ weight.T + (0 if bias is None else bias)
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.where(labels != -100, entropy, torch.zeros_like(entropy))
