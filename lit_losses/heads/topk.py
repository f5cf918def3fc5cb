"""`topk_distillation`: distillation from a teacher given as its top-k log-probabilities per position
(offline, or from a server), the student's logits never materialized.

The two distributions are compared over bins (`lit_losses.heads.divergence` for the divergences):

* ``tail=True``: the ``k`` ids and one more bin, the rest of the vocabulary. The teacher's tail holds
  ``1 − Σ_j e^{ℓ_j}`` (its log taken as ``log(−expm1(logsumexp ℓ))``); the student's,
  ``Σ_{v ∉ ids} p_v = e^{lse_rest − lse}``, summed over the complement itself (no cancellation).
* ``tail=False``: both renormalized over the ``k`` ids: ``softmax(ℓ)`` and ``softmax(z_ids / T)``.

The temperature divides the student's logits only; the teacher's log-probabilities are used as given
(TRL's convention for a teacher served by another process). A teacher bin of zero mass (its tail when
the top-k hold all of it) adds nothing to ``forward_kl`` and ``jsd``; ``reverse_kl`` would be infinite
there and is refused.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_losses.heads.chunked_ops import CPU_CHUNK_BYTES, DEFAULT_CHUNK_BYTES, default_chunk_size
from lit_losses.heads.distillation import at_valid_positions, check_targets, to_positions
from lit_losses.heads.divergence import DistillationLoss, Divergence
from lit_losses.heads.functional import HeadSettings, check_head_options
from lit_losses.heads.precision import MatmulPrecision, compute_dtype, in_compute_dtype
from lit_losses.heads.topk_functions import GatheredLogits, TopkBinLogProbs
from lit_losses.validation import check_finite_weight

#: How far the teacher's top-k log-probabilities may exceed 0, and their mass ``Σ e^ℓ`` exceed 1, by
#: rounding (a server's fp32 ``log_softmax``, a record's decimals): tolerated and clamped; beyond: refused.
TOPK_TOLERANCE = 1e-3

#: Log-probability standing for a bin of zero mass: its ``e^x`` is exactly 0 in every dtype, so the bin
#: adds exactly nothing, and no ``0 · (−∞)`` appears.
LOG_ZERO = -1e4


def _position(mask: Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def check_topk_inputs(
    ids: Tensor, logprobs: Tensor, lead: torch.Size, vocab_size: int, valid: Tensor | None
) -> None:
    """Refuse teacher top-k fields `topk_distillation` cannot take, naming the first offending position.

    Args:
        ids: ``[..., k]`` token ids (distinct per position, in ``[0, V)``).
        logprobs: ``[..., k]`` their log-probabilities (finite, ``≤ 0`` and ``Σ e^ℓ ≤ 1`` up to
            `TOPK_TOLERANCE`).
        lead: the hidden states' leading shape ``[...]``.
        vocab_size: ``V``.
        valid: ``[...]`` the positions that count (others are not checked), or ``None`` (all).

    Raises:
        ValueError: the message names the tensor, the value and its position.

    Example:
        >>> import torch
        >>> ids, lp = torch.tensor([[3, 1]]), torch.tensor([[-0.1, -0.2]])
        >>> check_topk_inputs(ids, lp, torch.Size([1]), vocab_size=10, valid=None)
        Traceback (most recent call last):
        ...
        ValueError: teacher_topk_logprobs at position (0,) hold a mass Σ exp = 1.7236 > 1 ...
    """
    if ids.dim() != len(lead) + 1 or ids.shape[:-1] != lead or ids.shape[-1] < 1:
        raise ValueError(
            f"teacher_topk_ids shape {tuple(ids.shape)} must be the hidden states' {tuple(lead)} plus k >= 1"
        )
    if logprobs.shape != ids.shape:
        raise ValueError(
            f"teacher_topk_logprobs shape {tuple(logprobs.shape)} differs from teacher_topk_ids "
            f"shape {tuple(ids.shape)}"
        )
    if ids.dtype not in (torch.int64, torch.int32) or not logprobs.is_floating_point():
        raise ValueError(
            f"teacher_topk_ids must be int64/int32 (got {ids.dtype}) and teacher_topk_logprobs floating "
            f"point (got {logprobs.dtype})"
        )
    counts = torch.ones(lead, dtype=torch.bool, device=ids.device) if valid is None else valid
    bad = ((ids < 0) | (ids >= vocab_size)) & counts[..., None]
    if bool(bad.any()):
        raise ValueError(
            f"teacher_topk_ids hold {int(ids[bad][0])} at position {_position(bad)[:-1]}, out of range for "
            f"V={vocab_size}"
        )
    ordered = ids.sort(-1).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(-1) & counts
    if bool(repeated.any()):
        raise ValueError(f"teacher_topk_ids repeat an id at position {_position(repeated)}")
    _check_logprobs(torch.where(counts[..., None], logprobs.double(), LOG_ZERO))


def _check_logprobs(logprobs: Tensor) -> None:
    if not bool(torch.isfinite(logprobs).all()):
        where = _position(~torch.isfinite(logprobs).all(-1))
        raise ValueError(f"teacher_topk_logprobs hold a non-finite value at position {where}")
    above = (logprobs > TOPK_TOLERANCE).any(-1)
    if bool(above.any()):
        raise ValueError(
            f"teacher_topk_logprobs hold {float(logprobs.max()):.4g} > 0 at position {_position(above)}: "
            "log-probabilities are <= 0"
        )
    mass = logprobs.exp().sum(-1)
    if bool((mass > 1 + TOPK_TOLERANCE).any()):
        where = mass > 1 + TOPK_TOLERANCE
        raise ValueError(
            f"teacher_topk_logprobs at position {_position(where)} hold a mass Σ exp = "
            f"{float(mass[where][0]):.4f} > 1 (top-k log-probabilities of one distribution sum to at most 1)"
        )


def teacher_bins(logprobs: Tensor, tail: bool) -> Tensor:
    """The teacher's bin log-probabilities: ``[n, k + 1]`` with the tail ``log(1 − Σ e^ℓ)`` last (`LOG_ZERO`
    for no mass), or ``[n, k]`` renormalized (``log_softmax``). Values above 0 are clamped to 0."""
    lq = logprobs.clamp(max=0.0)
    if not tail:
        return torch.log_softmax(lq, dim=-1)
    rest = torch.log((-torch.expm1(torch.logsumexp(lq, dim=-1))).clamp(min=0.0))
    return torch.cat([lq, rest.clamp(min=LOG_ZERO)[:, None]], dim=1)


def _student_bins(
    head, h: Tensor, ids: Tensor, tail: bool, chunk_size: int | None, dtype
) -> tuple[Tensor, Tensor]:
    """The student's bin log-probabilities, as `teacher_bins` arranges the teacher's, and its most probable
    token (over the vocabulary with ``tail``, else over the ids)."""
    n, vocab, width = h.shape[0], head.weight.shape[0], h.shape[1]
    if not tail:
        budget = CPU_CHUNK_BYTES if h.device.type == "cpu" else DEFAULT_CHUNK_BYTES
        chunk = chunk_size or max(1, budget // (ids.shape[1] * width * 4))
        lp = torch.log_softmax(GatheredLogits.apply(h, head.weight, head.bias, ids, chunk, dtype), dim=-1)
        return lp, ids.gather(1, lp.argmax(1, keepdim=True))[:, 0]
    chunk = chunk_size or default_chunk_size(n, vocab, device=h.device)
    lp_ids, lp_tail, top1 = TopkBinLogProbs.apply(h, head.weight, head.bias, ids, chunk, dtype)
    return torch.cat([lp_ids, lp_tail.clamp(min=LOG_ZERO)[:, None]], dim=1), top1


def topk_distillation(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_topk_ids: Tensor,
    teacher_topk_logprobs: Tensor,
    *,
    loss: DistillationLoss = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    tail: bool = True,
    student_bias: Tensor | None = None,
    targets: Tensor | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    accum_dtype: torch.dtype = torch.float32,
    check_finite: bool = True,
    matmul_precision: MatmulPrecision = "auto",
    return_top1: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token divergence between a teacher given by its top-k log-probabilities ``ℓ [..., k]`` at ids
    ``[..., k]`` and the student's ``p = softmax(z / T)``, ``z = h Wᵀ + b``, over ``k + 1`` bins (the ids
    and the rest of the vocabulary, ``tail=True``) or the ``k`` ids renormalized (``tail=False``).

    The divergences are `linear_distillation`'s (``forward_kl`` = ``KL(teacher ‖ student)``,
    ``reverse_kl``, ``jsd`` with ``β``), over the bins. The temperature tempers the student only; the
    teacher's log-probabilities are used as given. ``reverse_kl`` with ``tail=True`` is refused where the
    teacher's top-k hold all its mass (an empty teacher tail: infinite divergence). Positions whose
    ``targets`` equal ``ignore_index`` give 0 and no gradient, and their top-k fields are not checked.

    ``tail=True`` reads the whole vocabulary chunk by chunk (four ``N·D·V`` matmuls, forward and a
    recompute in backward; one ``[chunk, V]`` work tensor); ``tail=False`` only the ``k`` rows of the
    weight per token.

    Args:
        student_hidden: ``[..., D]`` hidden states.
        student_weight: ``[V, D]`` output projection.
        teacher_topk_ids: ``[..., k]`` the teacher's top-k token ids (distinct per position).
        teacher_topk_logprobs: ``[..., k]`` their log-probabilities (``≤ 0``, ``Σ e^ℓ ≤ 1``, up to
            `TOPK_TOLERANCE`).
        loss: ``forward_kl``, ``reverse_kl`` or ``jsd``.
        beta: ``β ∈ [0, 1]`` of ``jsd``.
        temperature: ``T > 0``, dividing the student's logits.
        tail: compare the rest of the vocabulary as one bin (``True``) or renormalize over the ids.
        student_bias: ``[V]`` or ``None``.
        targets: ``[...]`` token ids (only ``ignore_index`` is read), or ``None`` (every position counts).
        ignore_index: target value of positions that do not count.
        chunk_size: tokens per chunk.
        accum_dtype: the least precise dtype of logits, statistics and gradients.
        check_finite: refuse NaN/Inf in the hidden states and the weight.
        matmul_precision: see `lit_losses.heads.linear_logprobs`.
        return_top1: also return whether the student's most probable token is the teacher's most probable
            one (its first-ranked id) at each position: over the vocabulary with ``tail``, over the ids
            without (``False`` at ignored positions).

    Returns:
        ``[...]`` per-token values in the compute dtype, 0 at ignored positions; with ``return_top1``,
        ``(values, agreement)``.

    Raises:
        ConfigError: an unknown ``loss``, ``beta`` outside ``[0, 1]``.
        ValueError: a bad temperature or shapes, ids out of range or repeated, log-probabilities above 0
            or of a mass above 1, an empty teacher tail under ``reverse_kl`` with ``tail=True``.

    Example:
        >>> import torch
        >>> from lit_losses.heads import topk_distillation
        >>> g = torch.Generator().manual_seed(0)
        >>> h = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
        >>> w = torch.randn(10, 4, generator=g, dtype=torch.float64)  # V = 10
        >>> ids = torch.tensor([[1, 4], [0, 9], [2, 3]])
        >>> lq = torch.log(torch.tensor([[0.5, 0.3], [0.6, 0.4], [0.9, 0.05]], dtype=torch.float64))
        >>> kl = topk_distillation(h, w, ids, lq)  # tail bins: 0.2, 0.0, 0.05
        >>> p = torch.softmax(h @ w.T, -1)
        >>> p_bins = torch.cat([p.gather(1, ids), 1 - p.gather(1, ids).sum(1, keepdim=True)], 1)
        >>> q_bins = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.4, 0.0], [0.9, 0.05, 0.05]], dtype=torch.float64)
        >>> ref = torch.where(q_bins > 0, q_bins * (q_bins.log() - p_bins.log()), 0).sum(1)
        >>> torch.allclose(kl, ref)
        True
    """
    divergence = Divergence.of(loss, beta)
    check_head_options("chunked", chunk_size, matmul_precision, temperature=temperature)
    lead, vocab = student_hidden.shape[:-1], student_weight.shape[0]
    if student_weight.dim() != 2 or student_hidden.shape[-1] != student_weight.shape[1]:
        raise ValueError(
            f"student_hidden.shape={tuple(student_hidden.shape)} does not match student_weight.shape="
            f"{tuple(student_weight.shape)} ([..., D] and [V, D])"
        )
    check_targets(targets, lead, vocab, ignore_index=ignore_index)
    valid = None if targets is None else targets != ignore_index
    check_topk_inputs(teacher_topk_ids, teacher_topk_logprobs, lead, vocab_size=vocab, valid=valid)
    if check_finite:
        check_finite_weight(student_hidden, where="student_hidden")
        check_finite_weight(student_weight, where="student_weight")
    k = teacher_topk_ids.shape[-1]
    h, ids, lq = (
        at_valid_positions(x, valid=valid, lead=lead)
        for x in (student_hidden, teacher_topk_ids, teacher_topk_logprobs)
    )
    ids, lq = ids.long(), lq.detach()
    dtype = compute_dtype(student_hidden, student_weight, student_bias, accum_dtype=accum_dtype)
    lq_bins = teacher_bins(lq.to(dtype), tail=tail)
    if divergence.loss == "reverse_kl" and tail and bool((lq_bins[:, k] <= LOG_ZERO).any()):
        raise ValueError(
            "reverse_kl with tail=True is infinite where the teacher's top-k hold all its mass (no tail): "
            f"valid position {_position(lq_bins[:, k] <= LOG_ZERO)}; use tail=False, or forward_kl/jsd"
        )
    head, h = HeadSettings(
        weight=student_weight,
        bias=student_bias,
        backend="chunked",
        chunk_size=chunk_size,
        ignore_index=ignore_index,
        accum_dtype=dtype,
        check_finite=False,
        matmul_precision=matmul_precision,
        temperature=temperature,
    ).tempered(h)
    with in_compute_dtype(head, h) as (cast, h_cast):
        lp_bins, top1 = _student_bins(cast, h_cast, ids, tail=tail, chunk_size=chunk_size, dtype=dtype)
        values = divergence.terms(lp_bins, lq_bins)[0]
    agree = top1 == ids.gather(1, lq.argmax(1, keepdim=True))[:, 0]
    values, agree = to_positions(values, valid=valid, lead=lead), to_positions(agree, valid=valid, lead=lead)
    return (values, agree) if return_top1 else values


__all__ = ["LOG_ZERO", "TOPK_TOLERANCE", "check_topk_inputs", "teacher_bins", "topk_distillation"]
