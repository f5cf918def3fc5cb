"""Aggregation modes: how a per-token loss matrix becomes one number, with global denominators.

With ``m`` the mask, ``N`` the global number of valid tokens, ``S`` the global number of sequences
with a valid token and ``n_s`` the number of valid tokens of sequence ``s`` (complete within a
micro-batch), the loss of a micro-batch is ``Σ_t w_t · L_t`` with

===========================  ==================  =========================================
mode                         ``w_t``             global value
===========================  ==================  =========================================
``token-mean``               ``m_t / N``         ``Σ_t L_t / N``
``token-sum``                ``m_t``             ``Σ_t L_t``
``seq-mean-token-sum``       ``m_t / S``         ``(1/S) Σ_s Σ_{t∈s} L_t``
``seq-mean-token-mean``      ``m_t / (S·n_s)``   ``(1/S) Σ_s (1/n_s) Σ_{t∈s} L_t``
``seq-mean-token-sum-norm``  ``m_t / (S·C)``     ``(1/S) Σ_s Σ_{t∈s} L_t / C``
===========================  ==================  =========================================

Summed over every micro-batch of every rank these give exactly the loss of the global batch.

``seq-mean-token-sum-norm`` is Dr. GRPO's aggregation ("Understanding R1-Zero-Like Training"): each
sequence's token sum divided by a constant ``C`` (``norm``; in lit_losses ``model.loss_agg_norm``, e.g.
the maximum response length), averaged over the step's sequences. verl's and ROLL's ``agg_loss`` mode of
this name sums over a micro-batch's sequences and divides by ``loss_mask.shape[-1]`` (the padded width)
unless given a constant (verl's ``loss_scale_factor``), leaving the averaging to how the backend combines
equal-size micro-batches; here ``C`` is always the configured constant and ``S`` the global count, so the
value does not depend on padding, packing or the split into micro-batches.

**Per-sequence weights** (ROLL's ``agg_loss(..., weights=)``): with ``sample_weights`` ``u`` (one value per
position, constant over a sequence's tokens so that packing keeps it), ``w_t`` becomes ``u_t · w_t`` in
every mode: each sequence's contribution is scaled, the denominators ``N``, ``S``, ``n_s`` stay the
counts (as in ROLL, the weights are not renormalized).

**Contract for loss terms.** A term returns either a per-token (or per-sequence, broadcast over its
tokens) matrix and a mode, aggregated as above with the global counts; or a scalar, taken as a mean
over this micro-batch's valid units (tokens for ``token-*``, sequences for ``seq-*``) and re-weighted by
their share of the global count (`reweight_mean`), so that it too sums to a global mean.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
from torch import Tensor

from lit_losses.aggregation.checks import check_mask, check_tensor, check_weights
from lit_losses.aggregation.stats import MaskStats, count_units, sequence_ids
from lit_losses.choices import check_choice

AggMode = Literal[
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
"""An aggregation mode by its established name (the maths of each: this module's docstring)."""
AGG_MODES: tuple[str, ...] = get_args(AggMode)
"""The names of `AggMode`, in order."""
NORM_MODE = "seq-mean-token-sum-norm"
"""The mode that divides by a configured constant (`token_weights`'s ``norm``)."""


def check_mode(mode: str, where: str = "agg") -> str:
    """``mode`` if it is one of `AGG_MODES`, else a `ConfigError` naming ``where`` and the closest mode."""
    return check_choice(mode, AggMode, where)


def token_weights(
    mask: Tensor,
    mode: AggMode,
    stats: MaskStats,
    segment_ids: Tensor | None = None,
    dtype=torch.float32,
    norm: float | None = None,
    sample_weights: Tensor | None = None,
) -> Tensor:
    """Per-position weights ``w`` (0 where ``mask`` is False) with ``loss = Σ w · L`` (see module doc).

    ``norm`` is the constant ``C`` of ``seq-mean-token-sum-norm`` (required by that mode only);
    ``sample_weights`` (shaped like ``mask``, or ``[B]`` for unpacked rows: `per_position_weights`)
    multiplies every position's weight.
    """
    check_mode(mode)
    mask = check_mask(mask, "mask").bool()
    if not isinstance(stats, MaskStats):
        raise TypeError(f"stats must be a MaskStats (the global counts), got {type(stats).__name__}")
    m = mask.to(dtype)
    if mode == "token-sum":
        w = m
    elif mode == "token-mean":
        w = m / max(stats.num_tokens, 1)
    elif mode == "seq-mean-token-sum":
        w = m / max(stats.num_sequences, 1)
    elif mode == NORM_MODE:
        w = m / (max(stats.num_sequences, 1) * check_norm(norm))
    else:
        ids = sequence_ids(mask, segment_ids)
        lengths = torch.bincount(ids[mask], minlength=int(ids.max()) + 1 if ids.numel() else 1).to(dtype)
        w = m / (lengths[ids].clamp_min(1) * max(stats.num_sequences, 1))
    if sample_weights is None:
        return w
    sample_weights = per_position_weights(sample_weights, mask, segment_ids)
    return w * torch.where(mask, sample_weights.to(dtype), torch.zeros_like(w))


def per_position_weights(sample_weights: Tensor, mask: Tensor, segment_ids: Tensor | None = None) -> Tensor:
    """``sample_weights`` per position ``[B, T]``: as given, or one weight per row ``[B]`` (ROLL's shape)
    broadcast over the row when each row is one sequence.

    Raises:
        ValueError: another shape, or ``[B]`` for packed rows (``segment_ids`` with several sequences in a
            row: a row's weight would apply to all its documents).

    Example:
        >>> import torch
        >>> per_position_weights(torch.tensor([2.0, 3.0]), torch.ones(2, 3, dtype=torch.bool)).tolist()
        [[2.0, 2.0, 2.0], [3.0, 3.0, 3.0]]
    """
    rows = mask.shape[0]
    check_weights(sample_weights, "sample_weights")
    if sample_weights.dim() == 1 and sample_weights.shape[0] == rows and mask.dim() == 2:
        if segment_ids is not None and bool((segment_ids != segment_ids[:, :1]).any()):
            raise ValueError(
                f"sample_weights of shape [{rows}] give one weight per row, but the rows are packed "
                "(segment_ids holds several sequences per row); give one weight per position, shaped like "
                "the labels"
            )
        return sample_weights[:, None].expand_as(mask)
    if sample_weights.shape != mask.shape:
        raise ValueError(
            f"sample_weights shape {tuple(sample_weights.shape)} differs from the mask shape "
            f"{tuple(mask.shape)} (or [{rows}]: one weight per row of unpacked sequences)"
        )
    return sample_weights


def check_norm(norm: float | None, where: str = "norm") -> float:
    """``norm`` as a float if it is a finite number > 0 (the constant ``C`` of ``seq-mean-token-sum-norm``).

    Example:
        >>> check_norm(512)
        512.0
        >>> check_norm(None, "model.loss_agg_norm")
        Traceback (most recent call last):
        ...
        ValueError: model.loss_agg_norm is required by aggregation mode 'seq-mean-token-sum-norm' (...
    """
    ok = isinstance(norm, int | float) and not isinstance(norm, bool) and math.isfinite(norm) and norm > 0
    if not ok:
        need = "is required by" if norm is None else "must be a finite number > 0 for"
        raise ValueError(
            f"{where} {need} aggregation mode {NORM_MODE!r} (the constant C of (1/S) Σ_s Σ_t L_t / C, e.g. "
            f"the maximum response length), got {norm!r}"
        )
    return float(norm)


def aggregate(
    loss_mat: Tensor,
    mask: Tensor,
    mode: AggMode,
    stats: MaskStats,
    segment_ids: Tensor | None = None,
    name: str = "loss",
    norm: float | None = None,
    sample_weights: Tensor | None = None,
) -> Tensor:
    """``Σ_t w_t · loss_mat_t`` with the weights of ``mode`` (masked positions never contribute).

    Args:
        loss_mat: per-token losses ``[B, T]``.
        mask: which positions count ``[B, T]``.
        mode: one of `AGG_MODES`.
        stats: global counts of the mask (`MaskStats`).
        segment_ids: packed-row segments ``[B, T]``; a sequence is a (row, segment) pair.
        name: what ``loss_mat`` is, for error messages.
        norm: the constant ``C`` of ``seq-mean-token-sum-norm`` (required by that mode only).
        sample_weights: per-sequence weights stored per position ``[B, T]``, or ``[B]`` when every row is
            one sequence (ROLL's ``weights=``).

    Example:
        >>> import torch
        >>> from lit_losses.aggregation import MaskStats
        >>> loss = torch.tensor([[1.0, 3.0, 9.0], [2.0, 0.0, 0.0]])
        >>> mask = torch.tensor([[True, True, False], [True, False, False]])
        >>> aggregate(loss, mask, "token-mean", MaskStats(num_tokens=3, num_sequences=2))  # (1+3+2)/3
        tensor(2.)
        >>> aggregate(loss, mask, "seq-mean-token-mean", MaskStats(num_tokens=3, num_sequences=2))  # (2+2)/2
        tensor(2.)
        >>> aggregate(loss, mask, "seq-mean-token-sum-norm", MaskStats(3, 2), norm=4.0)  # (4+2)/(2·4)
        tensor(0.7500)
        >>> weights = torch.tensor([[2.0, 2.0, 2.0], [0.0, 0.0, 0.0]])  # per sequence, stored per token
        >>> aggregate(loss, mask, "token-mean", MaskStats(3, 2), sample_weights=weights)  # (2·1+2·3+0·2)/3
        tensor(2.6667)
    """
    check_tensor(loss_mat, f"{name}: the loss matrix")
    check_tensor(mask, f"{name}: the mask")
    if loss_mat.shape != mask.shape:
        raise ValueError(
            f"{name}: loss matrix shape {tuple(loss_mat.shape)} differs from the mask shape "
            f"{tuple(mask.shape)}"
        )
    w = token_weights(
        mask,
        mode,
        stats,
        segment_ids=segment_ids,
        dtype=loss_mat.dtype,
        norm=norm,
        sample_weights=sample_weights,
    )
    check_counts_cover(mask, stats, segment_ids=segment_ids, name=name)
    return (w * torch.where(mask.bool(), loss_mat, torch.zeros_like(loss_mat))).sum()


def check_counts_cover(
    mask: Tensor, stats: MaskStats, segment_ids: Tensor | None = None, name: str = "loss"
) -> None:
    """Refuse global counts ``stats`` that cannot be the mask's: fewer valid tokens or sequences than
    ``mask`` holds in this one micro-batch (counts summed over a step's micro-batches are never below one
    of them), or as many sequences but other tokens (a sequence lies in one micro-batch, so then every
    counted token is here). Such counts are another mask's (e.g. ``labels``' where a ``completion_mask``
    is aggregated), and the loss would be silently rescaled.

    Raises:
        ValueError: naming the counts, the mask's own and where to take the right ones.

    Example:
        >>> mask = torch.tensor([[True, True, True]])
        >>> check_counts_cover(mask, MaskStats(num_tokens=3, num_sequences=1))
        >>> check_counts_cover(mask, MaskStats(num_tokens=1, num_sequences=1))
        Traceback (most recent call last):
        ...
        ValueError: loss: stats MaskStats(num_tokens=1, num_sequences=1) count fewer valid tokens (1) than ...
    """
    tokens, sequences = count_units(mask, segment_ids)
    for unit, local, counted in (
        ("valid tokens", tokens, stats.num_tokens),
        ("sequences", sequences, stats.num_sequences),
    ):
        if counted < local:
            raise ValueError(
                f"{name}: stats {stats} count fewer {unit} ({counted}) than the mask holds in this "
                f"micro-batch alone ({local}): they are another mask's counts; pass this mask's global "
                "counts (GlobalStats.get(<its mask key>), or count_masks(batch, [<its mask key>]))"
            )
    if stats.num_sequences == sequences and stats.num_tokens != tokens:
        raise ValueError(
            f"{name}: stats {stats} count {stats.num_tokens} valid tokens in {sequences} sequences, but the "
            f"mask holds these {sequences} sequences in this micro-batch with {tokens} valid tokens: they "
            "are another mask's counts; pass this mask's global counts (GlobalStats.get(<its mask key>))"
        )


def reweight_mean(value: Tensor, mode: AggMode, local: MaskStats, stats: MaskStats) -> Tensor:
    """Share of the global value of a scalar ``value`` that is a mean over this micro-batch's valid units.

    ``token-mean``: ``value · n_local / N``; ``token-sum``: ``value · n_local``; ``seq-*`` (with
    ``seq-mean-token-sum-norm``: a mean over sequences of ``Σ_t L_t / C``): ``value · s_local / S``.
    Summed over the micro-batches of a step this is the global mean (sum).
    """
    check_mode(mode)
    if mode == "token-sum":
        return value * local.num_tokens
    if mode == "token-mean":
        return value * (local.num_tokens / max(stats.num_tokens, 1))
    return value * (local.num_sequences / max(stats.num_sequences, 1))
