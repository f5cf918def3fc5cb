"""`linear_distillation`: a per-token divergence between a student's and a teacher's output distributions
from their hidden states and output projections, neither model's logits materialized.

The maths of the three divergences and their gradients: `lit_losses.heads.divergence`; the chunked
autograd Function: `lit_losses.heads.distillation_functions`. The teacher given as offline top-k
log-probabilities instead: `lit_losses.heads.topk_distillation`.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Literal

import torch
from torch import Tensor

from lit_losses.choices import check_choice
from lit_losses.heads.chunked_ops import default_chunk_size
from lit_losses.heads.distillation_functions import ChunkedDistillation, ChunkedWeightedDistillation
from lit_losses.heads.divergence import DistillationLoss, Divergence
from lit_losses.heads.functional import HeadSettings, check_head_options
from lit_losses.heads.precision import MatmulPrecision, compute_dtype, in_compute_dtype
from lit_losses.validation import check_finite_weight

#: How `linear_distillation` computes: ``chunked`` (``auto``: token chunks, logits never materialized) or
#: ``naive`` (both ``[N, V]`` logits materialized, autograd; the reference, and twice differentiable).
DistillationBackend = Literal["auto", "chunked", "naive"]


def _check_pair(hidden: Tensor, weight: Tensor, bias: Tensor | None, who: str) -> None:
    if weight.dim() != 2:
        raise ValueError(f"{who}_weight must be [V, D], got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{who}_hidden width {hidden.shape[-1] if hidden.dim() else None} "
            f"({who}_hidden.shape={tuple(hidden.shape)}) does not match {who}_weight width {weight.shape[1]} "
            f"({who}_weight.shape={tuple(weight.shape)})"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(
            f"{who}_bias shape {tuple(bias.shape)} does not match {who}_weight's V={weight.shape[0]} rows"
        )


def check_targets(targets: Tensor | None, lead: torch.Size, vocab_size: int, ignore_index: int) -> None:
    """Refuse ``targets`` not shaped like the hidden states' leading dimensions ``lead``, not integer, or
    out of ``[0, vocab_size)`` where not ``ignore_index`` (``None`` passes)."""
    if targets is None:
        return
    if targets.shape != lead:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} does not match the hidden states' {tuple(lead)}"
        )
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be int64 or int32 token ids, got dtype {targets.dtype}")
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))
    if bool(bad.any()):
        raise ValueError(
            f"target {int(targets[bad].flatten()[0])} is out of range for V={vocab_size} "
            f"(valid: 0..{vocab_size - 1}, or ignore_index={ignore_index})"
        )


def check_distillation_inputs(
    student: tuple[Tensor, Tensor, Tensor | None],
    teacher: tuple[Tensor, Tensor, Tensor | None],
    targets: Tensor | None,
    ignore_index: int,
    check_finite: bool,
) -> None:
    """Refuse inputs `linear_distillation` cannot take, naming the tensor and its shape.

    Args:
        student: ``(hidden [..., Ds], weight [V, Ds], bias [V] | None)``.
        teacher: ``(hidden [..., Dt], weight [V, Dt], bias [V] | None)``.
        targets: ``[...]`` token ids or ``None``.
        ignore_index: target value of positions that do not count.
        check_finite: also refuse NaN/Inf in the four hidden states and weights.

    Raises:
        ValueError: mismatched shapes (vocabularies of two sizes: both named), bad targets, or non-finite
            values.

    Example:
        >>> import torch
        >>> s = (torch.zeros(3, 4), torch.zeros(10, 4), None)
        >>> t = (torch.zeros(3, 6), torch.zeros(12, 6), None)
        >>> check_distillation_inputs(s, t, None, -100, True)
        Traceback (most recent call last):
        ...
        ValueError: the student's vocabulary has V=10 rows (student_weight.shape=(10, 4)) and the ...
    """
    _check_pair(*student, who="student")
    _check_pair(*teacher, who="teacher")
    (h_s, w_s, _), (h_t, w_t, _) = student, teacher
    if w_s.shape[0] != w_t.shape[0]:
        raise ValueError(
            f"the student's vocabulary has V={w_s.shape[0]} rows (student_weight.shape={tuple(w_s.shape)}) "
            f"and the teacher's V={w_t.shape[0]} (teacher_weight.shape={tuple(w_t.shape)}): distillation "
            "compares distributions over one vocabulary"
        )
    if h_s.shape[:-1] != h_t.shape[:-1]:
        raise ValueError(
            f"student_hidden.shape={tuple(h_s.shape)} and teacher_hidden.shape={tuple(h_t.shape)} differ "
            "before the last dimension: one teacher position per student position"
        )
    check_targets(targets, h_s.shape[:-1], w_s.shape[0], ignore_index=ignore_index)
    if check_finite:
        for name, tensor in zip(
            ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight"),
            (h_s, w_s, h_t, w_t),
            strict=True,
        ):
            check_finite_weight(tensor, where=name)


def naive_distillation(
    student: tuple[Tensor, Tensor, Tensor | None],
    teacher: tuple[Tensor, Tensor, Tensor | None],
    divergence: Divergence,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """``(ℓ, top1)``: the per-token divergence from both ``[n, V]`` logits in ``dtype``, differentiated by
    autograd (the teacher's under ``no_grad``; memory ``O(n · V)``), and whether the two models' most
    probable tokens agree."""
    h_s, w_s, b_s = student
    h_t, w_t, b_t = teacher

    def cast(x: Tensor | None) -> Tensor | None:
        return None if x is None else x.to(dtype)

    lp = torch.log_softmax(torch.nn.functional.linear(cast(h_s), cast(w_s), cast(b_s)), dim=-1)
    with torch.no_grad():
        lq = torch.log_softmax(torch.nn.functional.linear(cast(h_t), cast(w_t), cast(b_t)), dim=-1)
    return divergence.terms(lp, lq)[0], lp.argmax(-1) == lq.argmax(-1)


def linear_distillation(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    *,
    loss: DistillationLoss = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    targets: Tensor | None = None,
    ignore_index: int = -100,
    backend: DistillationBackend = "auto",
    chunk_size: int | None = None,
    accum_dtype: torch.dtype = torch.float32,
    check_finite: bool = True,
    matmul_precision: MatmulPrecision = "auto",
    return_top1: bool = False,
    token_weights: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token divergence between the student's ``p = softmax(z_s / T)`` and the teacher's
    ``q = softmax(z_t / T)``, ``z_s = h_s W_sᵀ + b_s``, ``z_t = h_t W_tᵀ + b_t``, logits never materialized.

    * ``forward_kl``: ``KL(q ‖ p) = Σ_v q_v (log q_v − log p_v)``;
    * ``reverse_kl``: ``KL(p ‖ q) = Σ_v p_v (log p_v − log q_v)``;
    * ``jsd``: the generalized Jensen-Shannon divergence of TRL's distillation trainers and Liger-Kernel,
      ``β KL(q ‖ m) + (1 − β) KL(p ‖ m)`` with ``m = (1 − β) p + β q``; ``β = 0`` is exactly ``forward_kl``
      and ``β = 1`` exactly ``reverse_kl`` (as TRL special-cases them: the mixture formula itself tends to 0
      at both ends).

    No ``T²`` factor (TRL's and Liger-Kernel's convention): for Hinton's, multiply the loss's weight by
    ``T²``. Positions whose ``targets`` equal ``ignore_index`` give 0 and no gradient (``targets=None``:
    every position counts); they go through no matmul. Gradients reach the student's hidden states,
    weight and bias only; the teacher's tensors get none, even when they require grad.

    The logits and softmax statistics are computed in ``promote(inputs, accum_dtype)`` (fp32 for
    bf16/fp16 inputs) whatever autocast does, the matmul operands as the head's ``matmul_precision``
    says (`lit_losses.heads.precision`). The ``chunked`` backend holds two ``[chunk, V]`` work tensors
    and ``O(N)`` statistics beyond the student's gradients (forward computes both chunks of logits; backward
    recomputes them: six ``N·D·V`` matmuls; maths in `lit_losses.heads.divergence`). With
    ``token_weights`` the result is the weighted sum ``Σ_t w_t ℓ_t`` instead, its gradients computed in
    forward (four matmuls, one pass; backward only rescales them), as `linear_cross_entropy`'s.

    Args:
        student_hidden: ``[..., Ds]`` the student's hidden states.
        student_weight: ``[V, Ds]`` its output projection.
        teacher_hidden: ``[..., Dt]`` the teacher's hidden states at the same positions (``Dt`` may differ).
        teacher_weight: ``[V, Dt]`` its output projection (the same ``V``).
        loss: ``forward_kl``, ``reverse_kl`` or ``jsd``.
        beta: ``β ∈ [0, 1]`` of ``jsd`` (unused by the two KLs).
        temperature: ``T > 0``, dividing both models' logits.
        student_bias: ``[V]`` or ``None``.
        teacher_bias: ``[V]`` or ``None``.
        targets: ``[...]`` token ids (only ``ignore_index`` is read: which positions count), or ``None``.
        ignore_index: target value of positions that do not count.
        backend: ``auto`` (``chunked``), ``chunked``, or ``naive`` (both logits materialized; autograd, so
            twice differentiable).
        chunk_size: tokens per chunk (default: two fp32 ``[chunk, V]`` tensors of about one head chunk,
            `default_chunk_size`).
        accum_dtype: the least precise dtype of logits, statistics and gradients.
        check_finite: refuse NaN/Inf in the hidden states and weights (one reduction each).
        matmul_precision: see `lit_losses.heads.linear_logprobs`.
        return_top1: also return whether the two models' most probable tokens agree at each position
            (``False`` at ignored ones): two more reads of each chunk, no matmul.
        token_weights: ``[...]`` per-position weights ``w`` (no gradient; unused at ignored positions):
            return ``Σ_t w_t ℓ_t``, a scalar whose gradients are computed in forward.

    Returns:
        ``[...]`` per-token values (shaped like ``student_hidden.shape[:-1]``) in the compute dtype, 0 at
        ignored positions (with ``token_weights``: their weighted sum); with ``return_top1``, ``(values,
        agreement)``, ``agreement`` a bool tensor shaped like the positions.

    Raises:
        ConfigError: an unknown ``loss`` or ``backend``, ``beta`` outside ``[0, 1]``.
        ValueError: a temperature that is not finite and positive, ``chunk_size < 1``, mismatched shapes
            (vocabularies of two sizes), bad targets or non-finite inputs.

    Example:
        >>> import torch
        >>> from lit_losses.heads import linear_distillation
        >>> g = torch.Generator().manual_seed(0)
        >>> h_s = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
        >>> w_s = torch.randn(11, 4, generator=g, dtype=torch.float64, requires_grad=True)  # V=11, Ds=4
        >>> h_t = torch.randn(2, 3, 6, generator=g, dtype=torch.float64)
        >>> w_t = torch.randn(11, 6, generator=g, dtype=torch.float64)  # Dt=6
        >>> targets = torch.tensor([[1, 5, -100], [0, 10, 3]])
        >>> kl = linear_distillation(h_s, w_s, h_t, w_t, temperature=2.0, targets=targets, chunk_size=2)
        >>> lp = torch.log_softmax(h_s @ w_s.T / 2, -1)
        >>> lq = torch.log_softmax(h_t @ w_t.T / 2, -1)
        >>> ref = (lq.exp() * (lq - lp)).sum(-1).masked_fill(targets == -100, 0)
        >>> torch.allclose(kl, ref), kl.shape
        (True, torch.Size([2, 3]))
        >>> kl.sum().backward()
        >>> bool(h_s.grad[0, 2].eq(0).all())
        True
    """
    divergence = Divergence.of(loss, beta)
    check_choice(backend, DistillationBackend, "backend")
    check_head_options("chunked", chunk_size, matmul_precision, temperature=temperature)
    student = (student_hidden, student_weight, student_bias)
    teacher = (teacher_hidden, teacher_weight, teacher_bias)
    check_distillation_inputs(student, teacher, targets, ignore_index=ignore_index, check_finite=check_finite)
    lead = student_hidden.shape[:-1]
    if token_weights is not None and token_weights.shape != lead:
        raise ValueError(
            f"token_weights shape {tuple(token_weights.shape)} differs from the positions' {tuple(lead)}"
        )
    valid = None if targets is None else targets != ignore_index
    h_s, h_t = (at_valid_positions(h, valid=valid, lead=lead) for h in (student_hidden, teacher_hidden))
    weights = token_weights
    if weights is not None:
        weights = at_valid_positions(weights.detach(), valid=valid, lead=lead)
    values, top1 = _compute(
        student=(h_s, student_weight, student_bias),
        teacher=tuple(None if x is None else x.detach() for x in (h_t, teacher_weight, teacher_bias)),
        divergence=divergence,
        options=dict(
            temperature=temperature,
            accum_dtype=accum_dtype,
            matmul_precision=matmul_precision,
            backend=backend,
            chunk_size=chunk_size,
            with_top1=return_top1,
            token_weights=weights,
        ),
    )
    if token_weights is None:  # per-token values, 0 at ignored positions
        values = to_positions(values, valid=valid, lead=lead)
    return (values, to_positions(top1, valid=valid, lead=lead)) if return_top1 else values


def at_valid_positions(x: Tensor, *, valid: Tensor | None, lead: torch.Size) -> Tensor:
    """``x`` ``[*lead, ...]`` at the valid positions ``[n, ...]`` (all of them when ``valid`` is None).

    Example:
        >>> x = torch.arange(12.0).reshape(2, 3, 2)
        >>> valid = torch.tensor([[True, False, True], [False, False, True]])
        >>> at_valid_positions(x, valid=valid, lead=x.shape[:2])
        tensor([[ 0.,  1.],
                [ 4.,  5.],
                [10., 11.]])
        >>> at_valid_positions(x, valid=None, lead=x.shape[:2]).shape
        torch.Size([6, 2])
    """
    return x.reshape(-1, *x.shape[len(lead) :]) if valid is None else x[valid]


def to_positions(x: Tensor, *, valid: Tensor | None, lead: torch.Size) -> Tensor:
    """``x`` ``[n]`` of the valid positions back into ``lead``, zeros (``False``) elsewhere: what
    `at_valid_positions` took, put back.

    Example:
        >>> valid = torch.tensor([[True, False], [False, True]])
        >>> to_positions(torch.tensor([1.0, 2.0]), valid=valid, lead=valid.shape)
        tensor([[1., 0.],
                [0., 2.]])
    """
    return x.reshape(lead) if valid is None else x.new_zeros(lead).masked_scatter(valid, x)


def _compute(
    student: tuple[Tensor, Tensor, Tensor | None],
    teacher: tuple[Tensor, Tensor, Tensor | None],
    divergence: Divergence,
    options: dict,
) -> tuple[Tensor, Tensor]:
    """``(values, top1)`` of the valid tokens ``[n]``: both heads tempered and in their compute dtype, then
    the chosen backend."""
    dtype = torch.promote_types(
        compute_dtype(*student, accum_dtype=options["accum_dtype"]),
        compute_dtype(*teacher, accum_dtype=options["accum_dtype"]),
    )
    heads = [
        HeadSettings(
            weight=weight,
            bias=bias,
            backend="chunked",
            chunk_size=options["chunk_size"],
            ignore_index=-100,
            accum_dtype=dtype,
            check_finite=False,
            matmul_precision=options["matmul_precision"],
            temperature=options["temperature"],
        ).tempered(hidden)
        for hidden, weight, bias in (student, teacher)
    ]
    with ExitStack() as stack:
        (s_head, h_s), (t_head, h_t) = (stack.enter_context(in_compute_dtype(head, h)) for head, h in heads)
        cast_s, cast_t = (h_s, s_head.weight, s_head.bias), (h_t, t_head.weight, t_head.bias)
        weights = options["token_weights"]
        if options["backend"] == "naive":
            values, top1 = naive_distillation(cast_s, cast_t, divergence, dtype=dtype)
            return (values, top1) if weights is None else ((weights.to(values.dtype) * values).sum(), top1)
        n, vocab = h_s.shape[0], s_head.weight.shape[0]
        chunk = options["chunk_size"] or default_chunk_size(n, vocab, bytes_per_elem=8, device=h_s.device)
        settings = (chunk, dtype, options["with_top1"])
        if weights is not None:
            return ChunkedWeightedDistillation.apply(*cast_s, *cast_t, weights, divergence, *settings)
        return ChunkedDistillation.apply(*cast_s, *cast_t, divergence, *settings)


__all__ = [
    "DistillationBackend",
    "at_valid_positions",
    "check_distillation_inputs",
    "check_targets",
    "linear_distillation",
    "naive_distillation",
    "to_positions",
]
