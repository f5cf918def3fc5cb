"""The autograd Functions of the vocabulary-parallel head: per-token outputs and the two fused losses when
every rank of a group holds rows ``[start, stop)`` of the output projection (`VocabShard`).

Notation for one token (as in `lit_losses.heads.chunked_ops`): ``z = W h + b``, ``lse = log Σ_v e^{z_v}``,
``p = softmax(z)``, ``ℓ = z_y − lse``, ``H = −Σ_v p_v log p_v``. A rank computes only its logits
``z_loc = W_loc h + b_loc`` (``[chunk, stop − start]``); per chunk of tokens the group exchanges

    m   = max_ranks max_v z_v                                 (all-reduce MAX,  [chunk])
    s   = Σ_ranks Σ_v e^{z_v − m}                             ┐
    z_y = Σ_ranks [start ≤ y < stop] z_y                      │ one all-reduce SUM, [chunk, 2 or 3]
    q   = Σ_ranks Σ_v e^{z_v − m} (z_v − m)   (entropy only)  ┘

and every rank then holds the exact ``lse = m + log s``, ``ℓ = z_y − lse`` and ``H = log s − q / s`` (a sum
of two non-negative terms): ``O(tokens)`` numbers per chunk, never a ``[tokens, V]`` tensor.

The logit gradient ``∂/∂z_v = p_v [g_lse − g_ℓ − g_H (log p_v + H)] + g_ℓ δ_vy`` needs nothing but ``lse``
and ``H``, so each rank forms it for its own rows without communication, and ``∂/∂W_loc = (∂/∂z_loc)ᵀ h``
and ``∂/∂b_loc = Σ_t ∂/∂z_loc`` are exact as they are. ``∂/∂h = Σ_ranks (∂/∂z_loc) W_loc`` is a partial sum
on each rank: it is all-reduced once per call (``[tokens, D]``: the all-reduce that ``ColwiseParallel``
performs in backward for its replicated input), so that the gradient with respect to ``hidden`` is
complete and equal on every rank.

Arguments common to the three ``apply`` calls: ``hidden`` ``[n, D]`` (the valid tokens), ``weight``
``[stop − start, D]`` and ``bias`` ``[stop − start]`` or ``None`` (this rank's rows, in ``hidden``'s dtype),
``targets`` ``[n]`` (global token ids, int64), ``shard`` (the `VocabShard`; its ``group`` is ``None`` for
an unsharded weight: no communication) and ``chunk_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lit_losses.heads.chunked_ops import row_dot, token_chunks
from lit_losses.heads.higher_order import refuse_double_backward
from lit_losses.heads.precision import autocast_off

if TYPE_CHECKING:
    from lit_losses.heads.backend import ChunkLoss
    from lit_losses.heads.vocab_shard import VocabShard

_NO_DOUBLE_BACKWARD = "use the unsharded head (FusedLMHead) for a double backward"


def all_reduce_(tensor: Tensor, op: dist.ReduceOp.RedOpType, group: Any) -> Tensor:
    """``tensor`` all-reduced in place over ``group`` (nothing without a group)."""
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


class ChunkStatistics:
    """The exact softmax statistics of one chunk of tokens from this rank's logits (module docstring).

    After construction ``z`` holds ``z_loc − m`` (overwritten) and ``e`` holds ``e^{z_loc − m}``; `probs`
    turns ``e`` into this rank's ``p`` in place.
    """

    def __init__(self, z: Tensor, targets: Tensor, shard: VocabShard, with_entropy: bool) -> None:
        n, rows = z.shape
        self.owned = (targets >= shard.start) & (targets < shard.stop)
        self.cols = (targets - shard.start).clamp(0, max(rows - 1, 0))
        m = z.amax(1) if rows else z.new_full((n,), float("-inf"))
        all_reduce_(m, dist.ReduceOp.MAX, shard.group)
        z_y = torch.where(self.owned, z.gather(1, self.cols[:, None])[:, 0], 0.0) if rows else z.new_zeros(n)
        self.z = z.sub_(m[:, None])
        self.e = torch.exp(self.z)
        sums = [self.e.sum(1), z_y]
        if with_entropy:
            sums.append(row_dot(self.e, self.z))
        sums = all_reduce_(torch.stack(sums, 1), dist.ReduceOp.SUM, shard.group)
        self.log_s = torch.log(sums[:, 0])
        self.lse = m + self.log_s
        self.logprobs = sums[:, 1] - self.lse
        self.entropy = self.log_s - sums[:, 2] / sums[:, 0] if with_entropy else None
        self._s = sums[:, 0]

    def probs(self) -> Tensor:
        """This rank's ``p = e / s`` (written over ``e``)."""
        return self.e.div_(self._s[:, None])

    def log_probs(self) -> Tensor:
        """This rank's ``log p = (z − m) − log s`` (written over ``z``)."""
        return self.z.sub_(self.log_s[:, None])


