"""The per-block kernels of the ``blocked`` backend: the head computed over blocks of the vocabulary, each
``[n, V_b]`` block of logits holding every token, so that each block of the weight's gradient is finished
in one matmul and written once, in the weight's own dtype.

Notation of `lit_losses.heads.chunked_ops` (``z = W h + b``, ``lse``, ``p``, ``ℓ``, ``H``). Forward reads
the vocabulary block by block and keeps per token, online (rescaled when the running maximum ``m`` grows),

    s = Σ_v e^{z_v − m},   t = Σ_v e^{z_v − m} (z_v − m) ≤ 0,   z_y,

so that ``lse = m + log s``, ``ℓ = z_y − lse`` and ``H = log s − t / s``: a sum of two non-negative terms
(``−Σ_v p_v log p_v = log s − Σ_v p_v (z_v − m)``), without cancellation on near-one-hot rows. Backward
recomputes each block's logits, forms ``∂/∂z = p ⊙ [g_lse − g_ℓ − g_H (log p + H)] + g_ℓ e_y`` over them
and projects it: ``∂/∂h += (∂/∂z) W_b`` (an ``[n, D]`` accumulator in the compute dtype),
``∂/∂W_b = (∂/∂z)ᵀ h`` (complete: every token is in the block; accumulated by the matmul and stored once
in the weight's dtype) and ``∂/∂b_b = Σ_t ∂/∂z``.

The weight and bias are read in their own dtype and each block is cast to the operand dtype (the hidden
states') as it is used, so a bf16 weight costs neither an fp32 copy of itself nor an fp32 ``V × D``
gradient accumulator: the head's memory above its inputs is the weight's gradient, one block of logits
(with the block's cast weight and its gradient) and ``O(n · D)`` state. For bf16 operands, where the
compiled kernels run and no bias gradient is asked, the backward writes each block's logit gradient
straight in bf16 from fp32 logits recomputed a quarter of the tokens at a time (`cast_logit_grad`): 3 bytes
per logit of the block instead of 6. The price is one more ``N·D·V`` matmul on the plain cross-entropy
(four against the token-chunked fast path's three, which computes every gradient in forward but
accumulates the weight's gradient over chunks); the per-token outputs take four either way. With
``matmul_precision="low_logits"`` the logits themselves are written in bf16 (rounded as a bf16
``nn.Linear`` writes them), their statistics and gradient computed in fp32 from there by the compiled
kernels and the gradient written over them: 2 bytes per logit.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import Tensor

from lit_losses.heads import entropy_kernels
from lit_losses.heads.chunked_ops import (
    Grads,
    WorkTensors,
    default_chunk_size,
    logits_product,
    matmul_into,
    mm_in,
    row_dot,
    token_chunks,
)


class BlockScratch(WorkTensors):
    """``[n, V_b]`` work tensors of one pass over the vocabulary blocks (`WorkTensors`), allocated at the
    first (widest) block, each block a contiguous view of the first ``n · V_b`` elements; the logits in
    ``logits_dtype`` (default: the passes' dtype; the operands' for ``matmul_precision="low_logits"``)."""

    def __init__(
        self, n_tokens: int, dtype: torch.dtype, device: torch.device, logits_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(dtype, device)
        self.n_tokens = n_tokens
        self.logits_dtype = logits_dtype or dtype

    def take(self, name: str, columns: int, dtype: torch.dtype | None = None) -> Tensor:
        """Work tensor ``name`` as a contiguous ``[n, columns]`` tensor in ``dtype`` (or the passes')."""
        size = self.n_tokens * columns
        return self.reused(name, (size,), dtype=dtype)[:size].view(self.n_tokens, columns)


#: A block of at least this many vocabulary rows has a multiple of it. Its ``[n, V_b]`` logits are a matmul's
#: output and the next matmuls' operand, whose rows must start at aligned addresses for the fast tensor-core
#: kernels: measured on an H200 (bf16, n = 8192, D = 4096), blocks of 8187 rows took cuBLAS to Ampere-era
#: kernels at 290 TFLOP/s, 2.7x slower than the full head's matmuls (`benchmarks/RESULTS.md`).
BLOCK_ALIGN = 128


def vocab_block_size(n_tokens: int, vocab_size: int, hidden_size: int, chunk_size: int | None, device) -> int:
    """Vocabulary rows per block, so that a block takes about one token chunk's memory.

    A block holds ``[n, V_b]`` logits and, beside them, ``[V_b, D]`` for the cast weight block and its
    gradient: ``V_b = chunk · V / (n + 2 D)`` with ``chunk`` the head's ``chunk_size`` (default:
    `default_chunk_size`).

    Args:
        n_tokens: tokens of the call (every block holds all of them).
        vocab_size: ``V``.
        hidden_size: ``D``.
        chunk_size: the head's tokens per chunk, or ``None``.
        device: where the logits live.

    Returns:
        At least 16 rows (or ``V`` when smaller), at most ``V``; rounded down to a multiple of
        `BLOCK_ALIGN` when at least that.

    Example:
        >>> from lit_losses.heads.vocab_blocks import vocab_block_size
        >>> vocab_block_size(1024, 65536, 1024, 256, "cpu")  # a chunk of 256 tokens: 64 MiB of fp32
        5376
    """
    chunk = chunk_size or default_chunk_size(n_tokens, vocab_size, device=device)
    rows = chunk * vocab_size // max(1, n_tokens + 2 * hidden_size)
    if rows >= BLOCK_ALIGN:
        rows -= rows % BLOCK_ALIGN
    return int(min(vocab_size, max(16, rows)))


def block_logits(
    h: Tensor, weight: Tensor, bias: Tensor | None, span: tuple[int, int], scratch: BlockScratch
) -> tuple[Tensor, Tensor]:
    """``(z, W_b)``: the logits ``h W_bᵀ + b_b`` of vocabulary rows ``span`` in the scratch's logits dtype,
    and the weight block in ``h``'s (operand) dtype (where the logits are written: `logits_product`)."""
    v0, v1 = span
    w_blk = weight[v0:v1].to(h.dtype)
    dtype = scratch.logits_dtype
    out = functools.partial(scratch.take, "logits", v1 - v0, dtype)
    if bias is not None and dtype == h.dtype:  # rounded once, bias included, as nn.Linear's addmm does
        return torch.addmm(bias[v0:v1].to(dtype), h, w_blk.t(), out=out()), w_blk
    z = logits_product(h, w_blk.t(), dtype, out=out)
    if bias is not None:
        z.add_(bias[v0:v1].to(z.dtype))
    return z, w_blk


def _targets_in(targets: Tensor, span: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """``(inside, columns)``: whether each token's target is in vocabulary rows ``span``, and its column in
    the block (clamped into it where it is not; no host synchronization)."""
    v0, v1 = span
    inside = (targets >= v0) & (targets < v1)
    return inside, (targets - v0).clamp(0, v1 - v0 - 1)[:, None]


def _shifted(m: Tensor, s: Tensor, t: Tensor | None, m_new: Tensor) -> tuple[Tensor, Tensor | None]:
    """``(s, t)`` of sums taken relative to ``m``, re-expressed relative to ``m_new ≥ m``:
    ``e^{z − m_new} = c · e^{z − m}`` and ``z − m_new = (z − m) + (m − m_new)``, ``c = e^{m − m_new}``."""
    c = torch.exp(m - m_new)
    t = None if t is None else c * (t + (m - m_new) * s)
    return c * s, t


class OnlineSoftmax:
    """Per-token running ``(m, s, t, z_y)`` over vocabulary blocks (the module docstring)."""

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device, with_entropy: bool) -> None:
        self.with_entropy = with_entropy
        self.m: Tensor | None = None
        self.s = torch.zeros(n, dtype=dtype, device=device)
        self.t: Tensor | None = None
        self.z_target = torch.zeros(n, dtype=dtype, device=device)

    def update_(
        self, z: Tensor, targets: Tensor, span: tuple[int, int], scratch: BlockScratch, compiled: bool
    ) -> None:
        """Fold one block of logits in (``z`` may be overwritten); ``compiled``: in one fused read
        (`entropy_kernels.block_softmax_stats`) when it runs."""
        inside, cols = _targets_in(targets, span)
        self.z_target = torch.where(inside, z.gather(1, cols)[:, 0], self.z_target)
        stats = entropy_kernels.block_softmax_stats(z, self.with_entropy) if compiled else None
        if stats is not None:  # fp32 from bf16 logits; the state's dtype (a bf16 accumulation's too)
            stats = tuple(stat.to(self.s.dtype) for stat in stats)
        m_b, s_b, t_b = (*stats, None)[:3] if stats is not None else self._eager_stats(z, scratch)
        if self.m is None:
            self.m = m_b
            self.s = s_b
            self.t = t_b
            return
        m_new = torch.maximum(self.m, m_b)
        s_old, t_old = _shifted(self.m, self.s, self.t, m_new=m_new)
        s_b, t_b = _shifted(m_b, s_b, t_b, m_new=m_new)
        self.m = m_new
        self.s = s_old + s_b
        self.t = None if t_b is None else t_old + t_b

    def _eager_stats(self, z: Tensor, scratch: BlockScratch) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(m, s, t)`` of one block relative to its own row maximum (``z`` overwritten; bf16 logits are
        first copied into a work tensor of the statistics' dtype)."""
        z = widened(z, self.s.dtype, scratch)
        m_b = z.amax(1)
        z.sub_(m_b[:, None])
        if not self.with_entropy:
            return m_b, z.exp_().sum(1), None
        e = torch.exp(z, out=scratch.take("probs", z.shape[1]))
        return m_b, e.sum(1), row_dot(e, z)

    def results(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(logprobs, lse, entropy)`` (``entropy`` ``None`` without it)."""
        log_s = self.s.log()
        lse = self.m + log_s
        entropy = None if self.t is None else log_s - self.t / self.s
        return self.z_target - lse, lse, entropy


def blocked_forward(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    with_entropy: bool,
    block: int,
    acc: torch.dtype,
    logits_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(logprobs, lse, entropy)`` of tokens ``h [n, D]`` over vocabulary blocks of ``block`` rows
    (``entropy`` ``None`` unless ``with_entropy``), in ``acc``, from logits written in ``logits_dtype``
    (default ``acc``)."""
    n, vocab = h.shape[0], weight.shape[0]
    state = OnlineSoftmax(n, acc, h.device, with_entropy=with_entropy)
    scratch = BlockScratch(n, acc, h.device, logits_dtype=logits_dtype)
    compiled = entropy_kernels.use_compiled_entropy_kernels(h.device, n, min(block, vocab))
    for v0 in range(0, vocab, block):
        span = (v0, min(v0 + block, vocab))
        # one call per block: its logits are freed before the next block's are made
        _fold_block(
            state, h, weight, bias=bias, targets=targets, span=span, scratch=scratch, compiled=compiled
        )
    return state.results()


def _fold_block(
    state: OnlineSoftmax,
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    span: tuple[int, int],
    scratch: BlockScratch,
    compiled: bool,
) -> None:
    z, _ = block_logits(h, weight, bias, span=span, scratch=scratch)
    state.update_(z, targets, span, scratch=scratch, compiled=compiled)


def blocked_backward(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    stats: tuple[Tensor, Tensor | None],
    upstream: tuple[Tensor, Tensor, Tensor | None],
    block: int,
    needs: tuple[bool, bool, bool],
    logits_dtype: torch.dtype | None = None,
) -> Grads:
    """``(∂/∂h, ∂/∂W, ∂/∂b)`` of ``Σ_t g_ℓ,t ℓ_t + g_lse,t lse_t + g_H,t H_t`` over vocabulary blocks.

    Args:
        h: ``[n, D]`` hidden states in the operand dtype.
        weight: ``[V, D]`` in its own dtype (each block cast to ``h``'s).
        bias: ``[V]`` or ``None``.
        targets: ``[n]`` token ids, all valid.
        stats: ``(lse, H)`` from forward (``H`` ``None`` when ``g_H`` is).
        upstream: ``(g_ℓ, g_lse, g_H)``, each ``[n]`` in the compute dtype (``g_H`` may be ``None``).
        block: vocabulary rows per block.
        needs: which of the three gradients to compute.
        logits_dtype: the dtype the forward wrote the logits in (default: the compute dtype); bf16 logits
            are recomputed in bf16 and overwritten by their gradient.

    Returns:
        ``∂/∂h`` in the compute dtype, ``∂/∂W`` and ``∂/∂b`` in the weight's and bias's dtypes (``None``
        where not needed); each block of ``∂/∂W`` is written once.
    """
    lse, entropy = stats
    g_lp, g_lse, g_ent = upstream
    acc, (n, vocab) = lse.dtype, (h.shape[0], weight.shape[0])
    grad_h = torch.zeros(h.shape, dtype=acc, device=h.device) if needs[0] else None
    grad_w = torch.empty_like(weight) if needs[1] else None
    grad_b = torch.empty_like(bias) if needs[2] and bias is not None else None
    coef = g_lse - g_lp
    a = coef if g_ent is None else coef - g_ent * entropy
    b = None if g_ent is None else -g_ent
    scratch = BlockScratch(n, acc, h.device, logits_dtype=logits_dtype)
    compiled = entropy_kernels.use_compiled_entropy_kernels(h.device, n, min(block, vocab))
    # bf16 operands take the gradient straight in bf16 from fp32 logits, unless the bias needs its fp32
    # column sums (bf16 logits take it in place)
    wide_logits = scratch.logits_dtype == acc and acc != torch.bfloat16
    cast_in_kernel = compiled and h.dtype == torch.bfloat16 and wide_logits and grad_b is None
    for v0 in range(0, vocab, block):
        # one call per block: its logits and their gradient are freed before the next block's are made
        _backprop_block(
            h,
            weight,
            bias,
            targets=targets,
            span=(v0, min(v0 + block, vocab)),
            coefficients=(lse, a, b, g_lp),
            kernel="cast" if cast_in_kernel else "in_place" if compiled else None,
            scratch=scratch,
            grads=(grad_h, grad_w, grad_b),
        )
    return grad_h, grad_w, grad_b


def _backprop_block(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    span: tuple[int, int],
    coefficients: tuple[Tensor, Tensor, Tensor | None, Tensor],
    kernel: Literal["cast", "in_place"] | None,
    scratch: BlockScratch,
    grads: Grads,
) -> None:
    """One block of `blocked_backward`: its logits, their gradient ``p ⊙ (a + b ⊙ log p) + g_ℓ e_y`` (by the
    compiled ``kernel``, written in the operand dtype or over the logits, or by the eager passes), projected
    onto ``grads``. ``coefficients``: ``(lse, a, b, g_ℓ)`` per token (``b`` ``None`` without the entropy)."""
    lse, a, b, g_lp = coefficients
    inside, cols = _targets_in(targets, span)
    g_target = torch.where(inside, g_lp, 0)
    b_or_zeros = b if b is not None or kernel is None else torch.zeros_like(a)
    if kernel == "cast":
        w_blk = weight[span[0] : span[1]].to(h.dtype)
        bias_blk = None if bias is None else bias[span[0] : span[1]]
        dz = cast_logit_grad(h, w_blk, bias_blk, coefficients=(lse, a, b_or_zeros, cols, g_target))
        project_block(dz, h, w_blk, span=span, grads=grads)
        return
    z, w_blk = block_logits(h, weight, bias, span=span, scratch=scratch)
    dz = None
    if kernel == "in_place":
        dz = entropy_kernels.block_logit_grad_(z, lse, a, b=b_or_zeros, cols=cols, g_target=g_target)
    if dz is None:
        dz = _eager_logit_grad_(z, lse, a, b=b, scratch=scratch)
        dz.scatter_add_(1, cols, g_target[:, None])
        if dz.dtype != z.dtype:  # bf16 logits: their gradient written over them, rounded once (as compiled)
            dz = z.copy_(dz)
    project_block(dz, h, w_blk, span=span, grads=grads)


#: The backward of a block whose logit gradient is written straight in bf16 (`cast_logit_grad`) recomputes
#: its fp32 logits in this many slices of its tokens: beside the ``[n, V_b]`` bf16 gradient the matmuls
#: need whole, the fp32 logits then take a quarter of the block (3 bytes per logit instead of 6).
CAST_SLICES = 4


def cast_logit_grad(
    h: Tensor,
    w_blk: Tensor,
    bias_blk: Tensor | None,
    coefficients: tuple[Tensor, Tensor, Tensor, Tensor, Tensor],
) -> Tensor:
    """One block's logit gradient ``p ⊙ (a + b ⊙ log p) + g_ℓ e_y`` in bf16 (the matmuls' operand dtype),
    written by `entropy_kernels.block_logit_grad_bf16_` from fp32 logits made `CAST_SLICES` slices of the
    tokens at a time (each slice a multiple of 8 rows, so that every slice starts 16-byte aligned).

    Args:
        h: ``[n, D]`` bf16 hidden states.
        w_blk: ``[V_b, D]`` bf16 weight block; ``bias_blk``: its ``[V_b]`` bias or ``None``.
        coefficients: ``(lse, a, b, cols, g_target)`` per token (``b`` zeros without the entropy).

    Returns:
        The ``[n, V_b]`` bf16 gradient.
    """
    lse, a, b, cols, g_target = coefficients
    n = h.shape[0]
    dz = torch.empty((n, w_blk.shape[0]), dtype=torch.bfloat16, device=h.device)
    rows = -(-n // CAST_SLICES)
    rows += -rows % 8
    for r0, r1 in token_chunks(n, rows):
        z = mm_in(h[r0:r1], w_blk.t(), lse.dtype)
        if bias_blk is not None:
            z.add_(bias_blk.to(z.dtype))
        rows_of = slice(r0, r1)
        entropy_kernels.block_logit_grad_bf16_(
            dz[rows_of],
            z,
            lse[rows_of],
            a=a[rows_of],
            b=b[rows_of],
            cols=cols[rows_of],
            g_target=g_target[rows_of],
        )
        del z  # one slice's logits at a time
    return dz


def _eager_logit_grad_(z: Tensor, lse: Tensor, a: Tensor, b: Tensor | None, scratch: BlockScratch) -> Tensor:
    """``p ⊙ (a + b ⊙ log p)`` over ``z`` with ``log p = z − lse`` (``b`` ``None``: ``p ⊙ a``), in ``lse``'s
    dtype (bf16 logits are copied into a work tensor of it first); the target term is added by the caller."""
    log_p = widened(z, lse.dtype, scratch).sub_(lse[:, None])
    if b is None:
        return log_p.exp_().mul_(a[:, None])
    p = torch.exp(log_p, out=scratch.take("probs", z.shape[1]))
    return torch.addcmul(a[:, None], log_p, b[:, None], out=log_p).mul_(p)


def widened(z: Tensor, dtype: torch.dtype, scratch: BlockScratch) -> Tensor:
    """``z`` itself when it is in ``dtype``, else its copy in the scratch's ``"wide"`` work tensor (the eager
    passes over bf16 logits compute in the statistics' dtype)."""
    if z.dtype == dtype:
        return z
    return scratch.take("wide", z.shape[1], dtype).copy_(z)


def project_block(dz: Tensor, h: Tensor, w_blk: Tensor, span: tuple[int, int], grads: Grads) -> None:
    """``∂/∂h += dz W_b``; ``∂/∂W[span] = dzᵀ h`` and ``∂/∂b[span] = Σ_t dz``, each written once (``dz`` in
    the compute dtype, or already in the operand dtype when no bias gradient is asked)."""
    grad_h, grad_w, grad_b = grads
    dz_in = dz if dz.dtype == h.dtype else dz.to(h.dtype)
    if grad_h is not None:
        matmul_into(grad_h, dz_in, w_blk, accumulate=True)
    v0, v1 = span
    if grad_w is not None:
        matmul_into(grad_w[v0:v1], dz_in.t(), h)
    if grad_b is not None:
        grad_b[v0:v1] = dz.sum(0, dtype=torch.promote_types(dz.dtype, torch.float32))
