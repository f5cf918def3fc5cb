"""The autograd Functions of `lit_losses.heads.topk_distillation`: a student's log-probabilities at ``k``
ids per token and of the rest of the vocabulary, or its logits at the ids alone, without ``[N, V]``
logits.

`TopkBinLogProbs` reads the whole vocabulary chunk by chunk of tokens: per chunk, the logits ``z`` (one
reused ``[c, V]`` work tensor), ``z_ids = z[ids]``, the row maximum ``m``, ``s = Σ_v e^{z_v − m}`` and
``s_rest = Σ_{v ∉ ids} e^{z_v − m}`` (the ids zeroed in ``e^{z − m}``: no cancellation however much mass
the ids hold); it returns ``log p_ids = z_ids − lse`` and ``log p_tail = log s_rest − log s``
(``lse = m + log s``). With upstream gradients ``g_j`` (ids) and ``g_tail``, ``G = Σ_j g_j``,
``P = Σ_j p_j``, backward recomputes the chunk's logits and projects

    ∂/∂z_v = e^{z_v − lse_rest} (g_tail P − G p_tail)   (v ∉ ids),
    ∂/∂z_j = g_j − p_j (G + g_tail)                     (v = id_j),

(``e^{z_v − lse_rest} = p_v / p_tail ≤ 1``; the first line is ``p_v (g_tail / p_tail − g_tail − G)``
without the cancellation of ``1 / p_tail − 1`` when the tail holds nearly all the mass). A row whose
complement underflowed (``p_tail = 0``) gets no tail gradient.

`GatheredLogits` gives ``z_ids`` alone from the ids' rows of the weight (``[c, k, D]`` per chunk): the
renormalized top-k distribution needs nothing else.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lit_losses.heads.chunked_ops import (
    LogitScratch,
    accumulation_dtype,
    gradients_in_param_dtypes,
    input_gradient_buffers,
    token_chunks,
)
from lit_losses.heads.distillation_functions import project_logit_grad
from lit_losses.heads.higher_order import refuse_double_backward
from lit_losses.heads.precision import autocast_off


class TopkBinLogProbs(torch.autograd.Function):
    """``(hidden [n, D], weight [V, D], bias, ids [n, k]) → (log p_ids [n, k], log p_tail [n], top1 [n])``
    (the module docstring), in ``promote(hidden, accum_dtype)``, ``top1`` the most probable token of each
    row (not differentiable); the ids of a row must be distinct.

    ``apply(hidden, weight, bias, ids, chunk_size, accum_dtype)``
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        ids: Tensor,
        chunk_size: int,
        accum_dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor, Tensor]:
        acc = accumulation_dtype(hidden, accum_dtype)
        n, k = ids.shape
        top1 = ids.new_empty(n)
        lp_ids = hidden.new_empty((n, k), dtype=acc)
        lp_tail = hidden.new_empty(n, dtype=acc)
        lse = hidden.new_empty(n, dtype=acc)
        scratch = LogitScratch(weight.shape[0], acc, hidden.device)
        for s, e in token_chunks(n, chunk_size):
            z = scratch.logits(hidden[s:e], weight, bias)
            z_ids = z.gather(1, ids[s:e])
            m, top1[s:e] = z.max(1)
            z.sub_(m[:, None]).exp_()
            log_s = z.sum(1).log()
            lse[s:e] = m + log_s
            lp_ids[s:e] = z_ids - lse[s:e, None]
            lp_tail[s:e] = z.scatter_(1, ids[s:e], 0.0).sum(1).log() - log_s
        ctx.save_for_backward(hidden, weight, bias, ids, lp_ids, lp_tail, lse)
        ctx.chunk_size = chunk_size
        ctx.acc = acc
        ctx.mark_non_differentiable(top1)
        return lp_ids, lp_tail, top1

    @staticmethod
    def backward(ctx: Any, g_ids: Tensor | None, g_tail: Tensor | None, _g_top1: Tensor | None):
        refuse_double_backward("topk_distillation", "compute the loss from materialized logits instead")
        hidden, weight, bias, ids, lp_ids, lp_tail, lse = ctx.saved_tensors
        acc = ctx.acc
        g_ids = torch.zeros_like(lp_ids) if g_ids is None else g_ids.to(acc)
        has_tail = torch.isfinite(lp_tail)
        g_tail = lse.new_zeros(lse.shape) if g_tail is None else torch.where(has_tail, g_tail.to(acc), 0.0)
        p_ids, p_tail = lp_ids.exp(), lp_tail.exp()
        total = g_ids.sum(1)
        off_ids = g_tail * p_ids.sum(1) - total * p_tail
        at_ids = g_ids - p_ids * (total + g_tail)[:, None]
        lse_rest = torch.where(has_tail, lse + lp_tail, lse)
        grad_h, grad_w, grad_b = input_gradient_buffers(ctx, hidden, weight, bias=bias, acc=acc)
        scratch = LogitScratch(weight.shape[0], acc, hidden.device)
        with autocast_off(hidden.device):
            for s, e in token_chunks(hidden.shape[0], ctx.chunk_size):
                dz = scratch.logits(hidden[s:e], weight, bias)
                dz.scatter_(1, ids[s:e], -torch.inf)
                dz.sub_(lse_rest[s:e, None]).exp_().mul_(off_ids[s:e, None])
                dz.scatter_(1, ids[s:e], at_ids[s:e])
                gh = None if grad_h is None else grad_h[s:e]
                project_logit_grad(dz, hidden[s:e], weight, grads=(gh, grad_w, grad_b))
        return *gradients_in_param_dtypes((grad_h, grad_w, grad_b), weight, bias), None, None, None


