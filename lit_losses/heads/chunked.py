"""The ``chunked`` backend: a pure-PyTorch fused output head that never materializes ``[N, V]`` logits.

Notation for one token: ``z = W h + b`` (logits), ``lse = log Σ_v e^{z_v}``, ``p = softmax(z)``,
``ℓ = z_y − lse`` (log-probability of the target ``y``), ``H = lse − Σ_v p_v z_v = −Σ_v p_v log p_v``
(entropy, computed in the second form: a sum of non-negative terms).
Given upstream gradients ``(g_ℓ, g_lse, g_H)`` the logit gradient is

    ∂/∂z_v = g_ℓ (δ_vy − p_v) + g_lse p_v − g_H p_v (z_v − lse + H)
           = p_v [g_lse − g_ℓ − g_H (log p_v + H)] + g_ℓ δ_vy,

and ``∂/∂h = (∂/∂z) W``, ``∂/∂W = (∂/∂z)ᵀ h``, ``∂/∂b = Σ_t ∂/∂z``. Forward keeps only ``O(N)`` state
(``H``) besides its inputs and backward recomputes the logits chunk by chunk, folding each token's
upstream gradient into ``∂/∂z`` before the weight-gradient matmul: four ``N·D·V`` matmuls in all, the
fewest an exact per-token head can do without storing ``[N, V]`` (``∂/∂W`` contracts ``p`` over tokens
with the upstream gradient, known only in backward).

Without the entropy term ``∂/∂z = c ⊙ p + g_ℓ ⊙ e_y`` with ``c = g_lse − g_ℓ``, so on CPU the per-token
coefficients are folded into the small operands instead of a pass over ``[chunk, V]``:
``∂/∂h = c ⊙ (p W) + g_ℓ ⊙ W_y`` and ``∂/∂W = pᵀ (c ⊙ h) + Σ_t g_ℓ,t e_{y_t} h_tᵀ``. The only element-wise
work per logit is then one fused, in-place ``log_softmax`` in forward (``ℓ`` is read off it and
``lse = z_y − ℓ``) and one fused ``softmax`` in backward (the fast paths: ``log_softmax`` and ``exp``);
``[chunk, V]`` work tensors are allocated once per pass (`_Scratch`).

`ChunkedWeightedCE` is the plain cross-entropy fast path: when the loss is ``Σ_t w_t (−ℓ_t)`` with
weights known in forward (global denominators), the gradients are computed during forward and
backward only rescales them: three matmuls, no recompute.

Inputs of lower precision (bf16/fp16) accumulate in ``accum_dtype`` (fp32 by default); float64
inputs stay float64 (which is what `torch.autograd.gradcheck` needs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

#: Target size of one chunk of fp32 logits; the chunk's token count is derived from it and V.
DEFAULT_CHUNK_BYTES = 64 * 2**20

#: On CPU, a chunk of about this many bytes: the weight-gradient matmul ``[V, chunk] @ [chunk, D]``
#: needs a long enough inner dimension (measured, 2 cores: 256-512-token chunks are 10-20 % faster
#: than 128 at V = 128256 and 65536).
CPU_CHUNK_BYTES = 128 * 2**20

#: On CPU, at most this many tokens per chunk (measured on the tiny LM, V = 4096: 4096-token chunks
#: are ~20 % slower than 1024).
CPU_MAX_CHUNK_TOKENS = 1024


def default_chunk_size(
    n_tokens: int, vocab_size: int, bytes_per_elem: int = 4, device: torch.device | str = "cpu"
) -> int:
    """Tokens per chunk so that a chunk of logits takes about `DEFAULT_CHUNK_BYTES` (`CPU_CHUNK_BYTES`
    and at most `CPU_MAX_CHUNK_TOKENS` tokens on CPU)."""
    on_cpu = torch.device(device).type == "cpu"
    rows = (CPU_CHUNK_BYTES if on_cpu else DEFAULT_CHUNK_BYTES) // max(1, vocab_size * bytes_per_elem)
    if on_cpu:
        rows = min(rows, CPU_MAX_CHUNK_TOKENS)
    return int(max(16, min(max(n_tokens, 1), rows)))


class _Scratch:
    """``[chunk, V]`` work tensors of one pass over the chunks, allocated at the first (largest) chunk
    and reused: a fresh allocation of that size costs page faults at every chunk (measured on CPU:
    ~40 ms per 128 MiB chunk, 10-15 % of the per-token head)."""

    def __init__(self, vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.vocab_size, self.dtype, self.device = vocab_size, dtype, device
        self._tensors: dict[str, Tensor] = {}

    def take(self, name: str, rows: int) -> Tensor:
        """The first ``rows`` rows of work tensor ``name`` (contiguous)."""
        t = self._tensors.get(name)
        if t is None or t.shape[0] < rows:
            t = self._tensors[name] = torch.empty(rows, self.vocab_size, dtype=self.dtype, device=self.device)
        return t[:rows]

    def logits(self, h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """``h Wᵀ + b`` in the accumulation dtype, written into work tensor ``"logits"``."""
        out = self.take("logits", h.shape[0])
        if h.dtype != out.dtype:
            return out.copy_(torch.nn.functional.linear(h, weight, bias))
        if bias is None:
            return torch.mm(h, weight.t(), out=out)
        return torch.addmm(bias, h, weight.t(), out=out)


def _matmul_into(out: Tensor, a: Tensor, b: Tensor, accumulate: bool) -> None:
    """``out (+)= a @ b`` computed in the operands' dtype and accumulated in ``out.dtype``."""
    if a.dtype == out.dtype and b.dtype == out.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif accumulate:
        out.add_(torch.mm(a, b))
    else:
        out.copy_(torch.mm(a, b))


