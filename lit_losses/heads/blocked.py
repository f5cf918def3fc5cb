"""The ``blocked`` backend: the output head over blocks of the vocabulary, with no ``V × D`` temporary.

Forward reads the vocabulary block by block (an online log-sum-exp, `lit_losses.heads.vocab_blocks`);
backward recomputes each ``[n, V_b]`` block of logits for all tokens, so each block of the weight's gradient
is complete after one matmul, accumulated by it in the compute dtype (fp32 for bf16 operands) and stored
once in the weight's dtype. The weight is never cast as a whole: a bf16 weight costs its bf16 gradient,
one block and ``O(N·D)`` fp32 state. Four ``N·D·V`` matmuls for every output, the plain cross-entropy
included (its loss is taken from the per-token ``logprobs``, no fused path).

``auto`` takes it for a weight stored in a narrower dtype than the compute dtype (bf16/fp16 weights,
``bf16-true`` training): there the token-chunked ``chunked`` backend would hold an fp32 copy of the weight
and an fp32 ``V × D`` gradient accumulator beside the weight's own gradient (measured at 1024 × 1024 ×
65536 on CPU: 3.2× the bf16 gradient's bytes above the inputs for the plain cross-entropy). For a weight
already in the compute dtype the accumulator *is* the gradient, and ``chunked`` keeps its faster fused
paths (three matmuls for the plain cross-entropy; `benchmarks/head_memory.py`). Per-token outputs take
four matmuls on both, and ``auto`` takes ``blocked`` for them with any weight (measured faster and leaner
on CPU and on an H100, `lit_losses.heads.backend.select_backend`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lit_losses.heads.backend import HeadBackend, HeadConfig, register_backend, scatter_valid, valid_tokens
from lit_losses.heads.chunked_ops import accumulation_dtype, default_chunk_size, recomputed_grads
from lit_losses.heads.functions import PerTokenFunction
from lit_losses.heads.precision import autocast_off
from lit_losses.heads.vocab_blocks import blocked_backward, blocked_forward, vocab_block_size

if TYPE_CHECKING:
    from lit_losses.heads.output import HeadOutput

__all__ = ["BLOCKED", "BlockedLogProbs", "blocked_per_token", "blocked_weighted_ce"]


class BlockedLogProbs(PerTokenFunction):
    """``(hidden [n, D], weight [V, D], bias [V] | None, targets [n]) → (logprobs, lse, entropy) [n]`` over
    vocabulary blocks of ``block`` rows.

    ``hidden`` is in the operand dtype; ``weight`` and ``bias`` in their own (each block is cast as it is
    used, and their gradients are returned in their dtypes). Every target must be valid. ``entropy`` is an
    empty tensor unless ``with_entropy``. A double backward (``create_graph=True``) recomputes the
    gradients with differentiable operations, token chunk by token chunk (exact to every order).

    ``apply(hidden, weight, bias, targets, with_entropy, block, accum_dtype, logits_dtype)`` (its context:
    `PerTokenFunction`): ``logits_dtype`` is the dtype each block of logits is written in, ``None`` for
    the accumulation dtype or, for ``matmul_precision="low_logits"``, ``hidden``'s (the softmax statistics
    are computed in the accumulation dtype either way; a double backward differentiates the unrounded
    logits).

    Returns:
        ``(logprobs, lse, entropy)``, each ``[n]`` in ``promote(hidden, accum_dtype)``.
    """

    @staticmethod
    def forward(
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        with_entropy: bool,
        block: int,
        accum_dtype: torch.dtype,
        logits_dtype: torch.dtype | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        acc = accumulation_dtype(hidden, accum_dtype)
        logprobs, lse, entropy = blocked_forward(
            hidden,
            weight,
            bias,
            targets=targets,
            with_entropy=with_entropy,
            block=block,
            acc=acc,
            logits_dtype=logits_dtype,
        )
        return logprobs, lse, hidden.new_empty(0, dtype=acc) if entropy is None else entropy

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor | None, g_lse: Tensor | None, g_ent: Tensor | None):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        g_ent = g_ent if ctx.with_entropy else None
        with autocast_off(hidden.device):
            if torch.is_grad_enabled():  # create_graph=True: a differentiable recompute (exact 2nd order)
                chunk = default_chunk_size(hidden.shape[0], weight.shape[0], device=hidden.device)
                grads = recomputed_grads(ctx, (g_lp, g_lse, g_ent), chunk_size=chunk)
                return *grads, None, None, None, None, None
            zeros = lse.new_zeros(lse.shape)
            upstream = (
                zeros if g_lp is None else g_lp.to(lse.dtype),
                zeros if g_lse is None else g_lse.to(lse.dtype),
                None if g_ent is None else g_ent.to(lse.dtype),
            )
            grad_h, grad_w, grad_b = blocked_backward(
                hidden,
                weight,
                bias,
                targets=targets,
                stats=(lse, entropy),
                upstream=upstream,
                block=ctx.size,
                needs=needs,
                logits_dtype=ctx.logits_dtype,
            )
        grad_h = None if grad_h is None else grad_h.to(hidden.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _log_probs(head: HeadConfig, h: Tensor, y: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    block = vocab_block_size(
        h.shape[0], head.vocab_size, h.shape[-1], chunk_size=head.chunk_size, device=h.device
    )
    # bf16 logits for low_logits (h holds the operands); None: the accumulation dtype's
    logits = h.dtype if getattr(head, "matmul_precision", "full") == "low_logits" else None
    return BlockedLogProbs.apply(h, head.weight, head.bias, y, with_entropy, block, head.accum_dtype, logits)


def blocked_per_token(
    head: HeadConfig, hidden: Tensor, targets: Tensor, outputs: tuple[str, ...]
) -> HeadOutput:
    """Per-token ``logprobs``/``lse``/``entropy`` with `BlockedLogProbs` on the valid positions only.

    Args:
        head: weight ``[V, D]`` and bias in their own dtypes, chunk size (a block takes about one chunk's
            memory, `vocab_block_size`), ``ignore_index``, ``accum_dtype``.
        hidden: ``[..., D]`` hidden states in the operand dtype.
        targets: ``[...]`` token ids (``ignore_index`` where none).
        outputs: the requested outputs (the entropy is computed only when asked).

    Returns:
        A `HeadOutput` whose requested fields are shaped like ``targets``, 0 at ignored positions.
    """
    valid, h, y = valid_tokens(hidden, targets, head.ignore_index)
    logprobs, lse, entropy = _log_probs(head, h, y, with_entropy="entropy" in outputs)
    return scatter_valid({"logprobs": logprobs, "lse": lse, "entropy": entropy}, outputs, valid)


def blocked_weighted_ce(head: HeadConfig, h: Tensor, y: Tensor, token_weights: Tensor | float) -> Tensor:
    """``Σ_t w_t · (−log p_t[y_t])`` over valid tokens ``h [n, D]``, ``y [n]`` from `BlockedLogProbs`'s
    ``logprobs`` (the gradients are computed in backward, by vocabulary blocks)."""
    logprobs, _, _ = _log_probs(head, h, y, with_entropy=False)
    if isinstance(token_weights, Tensor):
        return -(token_weights.to(logprobs.dtype) * logprobs).sum()
    return -float(token_weights) * logprobs.sum()


#: The ``blocked`` backend (``auto``'s for weights narrower than the compute dtype, and for per-token
#: outputs).
BLOCKED = register_backend(
    HeadBackend(
        name="blocked",
        outputs=("logprobs", "lse", "entropy"),
        per_token=blocked_per_token,
        fused_ce=blocked_weighted_ce,
        casts_weight_blocks=True,
        description="pure PyTorch, CPU/CUDA, logits by vocabulary blocks: no V x D temporary (4 matmuls)",
    )
)
