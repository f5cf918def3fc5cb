"""The autograd Functions of the ``chunked`` backend: exact per-token head outputs and two fused losses,
computed chunk by chunk without materializing ``[N, V]`` logits (kernels and notation:
`lit_losses.heads.chunked_ops`).

`ChunkedLogProbs` keeps only ``O(N)`` state (``H``) besides its inputs, and its backward recomputes the
logits chunk by chunk, folding each token's upstream gradient into ``∂/∂z`` before the weight-gradient
matmul: four ``N·D·V`` matmuls in all, the fewest an exact per-token head can do without storing
``[N, V]`` (``∂/∂W`` contracts ``p`` over tokens with the upstream gradient, known only in backward).

`ChunkedWeightedCE` is the plain cross-entropy fast path: when the loss is ``Σ_t w_t (−ℓ_t)`` with
weights known in forward (global denominators), the gradients are computed during forward and
backward only rescales them: three matmuls, no recompute. `ChunkedPointwiseLoss` does the same for any
sum of per-token functions of ``(ℓ, lse, H)``.

Under ``create_graph=True`` (double backward) `ChunkedLogProbs` and `ChunkedWeightedCE` recompute their
gradients chunk by chunk with differentiable operations (`recomputed_grads`), exact to every order;
`ChunkedPointwiseLoss` refuses (`lit_losses.heads.higher_order`). A gradient buffer is allocated only
for the inputs that need one (a frozen output weight costs neither its ``V × D`` buffer nor its matmul).
`ChunkedWeightedCE`'s backward hands its buffers out, scaled in place (the weight's gradient is not
copied); a second backward through a retained graph recomputes them.

Arguments common to the three ``apply`` calls: ``hidden`` ``[n, D]`` (hidden states of valid tokens),
``weight`` ``[V, D]``, ``bias`` ``[V]`` or ``None``, ``targets`` ``[n]`` (int64 token ids, all valid),
``chunk_size`` (tokens per chunk) and ``accum_dtype`` (logits and gradients are computed in
``promote(hidden.dtype, accum_dtype)``). Each class's ``Args`` list only its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lit_losses.heads.chunked_ops import (
    LogitScratch,
    accumulation_dtype,
    backprop_chunk,
    backprop_probs,
    chunk_loss_grads,
    entropy_kernels_for,
    entropy_logit_grad_,
    gradients_in_param_dtypes,
    input_gradient_buffers,
    probs_and_entropy,
    recomputed_grads,
    save_gradients,
    scaled_gradients,
    softmax_,
    target_log_probs_,
    token_chunks,
)
from lit_losses.heads.higher_order import refuse_double_backward
from lit_losses.heads.precision import autocast_off

if TYPE_CHECKING:
    from lit_losses.heads.backend import ChunkLoss


class PerTokenFunction(torch.autograd.Function):
    """The context of a per-token autograd Function ``apply(hidden, weight, bias, targets, with_entropy,
    size, accum_dtype) → (logprobs, lse, entropy)`` (`ChunkedLogProbs`, and the ``blocked`` backend's
    `lit_losses.heads.blocked.BlockedLogProbs`): it saves ``(hidden, weight, bias, targets, lse, entropy)``
    (the first four are what `recomputed_grads` reads), keeps ``with_entropy``, ``size`` (tokens per chunk,
    or vocabulary rows per block), ``accum_dtype`` and a further ``logits_dtype`` argument if given (else
    ``None``), and marks an entropy not asked for non-differentiable."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        hidden, weight, bias, targets, with_entropy, size, accum_dtype, *logits_dtype = inputs
        ctx.save_for_backward(hidden, weight, bias, targets, output[1], output[2])
        ctx.with_entropy = with_entropy
        ctx.size = size
        ctx.accum_dtype = accum_dtype
        ctx.logits_dtype = logits_dtype[0] if logits_dtype else None
        if not with_entropy:
            ctx.mark_non_differentiable(output[2])