def _accum_dtype(x: Tensor, accum_dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(x.dtype, accum_dtype)


def _gradient_buffers(
    hidden: Tensor, weight: Tensor, acc: torch.dtype, need_h: bool, need_w: bool, need_b: bool
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(∂/∂hidden, ∂/∂weight, ∂/∂bias)`` buffers, ``None`` where not needed: ``∂/∂hidden`` is written
    chunk by chunk (empty), the others accumulate over chunks in ``acc`` (zeros)."""
    grad_h = torch.empty_like(hidden) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
    grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
    return grad_h, grad_w, grad_b


def _backprop_chunk(
    dz: Tensor,
    targets: Tensor,
    g_target: Tensor,
    h: Tensor,
    weight: Tensor,
    grad_h: Tensor | None,
    grad_w: Tensor | None,
    grad_b: Tensor | None,
) -> None:
    """Project one chunk's logit gradient ``dz + g_target ⊙ e_y`` (formed over ``dz``) onto hidden
    (``grad_h``), weight and bias."""
    dz[torch.arange(dz.shape[0], device=dz.device), targets] += g_target
    dz_in = dz if dz.dtype == h.dtype else dz.to(h.dtype)
    if grad_h is not None:
        torch.mm(dz_in, weight, out=grad_h)
    if grad_w is not None:
        _matmul_into(grad_w, dz_in.t(), h, accumulate=True)
    if grad_b is not None:
        grad_b += dz.sum(0)


def _softmax_(z: Tensor, log: bool = False) -> Tensor:
    """``softmax`` (or ``log softmax``) of the rows of ``z``: one fused pass per row, written over ``z``
    on CPU."""
    fn = torch.log_softmax if log else torch.softmax
    return fn(z, 1, out=z) if z.device.type == "cpu" else fn(z, 1)


def _target_log_probs_(z: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(ℓ, lse, log p)`` of one chunk of logits ``z``, which is overwritten by ``log p`` on CPU.

    ``ℓ`` is read off the fused ``log_softmax`` and ``lse = z_y − ℓ``.
    """
    rows = torch.arange(z.shape[0], device=z.device)
    z_target = z[rows, targets]
    log_p = _softmax_(z, log=True)
    logprobs = log_p[rows, targets]
    return logprobs, z_target - logprobs, log_p


def _probs_and_entropy(log_p: Tensor, out: Tensor) -> tuple[Tensor, Tensor]:
    """``(p, H)`` of one chunk: ``p = exp(log p)`` written into ``out`` and ``H = −Σ_v p_v log p_v``
    (a sum of non-negative terms)."""
    p = torch.exp(log_p, out=out)
    return p, -torch.linalg.vecdot(p, log_p, dim=1)


def _entropy_logit_grad_(log_p: Tensor, p: Tensor, coef: Tensor, g_ent: Tensor, entropy: Tensor) -> Tensor:
    """``∂/∂z`` without its target term: ``p ⊙ [coef − g_H (log p + H)]``, written over ``log_p`` in two
    passes (``addcmul`` then ``mul``)."""
    shift = (coef - g_ent * entropy)[:, None]
    return torch.addcmul(shift, log_p, -g_ent[:, None], out=log_p).mul_(p)


def _backprop_probs(
    p: Tensor,
    coef: Tensor,
    targets: Tensor,
    g_target: Tensor,
    h: Tensor,
    weight: Tensor,
    grad_h: Tensor | None,
    grad_w: Tensor | None,
    grad_b: Tensor | None,
) -> None:
    """Project ``∂/∂z = coef ⊙ p + g_target ⊙ e_y`` of one chunk; ``p`` may be overwritten.

    On CPU with operands in one dtype the coefficients are folded into the ``O(chunk · D)`` operands
    (module docstring); elsewhere ``∂/∂z`` is formed in place of ``p`` (deterministic on CUDA, and
    low-precision inputs keep fp32 logit gradients).
    """
    if p.device.type != "cpu" or not (p.dtype == h.dtype == weight.dtype):
        _backprop_chunk(p.mul_(coef[:, None]), targets, g_target, h, weight, grad_h, grad_w, grad_b)
        return
    if grad_h is not None:
        torch.mm(p, weight, out=grad_h)
        grad_h.mul_(coef[:, None]).add_(weight[targets] * g_target[:, None])
    if grad_w is not None:
        grad_w.addmm_(p.t(), h * coef[:, None])
        grad_w.index_add_(0, targets, h * g_target[:, None])
    if grad_b is not None:
        grad_b.addmv_(p.t(), coef)
        grad_b.index_add_(0, targets, g_target)


def _save_gradients(
    ctx: Any, grad_h: Tensor, grad_w: Tensor, grad_b: Tensor | None, weight: Tensor, bias: Tensor | None
) -> None:
    """Keep the gradients a fast path computed in forward (backward only rescales them)."""
    ctx.save_for_backward(grad_h, grad_w, grad_b)
    ctx.weight_dtype = weight.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _scaled_gradients(ctx: Any, g_loss: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The saved ``(∂/∂hidden, ∂/∂weight, ∂/∂bias)`` times the upstream scalar, in the inputs' dtypes."""
    grad_h, grad_w, grad_b = ctx.saved_tensors
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    gh = grad_h * g_loss.to(grad_h.dtype) if need_h else None
    gw = (grad_w * g_loss).to(ctx.weight_dtype) if need_w else None
    gb = (grad_b * g_loss).to(ctx.bias_dtype) if need_b and grad_b is not None else None
    return gh, gw, gb


class ChunkedLogProbs(torch.autograd.Function):
    """``(hidden [n, D], weight [V, D], bias [V] | None, targets [n]) → (logprobs, lse, entropy) [n]``.

    Every target must be valid (the caller compacts away ignored positions). ``entropy`` is an empty
    tensor unless ``with_entropy``.
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
        acc = _accum_dtype(hidden, accum_dtype)
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=acc)
        lse = hidden.new_empty(n, dtype=acc)
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=acc)
        scratch = _Scratch(weight.shape[0], acc, hidden.device)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            z = scratch.logits(hidden[s:e], weight, bias)
            logprobs[s:e], lse[s:e], log_p = _target_log_probs_(z, targets[s:e])
            if with_entropy:
                _, entropy[s:e] = _probs_and_entropy(log_p, scratch.take("probs", e - s))
        return logprobs, lse, entropy

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        hidden, weight, bias, targets, with_entropy, chunk_size, accum_dtype = inputs
        ctx.save_for_backward(hidden, weight, bias, targets, output[2])
        ctx.with_entropy, ctx.chunk_size, ctx.accum_dtype = with_entropy, chunk_size, accum_dtype
        if not with_entropy:
            ctx.mark_non_differentiable(output[2])

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor | None, g_lse: Tensor | None, g_ent: Tensor | None):
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        acc = _accum_dtype(hidden, ctx.accum_dtype)
        n, chunk = hidden.shape[0], ctx.chunk_size
        zeros = hidden.new_zeros(n, dtype=acc)
        g_lp = zeros if g_lp is None else g_lp.to(acc)
        g_lse = zeros if g_lse is None else g_lse.to(acc)
        use_entropy = ctx.with_entropy and g_ent is not None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h, grad_w, grad_b = _gradient_buffers(hidden, weight, acc, need_h, need_w, need_b)
        scratch = _Scratch(weight.shape[0], acc, hidden.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            h, y, gh = hidden[s:e], targets[s:e], None if grad_h is None else grad_h[s:e]
            z = scratch.logits(h, weight, bias)
            coef = g_lse[s:e] - g_lp[s:e]
            if not use_entropy:
                _backprop_probs(_softmax_(z), coef, y, g_lp[s:e], h, weight, gh, grad_w, grad_b)
                continue
            log_p = _softmax_(z, log=True)
            p = torch.exp(log_p, out=scratch.take("probs", e - s))
            dz = _entropy_logit_grad_(log_p, p, coef, g_ent[s:e].to(acc), entropy[s:e])
            _backprop_chunk(dz, y, g_lp[s:e], h, weight, gh, grad_w, grad_b)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


class ChunkedWeightedCE(torch.autograd.Function):
    """Fast path: ``loss = Σ_t w_t · (−ℓ_t)`` with gradients computed in forward (three matmuls).

    Returns ``(loss, logprobs)``; ``logprobs`` is detached (for logging only). Backward only scales
    the gradients stored in forward by the upstream scalar.
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
        acc = _accum_dtype(hidden, accum_dtype)
        n = hidden.shape[0]
        w_tok = token_weights.to(acc)
        logprobs = hidden.new_empty(n, dtype=acc)
        grad_h, grad_w, grad_b = _gradient_buffers(hidden, weight, acc, True, True, bias is not None)
        scratch = _Scratch(weight.shape[0], acc, hidden.device)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            h, y, w_c = hidden[s:e], targets[s:e], w_tok[s:e]
            z = scratch.logits(h, weight, bias)
            logprobs[s:e], _, log_p = _target_log_probs_(z, y)
            # d(−w ℓ)/dz = w (p − e_y)
            _backprop_probs(log_p.exp_(), w_c, y, -w_c, h, weight, grad_h[s:e], grad_w, grad_b)
        _save_gradients(ctx, grad_h, grad_w, grad_b, weight, bias)
        ctx.mark_non_differentiable(logprobs)
        return -(w_tok * logprobs).sum(), logprobs

    @staticmethod
    def backward(ctx: Any, g_loss: Tensor, _g_logprobs: Tensor | None):
        gh, gw, gb = _scaled_gradients(ctx, g_loss)
        return gh, gw, gb, None, None, None, None


#: ``chunk_loss(start, end, logprobs, lse, entropy) -> loss`` of the valid tokens ``[start, end)``.
ChunkLoss = Any


def _chunk_loss_grads(
    chunk_loss: ChunkLoss, start: int, end: int, values: tuple[Tensor, ...], acc: torch.dtype
) -> tuple[Tensor, list[Tensor]]:
    """``chunk_loss`` of one chunk's per-token values (detached) and its gradient with respect to each
    (zeros where the loss does not depend on one)."""
    leaves = [v.detach().requires_grad_(True) for v in values]
    with torch.enable_grad():
        loss = chunk_loss(start, end, *leaves, *([None] * (3 - len(leaves))))
        grads = [None] * len(leaves)
        if loss.requires_grad:
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = [torch.zeros_like(v) if g is None else g.to(acc) for g, v in zip(grads, leaves, strict=True)]
    return loss.detach().to(acc), grads


class ChunkedPointwiseLoss(torch.autograd.Function):
    """Fast path for losses that are sums of per-token functions of ``(ℓ_t, lse_t, H_t)``.

    ``loss = Σ_chunks chunk_loss(s, e, ℓ[s:e], lse[s:e], H[s:e])``. Each chunk's per-token upstream
    gradients ``(g_ℓ, g_lse, g_H)`` are obtained by autograd on the chunk's ``O(chunk)`` values during
    forward, folded into ``∂/∂z`` (module docstring) and projected at once: three matmuls, no recompute.
    Valid only when a token's loss depends on that token's values alone (pointwise terms).
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
        acc = _accum_dtype(hidden, accum_dtype)
        n = hidden.shape[0]
        grad_h, grad_w, grad_b = _gradient_buffers(hidden, weight, acc, True, True, bias is not None)
        total = hidden.new_zeros((), dtype=acc)
        scratch = _Scratch(weight.shape[0], acc, hidden.device)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            h, y, gh = hidden[s:e], targets[s:e], grad_h[s:e]
            z = scratch.logits(h, weight, bias)
            lp_c, lse_c, log_p = _target_log_probs_(z, y)
            if with_entropy:
                p, ent_c = _probs_and_entropy(log_p, scratch.take("probs", e - s))
                loss_c, (g_lp, g_lse, g_ent) = _chunk_loss_grads(chunk_loss, s, e, (lp_c, lse_c, ent_c), acc)
            else:
                p = log_p.exp_()
                loss_c, (g_lp, g_lse) = _chunk_loss_grads(chunk_loss, s, e, (lp_c, lse_c), acc)
            coef = g_lse - g_lp
            if with_entropy and bool(g_ent.ne(0).any()):
                dz = _entropy_logit_grad_(log_p, p, coef, g_ent, ent_c)
                _backprop_chunk(dz, y, g_lp, h, weight, gh, grad_w, grad_b)
            else:
                _backprop_probs(p, coef, y, g_lp, h, weight, gh, grad_w, grad_b)
            total += loss_c
        _save_gradients(ctx, grad_h, grad_w, grad_b, weight, bias)
        return total

    @staticmethod
    def backward(ctx: Any, g_loss: Tensor):
        gh, gw, gb = _scaled_gradients(ctx, g_loss)
        return gh, gw, gb, None, None, None, None, None
