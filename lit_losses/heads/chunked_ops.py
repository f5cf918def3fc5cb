"""The per-chunk kernels of the ``chunked`` backend (used by the autograd Functions of
`lit_losses.heads.functions`): logits of one chunk, fused softmax passes, and the projections of a
chunk's logit gradient onto hidden, weight and bias.

Notation for one token: ``z = W h + b`` (logits), ``lse = log Σ_v e^{z_v}``, ``p = softmax(z)``,
``ℓ = z_y − lse`` (log-probability of the target ``y``), ``H = lse − Σ_v p_v z_v = −Σ_v p_v log p_v``
(entropy, computed in the second form: a sum of non-negative terms).
Given upstream gradients ``(g_ℓ, g_lse, g_H)`` the logit gradient is

    ∂/∂z_v = g_ℓ (δ_vy − p_v) + g_lse p_v − g_H p_v (z_v − lse + H)
           = p_v [g_lse − g_ℓ − g_H (log p_v + H)] + g_ℓ δ_vy,

and ``∂/∂h = (∂/∂z) W``, ``∂/∂W = (∂/∂z)ᵀ h``, ``∂/∂b = Σ_t ∂/∂z``.

Without the entropy term ``∂/∂z = c ⊙ p + g_ℓ ⊙ e_y`` with ``c = g_lse − g_ℓ``, so on CPU the per-token
coefficients are folded into the small operands instead of a pass over ``[chunk, V]``:
``∂/∂h = c ⊙ (p W) + g_ℓ ⊙ W_y`` and ``∂/∂W = pᵀ (c ⊙ h) + Σ_t g_ℓ,t e_{y_t} h_tᵀ``. The only element-wise
work per logit is then one fused, in-place ``log_softmax`` in forward (``ℓ`` is read off it and
``lse = z_y − ℓ``) and one fused ``softmax`` in backward (the fast paths: ``log_softmax`` and ``exp``);
``[chunk, V]`` work tensors are allocated once per pass (`LogitScratch`).

With the entropy, ``∂/∂z`` has a term in ``p_v log p_v`` that no folding removes. On CPU chunks of at
least `lit_losses.heads.entropy_kernels.COMPILE_MIN_LOGITS` logits, two compiled kernels read ``log p``
(the in-place ``log_softmax``) once for ``H = −Σ_v p_v log p_v`` and once to write ``∂/∂z`` over it
(`lit_losses.heads.entropy_kernels`). Otherwise the passes are eager: ``p = exp(log p)`` in a second work
tensor, ``H`` read with a blocked row dot (`row_dot`) and ``∂/∂z`` formed in two element-wise passes
(`entropy_logit_grad_`); with two work tensors, a default chunk on CPU holds half the tokens
(`lit_losses.heads.chunked.chunk_size_for`).

Inputs of lower precision (bf16/fp16) accumulate in ``accum_dtype`` (fp32 by default); float64
inputs stay float64 (which is what `torch.autograd.gradcheck` needs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lit_losses.heads import entropy_kernels

if TYPE_CHECKING:
    from lit_losses.heads.backend import ChunkLoss

#: Target size of one chunk of fp32 logits on an accelerator; the chunk's token count is derived from it and
#: V. Measured on an H100 (bf16, N x D x V = 8192 x 4096 x 128256): 1024-token chunks run the plain-CE
#: path 3.5x faster than 130-token ones (64 MiB), whose skinny weight-gradient matmuls starve the tensor
#: cores, for 1.1 GiB more peak memory (benchmarks/RESULTS.md).
DEFAULT_CHUNK_BYTES = 512 * 2**20

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
    and at most `CPU_MAX_CHUNK_TOKENS` tokens on CPU).

    Args:
        n_tokens: tokens to process (a chunk never exceeds them).
        vocab_size: ``V``, the width of a row of logits.
        bytes_per_elem: bytes of work memory per logit (4: one fp32 ``[chunk, V]`` tensor).
        device: where the logits live.

    Returns:
        ``max(16, min(n_tokens, bytes // (V · bytes_per_elem)))`` (and at most 1024 on CPU).

    Example:
        >>> from lit_losses.heads.chunked_ops import default_chunk_size
        >>> default_chunk_size(2048, 128256), default_chunk_size(2048, 128256, device="cuda")
        (261, 1046)
    """
    on_cpu = torch.device(device).type == "cpu"
    rows = (CPU_CHUNK_BYTES if on_cpu else DEFAULT_CHUNK_BYTES) // max(1, vocab_size * bytes_per_elem)
    if on_cpu:
        rows = min(rows, CPU_MAX_CHUNK_TOKENS)
    return int(max(16, min(max(n_tokens, 1), rows)))