class ChunkedLogProbs(PerTokenFunction):
    """``(hidden [n, D], weight [V, D], bias [V] | None, targets [n]) → (logprobs, lse, entropy) [n]``.

    Every target must be valid (the caller compacts away ignored positions). ``entropy`` is an empty
    tensor unless ``with_entropy``. Forward computes the logits chunk by chunk and keeps ``H``; backward
    recomputes them and projects ``∂/∂z`` (`lit_losses.heads.chunked_ops`) onto hidden, weight and bias.

    ``apply(hidden, weight, bias, targets, with_entropy, chunk_size, accum_dtype)``:

    Args:
        with_entropy: compute the entropy (and its gradient).

    Returns:
        ``(logprobs, lse, entropy)``, each ``[n]`` in the accumulation dtype (``entropy`` empty unless
        ``with_entropy``).
    """

    @staticmethod
    def forward(
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        with_entropy: bool,
        chunk_size: int,
        accum_dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor, Tensor]:
        acc = accumulation_dtype(hidden, accum_dtype)
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=acc)
        lse = hidden.new_empty(n, dtype=acc)
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=acc)
        scratch = LogitScratch(weight.shape[0], acc, hidden.device)
        compiled = with_entropy and entropy_kernels_for(hidden, weight, chunk_size)
        for s, e in token_chunks(n, chunk_size):
            z = scratch.logits(hidden[s:e], weight, bias)
            logprobs[s:e], lse[s:e], log_p = target_log_probs_(z, targets[s:e])
            if with_entropy:
                _, entropy[s:e] = probs_and_entropy(log_p, scratch, compiled)
        return logprobs, lse, entropy

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor | None, g_lse: Tensor | None, g_ent: Tensor | None):
        hidden, weight, bias, targets, _, entropy = ctx.saved_tensors
        with autocast_off(hidden.device):
            if torch.is_grad_enabled():  # create_graph=True: a differentiable recompute (exact 2nd order)
                g_ent = g_ent if ctx.with_entropy else None
                grads = recomputed_grads(ctx, (g_lp, g_lse, g_ent), chunk_size=ctx.size)
            else:
                grads = ChunkedLogProbs._backward(
                    ctx,
                    hidden,
                    weight,
                    bias=bias,
                    targets=targets,
                    entropy=entropy,
                    g_lp=g_lp,
                    g_lse=g_lse,
                    g_ent=g_ent,
                )
        return *grads, None, None, None, None

    @staticmethod
    def _backward(ctx: Any, hidden, weight, bias, targets, entropy, g_lp, g_lse, g_ent):
        acc = accumulation_dtype(hidden, ctx.accum_dtype)
        n, chunk = hidden.shape[0], ctx.size
        zeros = hidden.new_zeros(n, dtype=acc)
        g_lp = zeros if g_lp is None else g_lp.to(acc)
        g_lse = zeros if g_lse is None else g_lse.to(acc)
        use_entropy = ctx.with_entropy and g_ent is not None
        grad_h, grad_w, grad_b = input_gradient_buffers(ctx, hidden, weight, bias=bias, acc=acc)
        scratch = LogitScratch(weight.shape[0], acc, hidden.device)
        compiled = use_entropy and entropy_kernels_for(hidden, weight, chunk)
        for s, e in token_chunks(n, chunk):
            h, y, gh = hidden[s:e], targets[s:e], None if grad_h is None else grad_h[s:e]
            z = scratch.logits(h, weight, bias)
            coef = g_lse[s:e] - g_lp[s:e]
            if not use_entropy:
                backprop_probs(
                    softmax_(z), coef, y, g_target=g_lp[s:e], h=h, weight=weight, grads=(gh, grad_w, grad_b)
                )
                continue
            log_p = softmax_(z, log=True)
            dz = entropy_logit_grad_(
                log_p,
                None,
                coef,
                g_ent=g_ent[s:e].to(acc),
                entropy=entropy[s:e],
                scratch=scratch,
                compiled=compiled,
            )
            backprop_chunk(dz, y, g_lp[s:e], h=h, weight=weight, grads=(gh, grad_w, grad_b))
        return gradients_in_param_dtypes((grad_h, grad_w, grad_b), weight, bias)