def logit_grad(
    p: Tensor,
    log_p: Tensor | None,
    coef: Tensor,
    g_ent: Tensor | None,
    entropy: Tensor | None,
    owned: Tensor,
    cols: Tensor,
    g_target: Tensor,
) -> Tensor:
    """``∂/∂z_loc = p ⊙ [coef − g_H (log p + H)] + g_ℓ e_y`` for this rank's rows (written over ``p``), with
    ``coef = g_lse − g_ℓ``; the target term only where this rank owns the target."""
    if g_ent is None:
        dz = p.mul_(coef[:, None])
    else:
        dz = p.mul_((coef - g_ent * entropy)[:, None] - g_ent[:, None] * log_p)
    rows = torch.arange(dz.shape[0], device=dz.device)
    dz.index_put_((rows[owned], cols[owned]), g_target[owned], accumulate=True)
    return dz


class Gradients:
    """``(∂/∂hidden, ∂/∂weight, ∂/∂bias)`` accumulated chunk by chunk; ``None`` where not needed."""

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Tensor | None, needs: Sequence[bool]) -> None:
        self.h = torch.zeros_like(hidden) if needs[0] else None
        self.w = torch.zeros_like(weight) if needs[1] else None
        self.b = torch.zeros_like(bias) if needs[2] and bias is not None else None

    def add_chunk(self, s: int, e: int, dz: Tensor, h: Tensor, weight: Tensor) -> None:
        if self.h is not None:
            torch.mm(dz, weight, out=self.h[s:e])
        if self.w is not None:
            self.w.addmm_(dz.t(), h)
        if self.b is not None:
            self.b += dz.sum(0)

    def finish(self, shard: VocabShard) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """The gradients, ``∂/∂hidden`` summed over the group (each rank holds its rows' part)."""
        if self.h is not None:
            all_reduce_(self.h, dist.ReduceOp.SUM, shard.group)
        return self.h, self.w, self.b


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.nn.functional.linear(h, weight, bias)


def _chunk_loss_grads(chunk_loss: ChunkLoss, s: int, e: int, values: Sequence[Tensor | None]):
    """``chunk_loss`` of one chunk's (detached) values and its gradient with respect to each (zeros where the
    loss does not depend on one; ``None`` for an absent value)."""
    leaves = [None if v is None else v.detach().requires_grad_(True) for v in values]
    with torch.enable_grad():
        loss = chunk_loss(s, e, *leaves)
        present = [v for v in leaves if v is not None]
        grads = torch.autograd.grad(loss, present, allow_unused=True) if loss.requires_grad else [None] * 3
    found = iter(grads)
    out = []
    for v in leaves:
        g = None if v is None else next(found)
        out.append(None if v is None else (torch.zeros_like(v) if g is None else g))
    return loss.detach(), out


class VocabParallelLogProbs(torch.autograd.Function):
    """``(hidden, weight, bias, targets) → (logprobs, lse, entropy)`` ``[n]``, exact and equal on every rank.

    ``apply(hidden, weight, bias, targets, shard, with_entropy, chunk_size)``; ``entropy`` is empty unless
    ``with_entropy``. Forward keeps ``lse`` and ``H``; backward recomputes each chunk's local logits.
    """

    @staticmethod
    def forward(ctx: Any, hidden, weight, bias, targets, shard, with_entropy: bool, chunk_size: int):
        n = hidden.shape[0]
        logprobs, lse = hidden.new_empty(n), hidden.new_empty(n)
        entropy = hidden.new_empty(n if with_entropy else 0)
        for s, e in token_chunks(n, chunk_size):
            stats = ChunkStatistics(
                _logits(hidden[s:e], weight, bias), targets[s:e], shard, with_entropy=with_entropy
            )
            logprobs[s:e], lse[s:e] = stats.logprobs, stats.lse
            if with_entropy:
                entropy[s:e] = stats.entropy
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.shard = shard
        ctx.with_entropy = with_entropy
        ctx.chunk_size = chunk_size
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, lse, entropy

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor | None, g_lse: Tensor | None, g_ent: Tensor | None):
        refuse_double_backward("the vocabulary-parallel head", _NO_DOUBLE_BACKWARD)
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        shard, n = ctx.shard, hidden.shape[0]
        zeros = hidden.new_zeros(n)
        g_lp = zeros if g_lp is None else g_lp
        g_lse = zeros if g_lse is None else g_lse
        g_ent = g_ent if ctx.with_entropy and g_ent is not None else None
        grads = Gradients(hidden, weight, bias, needs=ctx.needs_input_grad[:3])
        with autocast_off(hidden.device):
            for s, e in token_chunks(n, ctx.chunk_size):
                h, y = hidden[s:e], targets[s:e]
                log_p = _logits(h, weight, bias).sub_(lse[s:e, None])
                p = torch.exp(log_p)
                owned = (y >= shard.start) & (y < shard.stop)
                cols = (y - shard.start).clamp(0, max(weight.shape[0] - 1, 0))
                g_h = None if g_ent is None else g_ent[s:e]
                ent = None if g_ent is None else entropy[s:e]
                dz = logit_grad(
                    p,
                    log_p,
                    g_lse[s:e] - g_lp[s:e],
                    g_ent=g_h,
                    entropy=ent,
                    owned=owned,
                    cols=cols,
                    g_target=g_lp[s:e],
                )
                grads.add_chunk(s, e, dz, h=h, weight=weight)
        return *grads.finish(shard), None, None, None, None