def token_chunks(n_tokens: int, chunk_size: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each chunk of ``chunk_size`` consecutive tokens out of ``n_tokens`` (the last one
    shorter).

    Example:
        >>> list(token_chunks(5, 2))
        [(0, 2), (2, 4), (4, 5)]
    """
    for start in range(0, n_tokens, chunk_size):
        yield start, min(start + chunk_size, n_tokens)


class WorkTensors:
    """Named work tensors of one pass over a head's chunks or blocks, each allocated at its first (largest)
    request and reused: a fresh allocation of a ``[chunk, V]`` tensor costs page faults at every chunk
    (measured on CPU: ~40 ms per 128 MiB chunk, 10-15 % of the per-token head)."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device
        self._tensors: dict[str, Tensor] = {}

    def reused(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> Tensor:
        """Work tensor ``name``: the one allocated before when its first dimension holds ``shape[0]``,
        else a new ``shape`` tensor (kept for the next requests), in ``dtype`` (default: the passes')."""
        dtype = dtype or self.dtype
        t = self._tensors.get(name)
        if t is None or t.shape[0] < shape[0] or t.dtype != dtype:
            t = self._tensors[name] = torch.empty(shape, dtype=dtype, device=self.device)
        return t


class LogitScratch(WorkTensors):
    """``[chunk, V]`` work tensors of one pass over the token chunks (`WorkTensors`), allocated at the first
    (largest) chunk."""

    def __init__(self, vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(dtype, device)
        self.vocab_size = vocab_size

    def take(self, name: str, rows: int) -> Tensor:
        """The first ``rows`` rows of work tensor ``name`` (contiguous).

        A work tensor has one spare row, so every chunk is a proper part of it. ``torch.compile`` traces a
        view together with its base and gives equal sizes one symbol ("duck sizing"): a chunk as tall as
        its work tensor and one shorter would be two kinds of input, the second built again and tuned for
        the last chunk's height. With the spare row the compiled entropy kernels (`entropy_kernels`) are
        built once per process, from its first call's first chunk, and every later chunk reuses that build.
        """
        return self.reused(name, (rows + 1, self.vocab_size))[:rows]

    def logits(self, h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """``h Wᵀ + b`` in the accumulation dtype, in work tensor ``"logits"`` or not (`logits_product`); the
        bias is added by the matmul itself when the operands are in that dtype."""
        out = functools.partial(self.take, "logits", h.shape[0])
        if bias is not None and h.dtype == self.dtype:
            return torch.addmm(bias, h, weight.t(), out=out())
        z = logits_product(h, weight.t(), self.dtype, out=out)
        return z if bias is None else z.add_(bias)


def logits_product(h: Tensor, weight_t: Tensor, dtype: torch.dtype, out: Callable[[], Tensor]) -> Tensor:
    """``h @ weight_t`` in ``dtype`` (the logits of a chunk or a block), written into ``out()``, a reused
    work tensor — by the matmul for operands in ``dtype``, as the cast of the product for narrower ones on
    CPU — or, for narrower operands on CUDA (bf16), the matmul's own output: a copy into the work tensor
    would cost a pass, and CUDA's caching allocator reuses the memory without page faults."""
    if h.dtype == dtype:
        return torch.mm(h, weight_t, out=out())
    if h.is_cuda:
        return mm_in(h, weight_t, dtype)
    return out().copy_(mm_in(h, weight_t, dtype))


def mm_in(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """``a @ b`` of low-precision operands as a ``dtype`` tensor: on CUDA the product is not rounded to the
    operands' dtype (``torch.mm(..., out_dtype=...)``, cuBLAS accumulates in fp32); elsewhere, on a
    PyTorch without ``out_dtype``, or where autograd records the product, it is computed in the operands'
    dtype and cast.

    Example:
        >>> a, b = torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(3, 4, dtype=torch.bfloat16)
        >>> mm_in(a, b, torch.float32).dtype, float(mm_in(a, b, torch.float32)[0, 0])
        (torch.float32, 3.0)
    """
    if a.dtype == dtype:
        return torch.mm(a, b)
    if a.is_cuda and _widening(a, b, dtype) and not _recorded(a, b):
        product = _out_dtype_product("mm", lambda: torch.mm(a, b, out_dtype=dtype))
        if product is not None:
            return product
    return torch.mm(a, b).to(dtype)


#: The ``out_dtype`` products that raised in this process, not tried again: ``mm`` before PyTorch 2.8,
#: ``addmm`` into an fp32 ``out`` of bf16/fp16 operands before 2.10 (it wanted ``out``'s dtype to be the
#: operands'), or a dtype cuBLAS lacks.
_NO_OUT_DTYPE: set[str] = set()


def _out_dtype_product(name: str, call: Callable[[], Tensor]) -> Tensor | None:
    """``call()``, or ``None`` once the ``out_dtype`` product ``name`` has raised (it is then not tried
    again; running out of memory is raised as it is)."""
    if name in _NO_OUT_DTYPE:
        return None
    try:
        return call()
    except torch.cuda.OutOfMemoryError:
        raise
    except (TypeError, RuntimeError, NotImplementedError):
        _NO_OUT_DTYPE.add(name)
        return None


def _recorded(a: Tensor, b: Tensor) -> bool:
    """Whether autograd records a product of ``a`` and ``b`` (the ``out_dtype`` products have no
    derivative: the kernels run them without one)."""
    return torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)


def _widening(a: Tensor, b: Tensor, dtype: torch.dtype) -> bool:
    """Whether ``a @ b`` is a product of bf16/fp16 operands into fp32 (cuBLAS's ``out_dtype`` products)."""
    return dtype == torch.float32 and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)


def matmul_into(out: Tensor, a: Tensor, b: Tensor, accumulate: bool = False) -> Tensor:
    """``out = a @ b``, or ``out += a @ b`` with ``accumulate``, the product accumulated in ``out.dtype``.

    Operands in ``out``'s dtype take one matmul into ``out``. Narrower operands (bf16 into an fp32 ``out``)
    take, on CUDA, one cuBLAS call that accumulates in fp32 and writes or adds into ``out``
    (``torch.mm``/``torch.addmm`` with ``out_dtype``): no product-sized temporary and no extra pass over
    ``out`` (for the ``V × D`` gradient accumulator of a token chunk, a temporary of its size; the adding
    call needs PyTorch 2.10). Elsewhere, or on a PyTorch without them, the product `mm_in` is copied or
    added.

    Returns:
        ``out``.

    Example:
        >>> out = torch.ones(2, 4)
        >>> a, b = torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(3, 4, dtype=torch.bfloat16)
        >>> matmul_into(out, a, b, accumulate=True)[0, 0].item(), matmul_into(out, a, b)[0, 0].item()
        (4.0, 3.0)
    """
    if a.dtype == out.dtype and b.dtype == out.dtype:
        return out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
    if out.is_cuda and _widening(a, b, out.dtype) and not _recorded(a, b):
        if accumulate:
            done = _out_dtype_product("addmm", lambda: torch.addmm(out, a, b, out_dtype=out.dtype, out=out))
        else:
            done = _out_dtype_product("mm_out", lambda: torch.mm(a, b, out_dtype=out.dtype, out=out))
        if done is not None:
            return done
    product = mm_in(a, b, out.dtype)
    return out.add_(product) if accumulate else out.copy_(product)


def accumulation_dtype(x: Tensor, accum_dtype: torch.dtype) -> torch.dtype:
    """The dtype logits and gradients of ``x``'s chunks accumulate in: ``promote(x.dtype, accum_dtype)``."""
    return torch.promote_types(x.dtype, accum_dtype)


Grads = tuple[Tensor | None, Tensor | None, Tensor | None]
"""``(∂/∂hidden of the chunk, ∂/∂weight, ∂/∂bias)``, ``None`` where not needed."""


def gradient_buffers(
    hidden: Tensor, weight: Tensor, acc: torch.dtype, need_h: bool, need_w: bool, need_b: bool
) -> Grads:
    """``(∂/∂hidden, ∂/∂weight, ∂/∂bias)`` buffers, ``None`` where not needed: ``∂/∂hidden`` is written
    chunk by chunk (empty), the others accumulate over chunks in ``acc`` (zeros)."""
    grad_h = torch.empty_like(hidden) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
    grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
    return grad_h, grad_w, grad_b


def input_gradient_buffers(
    ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, acc: torch.dtype
) -> Grads:
    """`gradient_buffers` for an autograd Function whose first three inputs are ``(hidden, weight, bias)``:
    a buffer for each of them that ``ctx.needs_input_grad`` asks for (none for an absent bias).

    Example:
        >>> from types import SimpleNamespace
        >>> ctx = SimpleNamespace(needs_input_grad=(False, True, True, False))
        >>> hidden, weight = torch.ones(2, 4), torch.ones(8, 4)
        >>> grads = input_gradient_buffers(ctx, hidden, weight, bias=None, acc=torch.float64)
        >>> grads[0], grads[1].dtype, grads[1].shape, grads[2]
        (None, torch.float64, torch.Size([8, 4]), None)
    """
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    return gradient_buffers(
        hidden, weight, acc, need_h=need_h, need_w=need_w, need_b=need_b and bias is not None
    )


def gradients_in_param_dtypes(grads: Grads, weight: Tensor, bias: Tensor | None) -> Grads:
    """``(∂/∂hidden, ∂/∂weight, ∂/∂bias)`` with the weight's and the bias's gradients, accumulated in the
    compute dtype, cast to the weight's and the bias's dtypes (``∂/∂hidden`` as it is; ``None`` stays).

    Example:
        >>> weight, bias = torch.ones(8, 4, dtype=torch.bfloat16), torch.ones(8, dtype=torch.float16)
        >>> grads = (torch.zeros(2, 4), torch.zeros(8, 4), torch.zeros(8))
        >>> [g.dtype for g in gradients_in_param_dtypes(grads, weight, bias)]
        [torch.float32, torch.bfloat16, torch.float16]
    """
    grad_h, grad_w, grad_b = grads
    grad_w = None if grad_w is None else grad_w.to(weight.dtype)
    grad_b = None if grad_b is None else grad_b.to(bias.dtype)
    return grad_h, grad_w, grad_b


def backprop_chunk(
    dz: Tensor, targets: Tensor, g_target: Tensor, h: Tensor, weight: Tensor, grads: Grads
) -> None:
    """Project one chunk's logit gradient ``dz + g_target ⊙ e_y`` (formed over ``dz``) onto ``grads``."""
    grad_h, grad_w, grad_b = grads
    dz[torch.arange(dz.shape[0], device=dz.device), targets] += g_target
    dz_in = dz if dz.dtype == h.dtype else dz.to(h.dtype)
    if grad_h is not None:
        torch.mm(dz_in, weight, out=grad_h)
    if grad_w is not None:
        matmul_into(grad_w, dz_in.t(), h, accumulate=True)
    if grad_b is not None:
        grad_b += dz.sum(0)


def softmax_(z: Tensor, log: bool = False) -> Tensor:
    """``softmax`` (or ``log softmax``) of the rows of ``z``: one fused pass per row, written over ``z``
    on CPU."""
    fn = torch.log_softmax if log else torch.softmax
    return fn(z, 1, out=z) if z.device.type == "cpu" else fn(z, 1)


def target_log_probs_(z: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(ℓ, lse, log p)`` of one chunk of logits ``z``, which is overwritten by ``log p`` on CPU.

    ``ℓ`` is read off the fused ``log_softmax`` and ``lse = z_y − ℓ``.
    """
    rows = torch.arange(z.shape[0], device=z.device)
    z_target = z[rows, targets]
    log_p = softmax_(z, log=True)
    logprobs = log_p[rows, targets]
    return logprobs, z_target - logprobs, log_p


#: Columns per block of `row_dot` (measured at ``[1024, 32768]`` fp32 on 2 cores: 64 is the fastest of
#: 32-512, 12 ms against 57 ms for ``vecdot``).
ROW_DOT_BLOCK = 64


def row_dot(a: Tensor, b: Tensor) -> Tensor:
    """``Σ_v a_tv b_tv`` for each row ``t`` of two ``[n, V]`` tensors.

    On CPU, as batched products of `ROW_DOT_BLOCK` columns summed per row: one read of each operand and no
    ``[n, V]`` temporary (``vecdot`` forms ``a ⊙ b`` first), the blocks bounding the rounding of the
    sequential sums. Elsewhere, or when ``V`` is not a multiple of the block, ``vecdot``.

    Example:
        >>> a, b = torch.rand(3, 512, dtype=torch.float64), torch.rand(3, 512, dtype=torch.float64)
        >>> torch.allclose(row_dot(a, b), (a * b).sum(1))
        True
    """
    n, V = a.shape
    blocked = a.device.type == "cpu" and n and V and V % ROW_DOT_BLOCK == 0
    blocked = blocked and a.is_contiguous() and b.is_contiguous()
    if not blocked:
        return torch.linalg.vecdot(a, b, dim=1)
    return torch.bmm(a.view(-1, 1, ROW_DOT_BLOCK), b.view(-1, ROW_DOT_BLOCK, 1)).view(n, -1).sum(1)


def entropy_kernels_for(hidden: Tensor, weight: Tensor, chunk_size: int) -> bool:
    """Whether one call's entropy passes take the compiled kernels (`entropy_kernels`): decided once for
    all its chunks, from the first, largest one."""
    rows = min(hidden.shape[0], chunk_size)
    return entropy_kernels.use_compiled_entropy_kernels(hidden.device, rows, weight.shape[0])


def probs_and_entropy(log_p: Tensor, scratch: LogitScratch, compiled: bool) -> tuple[Tensor | None, Tensor]:
    """``(p, H)`` of one chunk, ``H = −Σ_v p_v log p_v`` (a sum of non-negative terms).

    ``compiled``: one fused read of ``log p`` (`entropy_kernels`) and ``p`` is not formed (``None``).
    Otherwise ``p = exp(log p)`` is written into work tensor ``"probs"`` and ``H`` read with `row_dot`.
    """
    if compiled and (entropy := entropy_kernels.entropy(log_p)) is not None:
        return None, entropy
    p = torch.exp(log_p, out=scratch.take("probs", log_p.shape[0]))
    return p, -row_dot(p, log_p)


def entropy_logit_grad_(
    log_p: Tensor,
    p: Tensor | None,
    coef: Tensor,
    g_ent: Tensor,
    entropy: Tensor,
    scratch: LogitScratch,
    compiled: bool,
) -> Tensor:
    """``∂/∂z`` without its target term, ``p ⊙ [coef − g_H (log p + H)]``, written over ``log_p``.

    ``compiled`` (and ``p`` not formed): one fused read-write of ``log p`` (`entropy_kernels`).
    Otherwise, or if that kernel cannot run, two eager passes (``addcmul`` then ``mul``) with
    ``p = exp(log p)``, formed in work tensor ``"probs"`` when not given.
    """
    a = coef - g_ent * entropy
    if p is None and compiled and (dz := entropy_kernels.entropy_logit_grad_(log_p, a, -g_ent)) is not None:
        return dz
    if p is None:
        p = torch.exp(log_p, out=scratch.take("probs", log_p.shape[0]))
    return torch.addcmul(a[:, None], log_p, -g_ent[:, None], out=log_p).mul_(p)


def backprop_probs(
    p: Tensor, coef: Tensor, targets: Tensor, g_target: Tensor, h: Tensor, weight: Tensor, grads: Grads
) -> None:
    """Project ``∂/∂z = coef ⊙ p + g_target ⊙ e_y`` of one chunk; ``p`` may be overwritten.

    On CPU with operands in one dtype the coefficients are folded into the ``O(chunk · D)`` operands
    (this module's docstring); elsewhere ``∂/∂z`` is formed in place of ``p`` (deterministic on CUDA, and
    low-precision inputs keep fp32 logit gradients).
    """
    if p.device.type != "cpu" or not (p.dtype == h.dtype == weight.dtype):
        backprop_chunk(p.mul_(coef[:, None]), targets, g_target, h=h, weight=weight, grads=grads)
        return
    grad_h, grad_w, grad_b = grads
    if grad_h is not None:
        torch.mm(p, weight, out=grad_h)
        grad_h.mul_(coef[:, None]).add_(weight[targets] * g_target[:, None])
    if grad_w is not None:
        grad_w.addmm_(p.t(), h * coef[:, None])
        grad_w.index_add_(0, targets, h * g_target[:, None])
    if grad_b is not None:
        grad_b.addmv_(p.t(), coef)
        grad_b.index_add_(0, targets, g_target)


def save_gradients(ctx: Any, grads: Grads, weight: Tensor, bias: Tensor | None, *inputs: Any) -> None:
    """Keep the gradients a fast path computed in forward (backward only rescales them), and ``inputs``
    for the differentiable recompute of a double backward (`differentiable_grads`)."""
    ctx.fused_grads = grads
    ctx.save_for_backward(*inputs)
    ctx.weight_dtype = weight.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def scaled_gradients(ctx: Any, g_loss: Tensor, consume: bool = False) -> Grads | None:
    """The saved ``(∂/∂hidden, ∂/∂weight, ∂/∂bias)`` times the upstream scalar, in the inputs' dtypes.

    ``consume``: scale the saved buffers in place and hand them out (the context lets go of them), so that
    a ``V × D`` gradient in the weight's dtype is not copied, and autograd can take it as ``weight.grad``
    as it is; a later backward through the same graph (``retain_graph=True``) gets ``None`` and must
    recompute. Otherwise the buffers are kept and the scaled gradients are new tensors.
    """
    grads = ctx.fused_grads
    if grads is None:
        return None
    if consume:
        ctx.fused_grads = None
    dtypes = (None, ctx.weight_dtype, ctx.bias_dtype)
    out = []
    for grad, need, dtype in zip(grads, ctx.needs_input_grad[:3], dtypes, strict=True):
        if not need or grad is None:
            out.append(None)
            continue
        scale = g_loss.to(grad.dtype)
        grad = grad.mul_(scale) if consume else grad * scale
        out.append(grad if dtype is None else grad.to(dtype))
    return tuple(out)


def differentiable_grads(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    g_lp: Tensor | None,
    g_lse: Tensor | None,
    g_ent: Tensor | None,
    chunk_size: int,
    accum_dtype: torch.dtype,
    needs: tuple[bool, bool, bool],
) -> Grads:
    """``(∂/∂hidden, ∂/∂weight, ∂/∂bias)`` of ``Σ_t g_ℓ,t ℓ_t + g_lse,t lse_t + g_H,t H_t`` computed chunk by
    chunk with differentiable operations only (the module docstring's ``∂/∂z``), ``None`` where ``needs``
    is False.

    This is the backward of a double backward (``create_graph=True``): autograd records it, so the
    gradients are differentiable again, exactly, with respect to the inputs and the upstream gradients.
    The graph keeps each chunk's logits until it is freed (the price of a second derivative).
    """
    acc = accumulation_dtype(hidden, accum_dtype)
    n, V = hidden.shape[0], weight.shape[0]
    w = weight.to(acc)
    b = None if bias is None else bias.to(acc)
    zeros = hidden.new_zeros(n, dtype=acc)
    g_lp = zeros if g_lp is None else g_lp.to(acc)
    g_lse = zeros if g_lse is None else g_lse.to(acc)
    parts: list[Tensor] = []
    grad_w = weight.new_zeros(weight.shape, dtype=acc) if needs[1] else None
    grad_b = weight.new_zeros(V, dtype=acc) if needs[2] and bias is not None else None
    for s, e in token_chunks(n, chunk_size):
        h = hidden[s:e].to(acc)
        log_p = torch.log_softmax(torch.nn.functional.linear(h, w, b), dim=1)
        p = log_p.exp()
        dz = p * (g_lse[s:e] - g_lp[s:e])[:, None]
        if g_ent is not None:
            entropy = -(p * log_p).sum(1, keepdim=True)
            dz = dz - g_ent[s:e, None].to(acc) * p * (log_p + entropy)
        rows = torch.arange(e - s, device=dz.device)
        dz = dz.index_put((rows, targets[s:e]), g_lp[s:e], accumulate=True)
        if needs[0]:
            parts.append(dz @ w)
        if grad_w is not None:
            grad_w = grad_w + dz.t() @ h
        if grad_b is not None:
            grad_b = grad_b + dz.sum(0)
    grad_h = None
    if needs[0]:
        grad_h = torch.cat(parts) if parts else hidden.new_zeros(hidden.shape, dtype=acc)
        grad_h = grad_h.to(hidden.dtype)
    return gradients_in_param_dtypes((grad_h, grad_w, grad_b), weight, bias)


def recomputed_grads(
    ctx: Any, upstream: tuple[Tensor | None, Tensor | None, Tensor | None], chunk_size: int
) -> Grads:
    """`differentiable_grads` in the double backward of an autograd Function that saved
    ``(hidden, weight, bias, targets, ...)`` first: ``upstream = (g_ℓ, g_lse, g_H)``, the accumulation
    dtype read from ``ctx.accum_dtype``, the inputs that need a gradient from ``ctx.needs_input_grad``
    (its first three: hidden, weight, bias)."""
    hidden, weight, bias, targets = ctx.saved_tensors[:4]
    g_lp, g_lse, g_ent = upstream
    return differentiable_grads(
        hidden,
        weight,
        bias,
        targets=targets,
        g_lp=g_lp,
        g_lse=g_lse,
        g_ent=g_ent,
        chunk_size=chunk_size,
        accum_dtype=ctx.accum_dtype,
        needs=ctx.needs_input_grad[:3],
    )


def chunk_loss_grads(
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
