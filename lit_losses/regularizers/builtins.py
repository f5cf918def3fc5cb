"""Built-in regularizers. Each returns a per-token matrix ``[B, T]`` (aggregated with the term's mode).

Notation: ``z`` logits, ``p = softmax(z)``, ``lse = log Σ_v exp z_v``, ``H = −Σ_v p_v log p_v``,
``log p_t`` the log-probability of the label at position ``t``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from lit_losses.aggregation.stats import batch_segment_ids, sequence_ids
from lit_losses.errors import BatchKeyError
from lit_losses.objectives.ratios import sequence_mean
from lit_losses.regularizers.registry import register_regularizer

if TYPE_CHECKING:
    from lit_losses.loss.context import LossContext


@register_regularizer("z_loss", needs=("lse",), pointwise=True)
def z_loss(ctx: LossContext) -> Tensor:
    """``r_t = lse_t²``: keeps the softmax normalizer near 1 (PaLM's z-loss, usually weight 1e-4)."""
    return ctx.head.lse.square()


@register_regularizer("entropy", needs=("entropy",), pointwise=True)
def entropy(ctx: LossContext, mode: Literal["penalty", "bonus"] = "penalty") -> Tensor:
    """``r_t = H_t`` (``penalty``: sharper predictions) or ``r_t = −H_t`` (``bonus``: more entropy)."""
    if mode not in ("penalty", "bonus"):
        raise ValueError(f"entropy: mode must be 'penalty' or 'bonus', got {mode!r}")
    return ctx.head.entropy if mode == "penalty" else -ctx.head.entropy


@register_regularizer("confidence_penalty", needs=("entropy",), pointwise=True)
def confidence_penalty(ctx: LossContext, threshold: float | None = None) -> Tensor:
    """Confidence penalty (Pereyra et al., 2017): ``r_t = −H_t``, or the hinge ``max(0, τ − H_t)``.

    With ``threshold = τ`` only predictions whose entropy falls below ``τ`` are penalized.
    """
    h = ctx.head.entropy
    return -h if threshold is None else torch.relu(threshold - h)


@register_regularizer("logprob_l1", needs=("logprobs",), pointwise=True)
def logprob_l1(ctx: LossContext, target: float = 0.0) -> Tensor:
    """``r_t = |log p_t − c|`` with ``c = target`` (0: an L1 pull of the label's log-probability to 0)."""
    return (ctx.head.logprobs - target).abs()


@register_regularizer("kl_reference", needs=("logprobs",), pointwise=True)
def kl_reference(
    ctx: LossContext,
    key: str = "ref_logprobs",
    estimator: Literal["k1", "k2", "k3"] = "k3",
    bias_correction: bool = False,
    sampling_key: str = "sampling_logprobs",
    importance_sampling_level: Literal["token", "sequence"] = "token",
    old_key: str = "old_logprobs",
    old_detached: bool = False,
) -> Tensor:
    """Per-token estimate of ``KL(π ‖ π_ref)`` from label log-probabilities, with ``d_t = log π_ref − log π``.

    ``k1``: ``−d_t``; ``k2``: ``d_t² / 2``; ``k3``: ``exp(d_t) − d_t − 1`` (unbiased, non-negative;
    Schulman's estimator). ``batch[key]`` holds the reference log-probabilities ``[B, T]``.

    ``bias_correction``: the estimate times the importance ratio ``r_t = exp(log π_t − q_t)`` (with its
    gradient), ``q`` the sampler's log-probabilities ``batch[sampling_key]``: the tokens come from the
    sampler, not from ``π`` (DeepSeek-V3.2's unbiased KL; TRL's and Liger-Kernel's
    ``use_bias_correction_kl``). ``q`` is the ratio's ``π_old`` as the base loss's is:
    ``batch[old_key]`` when the batch has it; without it, ``log π`` detached when ``old_detached`` (a
    rollout correction's π_old: the ratio is 1, its gradient ``∇ log π``).
    ``importance_sampling_level: sequence`` uses GSPO's sequence ratio ``exp(mean_{u∈s} (log π_u −
    q_u))`` instead, which needs whole sequences: the term then runs on the general path only (as it
    does beside a base loss with sequence-level ratios).
    """
    if key not in ctx.batch:
        raise BatchKeyError(
            f"kl_reference reads batch key {key!r} (its argument key), which is missing; the batch has keys "
            f"{sorted(ctx.batch)}"
        )
    logprobs = ctx.head.logprobs
    ref = ctx.batch[key].to(logprobs.dtype)
    if ref.shape != logprobs.shape:
        raise ValueError(
            f"kl_reference: batch[{key!r}] has shape {tuple(ref.shape)}, expected {tuple(logprobs.shape)}"
        )
    d = torch.where(ctx.mask, ref - logprobs, torch.zeros_like(ref))
    if estimator == "k1":
        kl = -d
    elif estimator == "k2":
        kl = 0.5 * d.square()
    elif estimator == "k3":
        kl = torch.expm1(d) - d
    else:
        raise ValueError(f"kl_reference: estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")
    if not bias_correction:
        return kl
    old = (old_key, old_detached)
    return kl * torch.exp(importance_log_ratio(ctx, sampling_key, importance_sampling_level, old=old))


def importance_log_ratio(
    ctx: LossContext, sampling_key: str, level: str, old: tuple[str, bool] = ("old_logprobs", False)
) -> Tensor:
    """``log π_t − q_t`` (0 at ignored positions), or its mean over each sequence (``level="sequence"``);
    ``q`` is ``batch[old[0]]`` when present, else ``log π`` detached if ``old[1]``, else
    ``batch[sampling_key]``."""
    logprobs = ctx.head.logprobs
    old_key, old_detached = old
    if old_key in ctx.batch:
        q = ctx.batch[old_key].to(logprobs.dtype)
    elif old_detached:
        q = logprobs.detach()
    elif sampling_key in ctx.batch:
        q = ctx.batch[sampling_key].to(logprobs.dtype)
    else:
        raise KeyError(
            f"kl_reference with bias_correction reads batch key {sampling_key!r}, which is missing; "
            f"the batch has keys {sorted(ctx.batch)}"
        )
    per_token = torch.where(ctx.mask, logprobs - q, torch.zeros_like(q))
    if level not in ("token", "sequence"):
        raise ValueError(
            f"kl_reference: importance_sampling_level must be 'token' or 'sequence', got {level!r}"
        )
    if level == "token":
        return per_token
    if logprobs.dim() != 2:
        raise ValueError(
            "kl_reference: importance_sampling_level='sequence' needs whole sequences ([B, T] "
            "log-probabilities), this call has a chunk of tokens: set the term's `pointwise: false`"
        )
    index = sequence_ids(ctx.mask, batch_segment_ids(ctx.batch))[ctx.mask]
    return torch.zeros_like(per_token).masked_scatter(ctx.mask, sequence_mean(per_token[ctx.mask], index))
