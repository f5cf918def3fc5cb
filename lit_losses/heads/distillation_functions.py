"""`ChunkedDistillation`: the autograd Function of `lit_losses.heads.linear_distillation`, a per-token
divergence between a student's and a teacher's output distributions computed chunk by chunk of tokens,
neither model's ``[N, V]`` logits ever held.

Forward, for each chunk of ``c`` tokens: the student's logits ``h_s W_sᵀ + b_s`` and the teacher's
``h_t W_tᵀ + b_t`` in two reused ``[c, V]`` work tensors (`lit_losses.heads.chunked_ops.LogitScratch`),
an in-place ``log_softmax`` over each, then the per-token value and the statistic its gradient needs
(`lit_losses.heads.divergence.Divergence.terms`, block of rows by block). Only ``O(N)`` state is kept.
Backward recomputes both chunks of logits, writes ``g ⊙ ∂ℓ/∂z_s`` over the student's
(`Divergence.logit_grad_`) and projects it: ``∂/∂h_s = (∂/∂z) W_s``, ``∂/∂W_s += (∂/∂z)ᵀ h_s``,
``∂/∂b_s += Σ_t ∂/∂z``. Six ``N·D·V`` matmuls in all (two of them the teacher's, twice): the per-token
values' upstream gradients are known only in backward, where the student's weight gradient contracts
them with ``∂ℓ/∂z`` over tokens (as for the head's per-token outputs, `ChunkedLogProbs`). When the
per-token weights of the loss are known in forward, `ChunkedWeightedDistillation` computes ``Σ_t w_t ℓ_t``
and its gradients in one pass (four matmuls), as the head's plain cross-entropy fast path does.

Memory above the inputs: the two work tensors, one block's temporaries, ``O(N)`` statistics and the
student's gradients (the weight's accumulated in the compute dtype, as the ``chunked`` head's).
The teacher's tensors get no gradient (they are not differentiated; the caller detaches them).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from lit_losses.heads.chunked_ops import (
    Grads,
    LogitScratch,
    accumulation_dtype,
    gradients_in_param_dtypes,
    input_gradient_buffers,
    matmul_into,
    save_gradients,
    scaled_gradients,
    softmax_,
    token_chunks,
)
from lit_losses.heads.divergence import Divergence
from lit_losses.heads.higher_order import refuse_double_backward
from lit_losses.heads.precision import autocast_off


def project_logit_grad(dz: Tensor, h: Tensor, weight: Tensor, grads: Grads) -> None:
    """``∂/∂h = dz W`` (written), ``∂/∂W += dzᵀ h``, ``∂/∂b += Σ_t dz`` (accumulated) for one chunk's logit
    gradient ``dz`` (in the compute dtype; cast to ``h``'s for the matmuls)."""
    grad_h, grad_w, grad_b = grads
    dz_in = dz if dz.dtype == h.dtype else dz.to(h.dtype)
    if grad_h is not None:
        matmul_into(grad_h, dz_in, weight)
    if grad_w is not None:
        matmul_into(grad_w, dz_in.t(), h, accumulate=True)
    if grad_b is not None:
        grad_b += dz.sum(0)


class _TwoModelChunks:
    """One pass over both models' chunks of tokens: the accumulation dtype ``promote(h_s, h_t, accum_dtype)``,
    a reused work tensor per model, and, ``with_top1``, ``top1`` ``[n]``: whether the two models' most
    probable tokens agree (written by `chunks`; empty without ``with_top1``)."""

    def __init__(
        self, student: tuple, teacher: tuple, accum_dtype: torch.dtype, with_top1: bool = False
    ) -> None:
        self.student = student
        self.teacher = teacher
        h_s = student[0]
        self.acc = accumulation_dtype(h_s, accumulation_dtype(teacher[0], accum_dtype))
        self.n = h_s.shape[0]
        self.with_top1 = with_top1
        self.top1 = h_s.new_empty(self.n if with_top1 else 0, dtype=torch.bool)
        vocab = student[1].shape[0]
        self.scratch_s = LogitScratch(vocab, self.acc, h_s.device)
        self.scratch_t = LogitScratch(vocab, self.acc, h_s.device)

    def chunks(self, chunk_size: int) -> Iterator[tuple[int, int, Tensor, Tensor]]:
        """``(s, e, log p, log q)`` for each chunk of tokens ``s:e``: the student's and the teacher's
        log-probabilities ``[e − s, V]`` (in the work tensors, valid until the next chunk)."""
        h_s, w_s, b_s = self.student
        h_t, w_t, b_t = self.teacher
        for s, e in token_chunks(self.n, chunk_size):
            lp = softmax_(self.scratch_s.logits(h_s[s:e], w_s, b_s), log=True)
            lq = softmax_(self.scratch_t.logits(h_t[s:e], w_t, b_t), log=True)
            if self.with_top1:
                self.top1[s:e] = lp.argmax(1) == lq.argmax(1)
            yield s, e, lp, lq


class ChunkedDistillation(torch.autograd.Function):
    """``(h_s [n, Ds], W_s [V, Ds], b_s, h_t [n, Dt], W_t [V, Dt], b_t) → ℓ [n]``, the per-token divergence
    of `Divergence` between ``softmax(h_s W_sᵀ + b_s)`` and ``softmax(h_t W_tᵀ + b_t)`` (the module
    docstring), gradients to the student's three tensors only.

    ``apply(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, divergence, chunk_size, accum_dtype,
    with_top1)``: every token counts (the caller drops ignored ones); the logits are already divided by
    the temperature (the caller divides the hidden states and biases); each model's operands are in one
    dtype; the statistics and the value are computed in ``promote(s_hidden, t_hidden, accum_dtype)``.

    Returns:
        ``(ℓ, top1)``: ``[n]`` per-token values in the accumulation dtype, and ``[n]`` booleans, whether
        the two models' most probable tokens agree (``with_top1``; else an empty tensor), not
        differentiable.
    """

    @staticmethod
    def forward(
        ctx: Any,
        s_hidden: Tensor,
        s_weight: Tensor,
        s_bias: Tensor | None,
        t_hidden: Tensor,
        t_weight: Tensor,
        t_bias: Tensor | None,
        divergence: Divergence,
        chunk_size: int,
        accum_dtype: torch.dtype,
        with_top1: bool,
    ) -> tuple[Tensor, Tensor]:
        pair = _TwoModelChunks(
            (s_hidden, s_weight, s_bias), (t_hidden, t_weight, t_bias), accum_dtype, with_top1=with_top1
        )
        value = s_hidden.new_empty(pair.n, dtype=pair.acc)
        stat = s_hidden.new_empty(pair.n if divergence.needs_stat else 0, dtype=pair.acc)
        for s, e, lp, lq in pair.chunks(chunk_size):
            value[s:e], stat_c = divergence.terms(lp, lq)
            if stat_c is not None:
                stat[s:e] = stat_c
        ctx.save_for_backward(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, stat)
        ctx.divergence = divergence
        ctx.chunk_size = chunk_size
        ctx.acc = pair.acc
        ctx.mark_non_differentiable(pair.top1)
        return value, pair.top1

    @staticmethod
    def backward(ctx: Any, upstream: Tensor, _g_top1: Tensor | None):
        refuse_double_backward(
            "linear_distillation (chunked)",
            'use backend="naive" (materialized logits) for a second derivative',
        )
        s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, stat = ctx.saved_tensors
        divergence, acc = ctx.divergence, ctx.acc
        grad_h, grad_w, grad_b = input_gradient_buffers(ctx, s_hidden, s_weight, bias=s_bias, acc=acc)
        g = upstream.to(acc)
        # forward's acc is already promote(s_hidden, t_hidden, accum_dtype): the pass keeps it
        pair = _TwoModelChunks((s_hidden, s_weight, s_bias), (t_hidden, t_weight, t_bias), acc)
        with autocast_off(s_hidden.device):
            for s, e, lp, lq in pair.chunks(ctx.chunk_size):
                stat_c = stat[s:e] if divergence.needs_stat else None
                dz = divergence.logit_grad_(lp, lq, stat=stat_c, upstream=g[s:e])
                gh = None if grad_h is None else grad_h[s:e]
                project_logit_grad(dz, s_hidden[s:e], s_weight, grads=(gh, grad_w, grad_b))
        grads = gradients_in_param_dtypes((grad_h, grad_w, grad_b), s_weight, s_bias)
        return *grads, None, None, None, None, None, None, None


class ChunkedWeightedDistillation(torch.autograd.Function):
    """Fast path: ``Σ_t w_t ℓ_t`` with weights known in forward (the module's global-denominator weights),
    its gradients computed during forward and only rescaled in backward: four ``N·D·V`` matmuls (both
    models' logits once, the two gradient matmuls) instead of `ChunkedDistillation`'s six, one pass of
    element-wise work per chunk.

    ``apply(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, token_weights, divergence, chunk_size,
    accum_dtype, with_top1)``, the arguments of `ChunkedDistillation` and ``token_weights`` ``[n]`` (no
    gradient).

    Returns:
        ``(loss, top1)``: the scalar in the accumulation dtype, and `ChunkedDistillation`'s ``top1``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        s_hidden: Tensor,
        s_weight: Tensor,
        s_bias: Tensor | None,
        t_hidden: Tensor,
        t_weight: Tensor,
        t_bias: Tensor | None,
        token_weights: Tensor,
        divergence: Divergence,
        chunk_size: int,
        accum_dtype: torch.dtype,
        with_top1: bool,
    ) -> tuple[Tensor, Tensor]:
        pair = _TwoModelChunks(
            (s_hidden, s_weight, s_bias), (t_hidden, t_weight, t_bias), accum_dtype, with_top1=with_top1
        )
        w = token_weights.to(pair.acc)
        total = s_hidden.new_zeros((), dtype=pair.acc)
        grads = input_gradient_buffers(ctx, s_hidden, s_weight, bias=s_bias, acc=pair.acc)
        for s, e, lp, lq in pair.chunks(chunk_size):
            value, stat = divergence.terms(lp, lq)
            total += (w[s:e] * value).sum()
            if all(g is None for g in grads):
                continue
            dz = divergence.logit_grad_(lp, lq, stat=stat, upstream=w[s:e])
            gh = None if grads[0] is None else grads[0][s:e]
            project_logit_grad(dz, s_hidden[s:e], s_weight, grads=(gh, grads[1], grads[2]))
        save_gradients(ctx, grads, s_weight, s_bias)
        ctx.mark_non_differentiable(pair.top1)
        return total, pair.top1

    @staticmethod
    def backward(ctx: Any, g_loss: Tensor, _g_top1: Tensor | None):
        refuse_double_backward(
            "linear_distillation with token_weights (chunked)",
            'use backend="naive" (materialized logits) for a second derivative',
        )
        # the buffers are handed out (no V x D copy); a second backward through a retained graph has none
        grads = scaled_gradients(ctx, g_loss, consume=True)
        if grads is None:
            raise RuntimeError(
                "linear_distillation with token_weights: its gradients were handed out by a first backward; "
                "call it again for a second one"
            )
        return *grads, None, None, None, None, None, None, None, None