class VocabParallelWeightedCE(torch.autograd.Function):
    """Plain cross-entropy fast path ``Σ_t w_t · (−ℓ_t)``, gradients computed in forward (backward rescales).

    ``apply(hidden, weight, bias, targets, token_weights [n], shard, chunk_size)`` → the scalar loss, equal
    on every rank.
    """

    @staticmethod
    def forward(ctx: Any, hidden, weight, bias, targets, token_weights, shard, chunk_size: int):
        w_tok = token_weights.to(hidden.dtype)
        grads = Gradients(hidden, weight, bias, needs=ctx.needs_input_grad[:3])
        total = hidden.new_zeros(())
        for s, e in token_chunks(hidden.shape[0], chunk_size):
            h, y, w = hidden[s:e], targets[s:e], w_tok[s:e]
            stats = ChunkStatistics(_logits(h, weight, bias), y, shard, with_entropy=False)
            total -= torch.dot(w, stats.logprobs)
            dz = logit_grad(
                stats.probs(),
                None,
                w,
                g_ent=None,
                entropy=None,
                owned=stats.owned,
                cols=stats.cols,
                g_target=-w,
            )  # w (p − e_y)
            grads.add_chunk(s, e, dz, h=h, weight=weight)
        ctx.save_for_backward(*grads.finish(shard))
        return total

    @staticmethod
    def backward(ctx: Any, g_loss: Tensor):
        refuse_double_backward("the vocabulary-parallel head's weighted_ce", _NO_DOUBLE_BACKWARD)
        return *_scaled(ctx, g_loss), None, None, None, None


class VocabParallelPointwiseLoss(torch.autograd.Function):
    """A sum of per-token functions of ``(ℓ, lse, H)``, gradients computed in forward.

    ``apply(hidden, weight, bias, targets, chunk_loss, with_entropy, shard, chunk_size)`` with
    ``chunk_loss(start, end, logprobs, lse, entropy)`` the loss of valid tokens ``[start, end)`` (each
    token's loss a function of its own values: they are equal on every rank, and so is the loss).
    """

    @staticmethod
    def forward(ctx: Any, hidden, weight, bias, targets, chunk_loss, with_entropy, shard, chunk_size: int):
        grads = Gradients(hidden, weight, bias, needs=ctx.needs_input_grad[:3])
        total = hidden.new_zeros(())
        for s, e in token_chunks(hidden.shape[0], chunk_size):
            h, y = hidden[s:e], targets[s:e]
            stats = ChunkStatistics(_logits(h, weight, bias), y, shard, with_entropy=with_entropy)
            loss, (g_lp, g_lse, g_ent) = _chunk_loss_grads(
                chunk_loss, s, e, values=(stats.logprobs, stats.lse, stats.entropy)
            )
            use_entropy = g_ent is not None and bool(g_ent.ne(0).any())
            log_p = stats.log_probs() if use_entropy else None
            p = stats.probs()
            g_h, ent = (g_ent, stats.entropy) if use_entropy else (None, None)
            dz = logit_grad(
                p,
                log_p,
                g_lse - g_lp,
                g_ent=g_h,
                entropy=ent,
                owned=stats.owned,
                cols=stats.cols,
                g_target=g_lp,
            )
            grads.add_chunk(s, e, dz, h=h, weight=weight)
            total += loss
        ctx.save_for_backward(*grads.finish(shard))
        return total

    @staticmethod
    def backward(ctx: Any, g_loss: Tensor):
        refuse_double_backward("the vocabulary-parallel head's pointwise_loss", _NO_DOUBLE_BACKWARD)
        return *_scaled(ctx, g_loss), None, None, None, None, None


def _scaled(ctx: Any, g_loss: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The gradients a fused path saved in forward, times the upstream scalar."""
    grad_h, grad_w, grad_b = ctx.saved_tensors
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    return (
        grad_h * g_loss if need_h else None,
        grad_w * g_loss if need_w else None,
        grad_b * g_loss if need_b and grad_b is not None else None,
    )