class ChunkedWeightedCE(torch.autograd.Function):
    """Fast path: ``loss = Σ_t w_t · (−ℓ_t)`` with gradients computed in forward (three matmuls).

    Returns ``(loss, logprobs)``; ``logprobs`` is detached (for logging only). Backward only scales
    the gradients stored in forward by the upstream scalar.

    ``apply(hidden, weight, bias, targets, token_weights, chunk_size, accum_dtype)``:

    Args:
        token_weights: ``[n]`` weights ``w_t`` (no gradient).

    Returns:
        ``(loss, logprobs)``: the scalar ``Σ_t w_t · (−ℓ_t)`` and the detached ``[n]`` log-probabilities.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        token_weights: Tensor,
        chunk_size: int,
        accum_dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor]:
        acc = accumulation_dtype(hidden, accum_dtype)
        n = hidden.shape[0]
        w_tok = token_weights.to(acc)
        logprobs = hidden.new_empty(n, dtype=acc)
        grad_h, grad_w, grad_b = input_gradient_buffers(ctx, hidden, weight, bias=bias, acc=acc)
        scratch = LogitScratch(weight.shape[0], acc, hidden.device)
        for s, e in token_chunks(n, chunk_size):
            h, y, w_c = hidden[s:e], targets[s:e], w_tok[s:e]
            z = scratch.logits(h, weight, bias)
            logprobs[s:e], _, log_p = target_log_probs_(z, y)
            # d(−w ℓ)/dz = w (p − e_y)
            gh = None if grad_h is None else grad_h[s:e]
            backprop_probs(
                log_p.exp_(), w_c, y, g_target=-w_c, h=h, weight=weight, grads=(gh, grad_w, grad_b)
            )
        save_gradients(ctx, (grad_h, grad_w, grad_b), weight, bias, hidden, weight, bias, targets, w_tok)
        ctx.chunk_size = chunk_size
        ctx.accum_dtype = accum_dtype
        ctx.mark_non_differentiable(logprobs)
        return -(w_tok * logprobs).sum(), logprobs

    @staticmethod
    def backward(ctx: Any, g_loss: Tensor, _g_logprobs: Tensor | None):
        # the buffers are handed out (no V x D copy); a second backward (retain_graph) recomputes
        if not torch.is_grad_enabled() and (grads := scaled_gradients(ctx, g_loss, consume=True)):
            return *grads, None, None, None, None
        hidden, *_, w_tok = ctx.saved_tensors  # create_graph=True, or again: recompute
        with autocast_off(hidden.device):
            grads = recomputed_grads(ctx, (-w_tok * g_loss, None, None), chunk_size=ctx.chunk_size)
        return *grads, None, None, None, None


class ChunkedPointwiseLoss(torch.autograd.Function):
    """Fast path for losses that are sums of per-token functions of ``(ℓ_t, lse_t, H_t)``.

    ``loss = Σ_chunks chunk_loss(s, e, ℓ[s:e], lse[s:e], H[s:e])``. Each chunk's per-token upstream
    gradients ``(g_ℓ, g_lse, g_H)`` are obtained by autograd on the chunk's ``O(chunk)`` values during
    forward, folded into ``∂/∂z`` (`lit_losses.heads.chunked_ops`) and projected at once: three matmuls, no
    recompute. Valid only when a token's loss depends on that token's values alone (pointwise terms).

    ``apply(hidden, weight, bias, targets, chunk_loss, with_entropy, chunk_size, accum_dtype)``:

    Args:
        chunk_loss: ``(start, end, logprobs, lse, entropy) -> loss`` of tokens ``[start, end)``.
        with_entropy: compute ``H`` and pass it (else ``None``) to ``chunk_loss``.

    Returns:
        The scalar loss in the accumulation dtype.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        chunk_loss: ChunkLoss,
        with_entropy: bool,
        chunk_size: int,
        accum_dtype: torch.dtype,
    ) -> Tensor:
        acc = accumulation_dtype(hidden, accum_dtype)
        n = hidden.shape[0]
        grad_h, grad_w, grad_b = input_gradient_buffers(ctx, hidden, weight, bias=bias, acc=acc)
        total = hidden.new_zeros((), dtype=acc)
        scratch = LogitScratch(weight.shape[0], acc, hidden.device)
        compiled = with_entropy and entropy_kernels_for(hidden, weight, chunk_size)
        for s, e in token_chunks(n, chunk_size):
            h, y, gh = hidden[s:e], targets[s:e], None if grad_h is None else grad_h[s:e]
            z = scratch.logits(h, weight, bias)
            lp_c, lse_c, log_p = target_log_probs_(z, y)
            if with_entropy:
                p, ent_c = probs_and_entropy(log_p, scratch, compiled)
                loss_c, (g_lp, g_lse, g_ent) = chunk_loss_grads(
                    chunk_loss, s, e, values=(lp_c, lse_c, ent_c), acc=acc
                )
            else:
                p = log_p.exp_()
                loss_c, (g_lp, g_lse) = chunk_loss_grads(chunk_loss, s, e, values=(lp_c, lse_c), acc=acc)
            coef = g_lse - g_lp
            if with_entropy and bool(g_ent.ne(0).any()):
                dz = entropy_logit_grad_(
                    log_p, p, coef, g_ent=g_ent, entropy=ent_c, scratch=scratch, compiled=compiled
                )
                backprop_chunk(dz, y, g_lp, h=h, weight=weight, grads=(gh, grad_w, grad_b))
            else:
                p = log_p.exp_() if p is None else p
                backprop_probs(p, coef, y, g_target=g_lp, h=h, weight=weight, grads=(gh, grad_w, grad_b))
            total += loss_c
        save_gradients(ctx, (grad_h, grad_w, grad_b), weight, bias)
        return total

    @staticmethod
    def backward(ctx: Any, g_loss: Tensor):
        refuse_double_backward(
            "FusedLMHead.pointwise_loss (chunked: the chunk loss ran in forward, its second derivatives are "
            "not kept)",
            "compute the loss from the per-token outputs of head(hidden, targets, outputs) instead",
        )
        gh, gw, gb = scaled_gradients(ctx, g_loss)  # kept: a retained graph may run backward again
        return gh, gw, gb, None, None, None, None, None