class GatheredLogits(torch.autograd.Function):
    """``(hidden [n, D], weight [V, D], bias, ids [n, k]) → z_ids [n, k]``, ``z_ids[t, j] = h_t · W[ids[t, j]]
    + b[ids[t, j]]``, from the ``[c, k, D]`` rows of the weight gathered per chunk of ``c`` tokens, in
    ``promote(hidden, accum_dtype)``.

    ``apply(hidden, weight, bias, ids, chunk_size, accum_dtype)``
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        ids: Tensor,
        chunk_size: int,
        accum_dtype: torch.dtype,
    ) -> Tensor:
        acc = accumulation_dtype(hidden, accum_dtype)
        z_ids = hidden.new_empty(ids.shape, dtype=acc)
        for s, e in token_chunks(ids.shape[0], chunk_size):
            rows = weight[ids[s:e]]  # [c, k, D]
            z_ids[s:e] = torch.bmm(rows, hidden[s:e, :, None])[..., 0].to(acc)
        if bias is not None:
            z_ids += bias[ids].to(acc)
        ctx.save_for_backward(hidden, weight, bias, ids)
        ctx.chunk_size = chunk_size
        ctx.acc = acc
        return z_ids

    @staticmethod
    def backward(ctx: Any, g_ids: Tensor):
        refuse_double_backward("topk_distillation", "compute the loss from materialized logits instead")
        hidden, weight, bias, ids = ctx.saved_tensors
        grad_h, grad_w, grad_b = input_gradient_buffers(ctx, hidden, weight, bias=bias, acc=ctx.acc)
        for s, e in token_chunks(ids.shape[0], ctx.chunk_size):
            g = g_ids[s:e].to(hidden.dtype)
            if grad_h is not None:
                grad_h[s:e] = torch.bmm(g[:, None, :], weight[ids[s:e]])[:, 0]
            if grad_w is not None:
                outer = g[:, :, None] * hidden[s:e, None, :]  # [c, k, D]
                grad_w.index_add_(0, ids[s:e].reshape(-1), outer.reshape(-1, hidden.shape[1]).to(ctx.acc))
        if grad_b is not None:
            grad_b.index_add_(0, ids.reshape(-1), g_ids.reshape(-1).to(ctx.acc))
        return *gradients_in_param_dtypes((grad_h, grad_w, grad_b), weight, bias), None, None, None
