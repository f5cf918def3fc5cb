"""Aggregation modes: how a per-token loss matrix becomes one number, with global denominators.

With ``m`` the mask, ``N`` the global number of valid tokens, ``S`` the global number of sequences
with a valid token and ``n_s`` the number of valid tokens of sequence ``s`` (complete within a
micro-batch), the loss of a micro-batch is ``Σ_t w_t · L_t`` with

=======================  ==================  =========================================
mode                     ``w_t``             global value
=======================  ==================  =========================================
``token-mean``           ``m_t / N``         ``Σ_t L_t / N``
``token-sum``            ``m_t``             ``Σ_t L_t``
``seq-mean-token-sum``   ``m_t / S``         ``(1/S) Σ_s Σ_{t∈s} L_t``
``seq-mean-token-mean``  ``m_t / (S·n_s)``   ``(1/S) Σ_s (1/n_s) Σ_{t∈s} L_t``
=======================  ==================  =========================================

Summed over every micro-batch of every rank these give exactly the loss of the global batch.

**Contract for loss terms.** A term returns either a per-token (or per-sequence, broadcast over its
tokens) matrix and a mode, aggregated as above with the global counts; or a scalar, taken as a mean
over this micro-batch's valid units (tokens for ``token-*``, sequences for ``seq-*``) and re-weighted by
their share of the global count (`reweight_mean`), so that it too sums to a global mean.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from lit_losses.aggregation.stats import MaskStats, sequence_ids
from lit_losses.choices import check_choice

AggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean"]
AGG_MODES: tuple[str, ...] = get_args(AggMode)


def check_mode(mode: str, where: str = "agg") -> str:
    """``mode`` if it is one of `AGG_MODES`, else a `ConfigError` naming ``where`` and the closest mode."""
    return check_choice(mode, AggMode, where)


def token_weights(
    mask: Tensor, mode: AggMode, stats: MaskStats, segment_ids: Tensor | None = None, dtype=torch.float32
) -> Tensor:
    """Per-position weights ``w`` (0 where ``mask`` is False) with ``loss = Σ w · L`` (see module doc)."""
    check_mode(mode)
    mask = mask.bool()
    m = mask.to(dtype)
    if mode == "token-sum":
        return m
    if mode == "token-mean":
        return m / max(stats.num_tokens, 1)
    if mode == "seq-mean-token-sum":
        return m / max(stats.num_sequences, 1)
    ids = sequence_ids(mask, segment_ids)
    lengths = torch.bincount(ids[mask], minlength=int(ids.max()) + 1 if ids.numel() else 1).to(dtype)
    return m / (lengths[ids].clamp_min(1) * max(stats.num_sequences, 1))


def aggregate(
    loss_mat: Tensor,
    mask: Tensor,
    mode: AggMode,
    stats: MaskStats,
    segment_ids: Tensor | None = None,
    name: str = "loss",
) -> Tensor:
    """``Σ_t w_t · loss_mat_t`` with the weights of ``mode`` (masked positions never contribute).

    Args:
        loss_mat: per-token losses ``[B, T]``.
        mask: which positions count ``[B, T]``.
        mode: one of `AGG_MODES`.
        stats: global counts of the mask (`MaskStats`).
        segment_ids: packed-row segments ``[B, T]``; a sequence is a (row, segment) pair.
        name: what ``loss_mat`` is, for error messages.

    Example:
        >>> import torch
        >>> from lit_losses.aggregation import MaskStats
        >>> loss = torch.tensor([[1.0, 3.0, 9.0], [2.0, 0.0, 0.0]])
        >>> mask = torch.tensor([[True, True, False], [True, False, False]])
        >>> aggregate(loss, mask, "token-mean", MaskStats(num_tokens=3, num_sequences=2))  # (1+3+2)/3
        tensor(2.)
        >>> aggregate(loss, mask, "seq-mean-token-mean", MaskStats(num_tokens=3, num_sequences=2))  # (2+2)/2
        tensor(2.)
    """
    if loss_mat.shape != mask.shape:
        raise ValueError(
            f"{name}: loss matrix shape {tuple(loss_mat.shape)} differs from the mask shape "
            f"{tuple(mask.shape)}"
        )
    w = token_weights(mask, mode, stats, segment_ids, dtype=loss_mat.dtype)
    return (w * torch.where(mask.bool(), loss_mat, torch.zeros_like(loss_mat))).sum()


def reweight_mean(value: Tensor, mode: AggMode, local: MaskStats, stats: MaskStats) -> Tensor:
    """Share of the global value of a scalar ``value`` that is a mean over this micro-batch's valid units.

    ``token-mean``: ``value · n_local / N``; ``token-sum``: ``value · n_local``; ``seq-*``:
    ``value · s_local / S``. Summed over the micro-batches of a step this is the global mean (sum).
    """
    check_mode(mode)
    if mode == "token-sum":
        return value * local.num_tokens
    if mode == "token-mean":
        return value * (local.num_tokens / max(stats.num_tokens, 1))
    return value * (local.num_sequences / max(stats.num_sequences, 1))
