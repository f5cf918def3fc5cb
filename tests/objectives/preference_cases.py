"""Random preference micro-batches in TRL's layout and in lit_losses' (next-token labels), float64.

Paired: rows ``0..P-1`` are the chosen sequences of pairs ``0..P-1``, rows ``P..2P-1`` their rejected
ones (one prompt per pair, completions of different lengths, right padding). Unpaired (KTO): ``B``
records with a desirable flag and the mismatched rows of KTO's KL estimate (each prompt with the next
record's completion). TRL sees ``input_ids``, ``completion_mask``, ``attention_mask`` ``[rows, L]`` and
full logits ``[rows, L, V]``; lit_losses sees the next-token labels ``[rows, L-1]`` (``-100`` off the
completion) and the per-token log-probabilities of positions ``0..L-2``.
"""

from __future__ import annotations

import torch

V = 11
PAD = 0


def rows_of(prompts, completions):
    """``input_ids``, ``completion_mask``, ``attention_mask`` ``[rows, L]`` of prompt + completion rows."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    L = max(lengths) + 1  # at least one padding position somewhere
    ids = torch.full((len(prompts), L), PAD, dtype=torch.long)
    completion = torch.zeros(len(prompts), L, dtype=torch.long)
    attention = torch.zeros(len(prompts), L, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        completion[i, len(p) : len(p) + len(c)] = 1
        attention[i, : len(p) + len(c)] = 1
    return ids, completion, attention


def tokens(g, n):
    return torch.randint(1, V, (n,), generator=g).tolist()


def paired_case(pairs: int = 5, seed: int = 0, scale: float = 1.5, ref_noise: float = 0.6) -> dict:
    """A paired micro-batch with policy logits (leaf, float64) and reference logits near them."""
    g = torch.Generator().manual_seed(seed)
    prompts = [tokens(g, int(torch.randint(1, 5, (1,), generator=g))) for _ in range(pairs)]
    completions = [tokens(g, int(torch.randint(1, 7, (1,), generator=g))) for _ in range(2 * pairs)]
    ids, completion, attention = rows_of(prompts + prompts, completions)
    logits = scale * torch.randn(*ids.shape, V, generator=g, dtype=torch.float64)
    ref_logits = logits + ref_noise * torch.randn(*ids.shape, V, generator=g, dtype=torch.float64)
    return {
        "input_ids": ids,
        "completion_mask": completion,
        "attention_mask": attention,
        "logits": logits.requires_grad_(),
        "ref_logits": ref_logits,
        "pairs": pairs,
    }


def unpaired_case(records: int = 6, seed: int = 0, desirable=None, negative_kl: bool = False) -> dict:
    """A KTO micro-batch: records, their desirable flags and the mismatched KL rows (record ``i``'s
    prompt with record ``i+1``'s completion); ``negative_kl``: a reference that makes the KL estimate
    negative (TRL clamps it at 0)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [tokens(g, int(torch.randint(1, 5, (1,), generator=g))) for _ in range(records)]
    completions = [tokens(g, int(torch.randint(1, 7, (1,), generator=g))) for _ in range(records)]
    ids, completion, _ = rows_of(prompts, completions)
    shifted = completions[1:] + completions[:1]
    kl_ids, kl_completion, _ = rows_of(prompts, shifted)
    if desirable is None:  # both kinds, in an order that is not sorted by kind
        desirable = [i % 3 != 1 for i in range(records)]
    label = torch.tensor(desirable)
    logits = 1.5 * torch.randn(*ids.shape, V, generator=g, dtype=torch.float64)
    ref_logits = logits + 0.6 * torch.randn(*ids.shape, V, generator=g, dtype=torch.float64)
    kl_logits = 1.5 * torch.randn(*kl_ids.shape, V, generator=g, dtype=torch.float64)
    ref_kl_logits = kl_logits + 0.6 * torch.randn(*kl_ids.shape, V, generator=g, dtype=torch.float64)
    if negative_kl:  # the reference puts more mass on the KL rows' tokens than the policy
        boost = torch.zeros_like(ref_kl_logits)
        boost[:, :-1].scatter_(-1, kl_ids[:, 1:, None], 3.0)
        ref_kl_logits = kl_logits + boost
    return {
        "batch": {
            "input_ids": ids,
            "completion_mask": completion,
            "KL_input_ids": kl_ids,
            "KL_completion_mask": kl_completion,
            "label": label,
        },
        "logits": logits.requires_grad_(),
        "ref_logits": ref_logits,
        "kl_logits": kl_logits,
        "ref_kl_logits": ref_kl_logits,
    }


def next_token_labels(input_ids, mask):
    """lit_losses' labels ``[rows, L-1]``: the token at ``t + 1`` where ``mask[t + 1]``, else ``-100``."""
    return torch.where(mask[:, 1:].bool(), input_ids[:, 1:], torch.full_like(input_ids[:, 1:], -100))


def token_logps(logits, labels):
    """``log softmax(logits[:, t])[labels[:, t]]`` at positions ``0..L-2`` (0 where ``-100``)."""
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    return torch.where(labels != -100, lp, torch.zeros_like(lp))


def log_sum_sq_probs(logits):
    """``log Σ_v p_v² = lse(2z) − 2 lse(z)`` at positions ``0..L-2``."""
    z = logits[:, :-1]
    return torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1)
