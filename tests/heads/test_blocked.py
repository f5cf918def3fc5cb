"""The ``blocked`` backend (vocabulary blocks, no ``V × D`` temporary) against the float64 naive head, and
``auto``'s choice between it and the token-chunked ``chunked`` backend."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lit_losses.heads import (
    HEAD_BACKENDS,
    FusedLMHead,
    HeadBackend,
    entropy_kernels,
    linear_cross_entropy,
    linear_logprobs,
    register_backend,
    select_backend,
    vocab_blocks,
)
from lit_losses.heads.chunked_ops import mm_in
from lit_losses.heads.naive import naive_head
from lit_losses.heads.vocab_blocks import BLOCK_ALIGN, blocked_backward, blocked_forward, vocab_block_size

ALL = ("logprobs", "lse", "entropy")


def problem(n=37, d=16, v=101, dtype=torch.float64, bias=True, seed=0, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g, dtype=dtype) * scale).requires_grad_()
    b = (torch.randn(v, generator=g, dtype=dtype) * 0.1).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::5] = -100
    return hidden, weight, b, targets


def values_and_grads(outputs, hidden, weight, bias, targets, upstream):
    values = [getattr(outputs, name) for name in ALL]
    loss = sum((v * u).sum() for v, u in zip(values, upstream, strict=True))
    inputs = [x for x in (hidden, weight, bias) if x is not None]
    return values, torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunk_size", [1, 7, None])
def test_every_output_matches_naive_in_float64(bias, chunk_size, entropy_kernel):
    """Values and gradients to 1e-10 with blocks of 16 rows (7 blocks, the last one narrower), 57, or one,
    with the eager or the compiled element-wise passes."""
    hidden, weight, b, targets = problem(bias=bias)
    upstream = [torch.randn(targets.shape, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    upstream = [u.double() for u in upstream]
    head = FusedLMHead(weight, b, backend="blocked", chunk_size=chunk_size)
    got = values_and_grads(head(hidden, targets, ALL), hidden, weight, b, targets, upstream)
    ref = values_and_grads(naive_head(hidden, weight, b, targets, ALL), hidden, weight, b, targets, upstream)
    for g, r in zip([*got[0], *got[1]], [*ref[0], *ref[1]], strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)
    if entropy_kernel:  # the compiled case: the block kernels ran, forward and backward
        assert {"_block_entropy_stats_kernel", "_block_grad_kernel_"} <= set(entropy_kernel)


def test_gradcheck_float64_small_blocks():
    hidden, weight, b, targets = problem(n=7, d=5, v=40)

    def fn(h, w, bias):
        out = FusedLMHead(w, bias, backend="blocked", chunk_size=1)(h, targets, ALL)
        return out.logprobs, out.lse, out.entropy

    assert torch.autograd.gradcheck(fn, (hidden, weight, b))


def test_double_backward_matches_naive():
    """``create_graph=True`` recomputes with differentiable operations: second derivatives are exact."""
    hidden, weight, b, targets = problem(n=9, d=6, v=50)
    results = []
    for backend in ("blocked", "naive"):
        out = FusedLMHead(weight, b, backend=backend, chunk_size=1)(hidden, targets, ALL)
        loss = (out.logprobs + 0.3 * out.entropy + 0.1 * out.lse.square()).sum()
        (g,) = torch.autograd.grad(loss, hidden, create_graph=True)
        results.append(torch.autograd.grad(g.square().sum(), (hidden, weight, b)))
    for got, ref in zip(*results, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


def test_the_running_maximum_moving_to_a_later_block_rescales_exactly(entropy_kernel):
    """Large logits whose row maximum lies in the last block, near-one-hot rows (H ≈ 1e-20), fp32 against
    float64: the online sums are rescaled across blocks without losing the entropy's small terms."""
    n, d, v = 12, 4, 96
    hidden = torch.zeros(n, d)
    hidden[:, 0] = 1.0
    hidden[:, 1] = torch.linspace(0, 1, n)
    weight = torch.zeros(v, d)
    weight[:, 0] = torch.linspace(-30, 0, v)
    weight[v - 1, 0] = 45.0  # the maximum is in the last block
    weight[:, 1] = torch.linspace(0, 2, v)
    targets = torch.arange(n) * 7
    ref = naive_head(hidden.double(), weight.double(), None, targets, ALL)
    out = FusedLMHead(weight, backend="blocked", chunk_size=1)(hidden, targets, ALL)
    assert (out.entropy >= 0).all() and ref.entropy.max() < 1e-10
    torch.testing.assert_close(out.entropy.double(), ref.entropy, rtol=1e-4, atol=1e-14)
    torch.testing.assert_close(out.logprobs.double(), ref.logprobs, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(out.lse.double(), ref.lse, rtol=1e-6, atol=1e-5)


class LargestFloatOutputs(TorchDispatchMode):
    """The element count of the largest floating-point tensor each op produced, by dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.largest: dict[torch.dtype, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.largest[t.dtype] = max(self.largest.get(t.dtype, 0), t.numel())
        return out


@pytest.mark.parametrize("outputs", ["weighted_ce", "per_token_entropy"])
def test_a_bf16_weight_costs_its_bf16_gradient_and_no_fp32_copy(outputs):
    """``auto`` with a bf16 weight and fp32 compute: no fp32 tensor of ``V × D`` elements (neither a copy
    of the weight nor a gradient accumulator) is formed, and the gradient comes back in bf16, within bf16
    rounding of the float64 head's."""
    n, d, v = 48, 64, 3000
    hidden, weight, _, targets = problem(n=n, d=d, v=v, dtype=torch.float32, bias=False, scale=0.2)
    w16 = weight.detach().bfloat16().requires_grad_()
    with LargestFloatOutputs() as seen:
        if outputs == "weighted_ce":
            loss = linear_cross_entropy(hidden, w16, targets, chunk_size=4)
        else:
            out = linear_logprobs(hidden, w16, targets, outputs=ALL, chunk_size=4)
            loss = -(out.logprobs + 0.1 * out.entropy).sum()
        loss.backward()
    assert seen.largest[torch.float32] < v * d / 4, seen.largest  # blocks of [n, V_b] and [V_b, D] only
    assert w16.grad.dtype == torch.bfloat16
    h64, w64 = hidden.detach().double().requires_grad_(), w16.detach().double().requires_grad_()
    if outputs == "weighted_ce":
        ref = linear_cross_entropy(h64, w64, targets, backend="naive")
    else:
        out = naive_head(h64, w64, None, targets, ALL)
        ref = -(out.logprobs + 0.1 * out.entropy).sum()
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=1e-5, atol=1e-6)
    scale = w64.grad.abs().max()
    torch.testing.assert_close(w16.grad.double() / scale, w64.grad / scale, rtol=0, atol=2**-8)


def head_functions(tensor):
    """Names of the autograd Functions of the head in ``tensor``'s graph."""
    names, stack = set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None:
            names.add(type(node).__name__)
            stack.extend(fn for fn, _ in node.next_functions)
    return names & {"ChunkedLogProbsBackward", "BlockedLogProbsBackward"}


def test_auto_takes_blocked_for_per_token_outputs_on_cpu_and_for_narrow_weights():
    """Per-token outputs on CPU: ``blocked`` for every dtype (measured faster and leaner than ``chunked``
    for an fp32 weight too); the plain CE and the fused pointwise losses keep ``chunked``'s fused paths for
    a weight in the compute dtype, and take ``blocked`` for a narrow one."""
    fp32 = torch.zeros(40, 8)
    cases = {
        "fp32": (fp32, torch.zeros(3, 8)),
        "bf16 weight": (fp32.bfloat16(), torch.zeros(3, 8)),
        "bf16 hidden, fp32 weight": (fp32, torch.zeros(3, 8, dtype=torch.bfloat16)),
        "float64 hidden, fp32 weight": (fp32, torch.zeros(3, 8, dtype=torch.float64)),
    }
    picks = {}
    for name, (weight, hidden) in cases.items():
        out = linear_logprobs(hidden, weight.requires_grad_(), torch.zeros(3, dtype=torch.long))
        (picks[name],) = head_functions(out.logprobs)
    assert set(picks.values()) == {"BlockedLogProbsBackward"}, picks
    for narrow in (False, True):
        ce = select_backend("auto", "weighted_ce", narrow_weight=narrow)
        pointwise = select_backend("auto", "pointwise", outputs=ALL, narrow_weight=narrow)
        expected = "blocked" if narrow else "chunked"
        assert (ce.backend.name, pointwise.backend.name) == (expected, expected)


def test_auto_per_token_takes_blocked_on_cuda_too():
    """Measured on an H100 for an fp32 weight (faster and leaner than ``chunked``), and on an H200 for a
    narrow one: ``auto`` takes ``blocked`` for per-token outputs on CUDA as on CPU."""
    per_token = {
        narrow: select_backend("auto", "per_token", outputs=ALL, on_cuda=True, narrow_weight=narrow)
        for narrow in (False, True)
    }
    assert {k: r.backend.name for k, r in per_token.items()} == {False: "blocked", True: "blocked"}
    assert FusedLMHead(torch.zeros(8, 4)).resolve_backend(ALL) == "blocked"  # a CPU weight
    for name in ("chunked", "naive"):  # a named backend is taken as named
        assert select_backend(name, "per_token", outputs=("logprobs",), on_cuda=False).backend.name == name


def test_block_size_takes_one_chunk_of_memory_in_aligned_rows():
    """``[n, V_b]`` logits and ``[V_b, D]`` twice: about ``chunk · V`` elements in all, in a multiple of
    ``BLOCK_ALIGN`` rows (aligned rows for the matmuls' tensor-core kernels) from that size on."""
    n, v, d = 1024, 65536, 1024
    rows = vocab_block_size(n, v, d, 256, "cpu")
    assert rows % BLOCK_ALIGN == 0
    assert rows * (n + 2 * d) <= 256 * v < (rows + BLOCK_ALIGN) * (n + 2 * d)
    # the H200 case: 8192 tokens, D = 4096, a 512 MiB chunk of V = 128256: 8064 rows (63 x 128), not 8187
    assert vocab_block_size(8192, 128256, 4096, None, "cuda") == 8064
    assert vocab_block_size(4, 50, 2, 1, "cpu") == 16 and vocab_block_size(4, 10, 2, 1000, "cpu") == 10


def test_fast_path_gradients_survive_a_second_backward_through_a_retained_graph():
    """The plain-CE fast path hands its buffers out at the first backward (no ``V × D`` copy); a second
    backward through the retained graph recomputes the same gradients."""
    hidden, weight, b, targets = problem()
    loss = FusedLMHead(weight, b, backend="chunked", chunk_size=8).weighted_ce(hidden, targets, 0.3)
    first = torch.autograd.grad(2.0 * loss, (hidden, weight, b), retain_graph=True)
    second = torch.autograd.grad(2.0 * loss, (hidden, weight, b))
    ref = -0.3 * naive_head(hidden, weight, b, targets, ("logprobs",)).logprobs.sum()
    ref_grads = torch.autograd.grad(2.0 * ref, (hidden, weight, b))
    for a, c, r in zip(first, second, ref_grads, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(c, r, rtol=1e-12, atol=1e-12)


# ---- temperature -------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["chunked", "blocked", "naive"])
@pytest.mark.parametrize("api", ["per_token", "weighted_ce", "pointwise"])
def test_temperature_is_the_head_of_the_scaled_logits(backend, api):
    """Every output, loss and gradient (hidden, weight, bias) at ``T`` equals the naive float64 head of the
    logits ``z / T``, to 1e-10."""
    hidden, weight, b, targets = problem()
    t = 0.7
    upstream = [
        torch.randn(targets.shape, generator=torch.Generator().manual_seed(i)).double() for i in range(3)
    ]
    head = FusedLMHead(weight, b, backend=backend, chunk_size=7, temperature=t)

    def loss_of(out):
        return sum((getattr(out, k) * u).sum() for k, u in zip(ALL, upstream, strict=True))

    def chunk_loss(s, e, lp, lse, ent):
        return (upstream[0][targets != -100][s:e] * lp).sum() + (lse.square() + ent).sum()

    if api == "per_token":
        loss = loss_of(head(hidden, targets, ALL))
    elif api == "weighted_ce":
        loss = head.weighted_ce(hidden, targets, 0.3)
    else:
        loss = head.pointwise_loss(hidden, targets, chunk_loss, with_entropy=True)
    ref_out = naive_head(hidden, weight / t, b / t, targets, ALL)  # (h Wᵀ + b) / T
    if api == "per_token":
        ref = loss_of(ref_out)
    elif api == "weighted_ce":
        ref = -0.3 * ref_out.logprobs.sum()
    else:
        valid = targets != -100
        ref = chunk_loss(
            0, int(valid.sum()), ref_out.logprobs[valid], ref_out.lse[valid], ref_out.entropy[valid]
        )
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    for got, exp in zip(
        torch.autograd.grad(loss, (hidden, weight, b)),
        torch.autograd.grad(ref, (hidden, weight, b)),
        strict=True,
    ):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("temperature", [0, -1.0, float("inf"), float("nan"), "1", True])
def test_a_bad_temperature_is_refused_naming_it(temperature):
    with pytest.raises(ValueError, match="temperature"):
        FusedLMHead(torch.zeros(5, 3), temperature=temperature)
    with pytest.raises(ValueError, match="temperature"):
        linear_logprobs(
            torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(2, dtype=torch.long), temperature=temperature
        )


def test_temperature_divides_bf16_hidden_states_in_fp32():
    """``h / T`` is formed in fp32 for bf16 hidden states: the logprobs equal the fp32 head of ``z / T``."""
    hidden, weight, _, targets = problem(dtype=torch.float32, bias=False)
    h16 = hidden.detach().bfloat16()
    got = linear_logprobs(h16, weight.detach(), targets, temperature=0.3).logprobs
    ref = naive_head(h16.double(), weight.detach().double() / 0.3, None, targets, ("logprobs",)).logprobs
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_a_call_under_a_dispatch_mode_runs_eagerly_and_leaves_the_kernels_on(compiled_kernels):
    """``torch.compile`` compiles nothing under a ``TorchDispatchMode`` (a FLOP counter, say): that call
    takes the eager passes, with the same values, and later calls still get the compiled kernels."""
    z = torch.randn(4, 300, dtype=torch.float64)
    ref = (z.amax(1), (z - z.amax(1, keepdim=True)).exp().sum(1))
    with LargestFloatOutputs():
        assert entropy_kernels.block_softmax_stats(z, with_entropy=False) is None
    assert not entropy_kernels._failed and not compiled_kernels
    stats = entropy_kernels.block_softmax_stats(z, with_entropy=False)
    assert compiled_kernels == ["_block_lse_kernel"]
    for got, want in zip(stats, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_bf16_operands_take_the_gradient_in_bf16_from_the_kernel_as_from_the_eager_passes(
    with_entropy, compiled_kernels, monkeypatch
):
    """bf16 operands (CUDA under ``bf16-true``): the compiled kernel writes each block's logit gradient
    straight in bf16 (no fp32 block, no cast pass); the gradients equal the eager passes' (fp32 gradient,
    then a cast) to bf16 rounding of single elements, and the float64 gradient to bf16 accuracy."""
    monkeypatch.setattr(entropy_kernels, "COMPILE_MIN_LOGITS", 1)
    g = torch.Generator().manual_seed(3)
    n, d, v, block = 48, 8, 700, 128
    h = torch.randn(n, d, generator=g).bfloat16()
    w = (torch.randn(v, d, generator=g) * 0.4).bfloat16()
    y = torch.randint(0, v, (n,), generator=g)
    up = [torch.randn(n, generator=g) for _ in range(3)]
    if not with_entropy:
        up[2] = None

    def grads():
        _lp, lse, ent = blocked_forward(
            h, w, None, y, with_entropy=with_entropy, block=block, acc=torch.float32
        )
        return blocked_backward(
            h,
            w,
            None,
            targets=y,
            stats=(lse, ent),
            upstream=tuple(up),
            block=block,
            needs=(True, True, False),
        )

    fused = grads()
    assert "_block_grad_bf16_kernel_" in compiled_kernels
    monkeypatch.setenv(entropy_kernels.ENV_SWITCH, "0")
    eager = grads()
    h64, w64 = (x.double().requires_grad_() for x in (h, w))
    log_p = torch.log_softmax(h64 @ w64.T, dim=1)
    loss = (log_p.gather(1, y[:, None])[:, 0] * up[0]).sum() + (torch.logsumexp(h64 @ w64.T, 1) * up[1]).sum()
    if with_entropy:
        loss = loss - ((log_p.exp() * log_p).sum(1) * up[2]).sum()
    exact = torch.autograd.grad(loss, (h64, w64))
    for got, ref, ex in zip(fused[:2], eager[:2], exact, strict=True):
        scale = ex.abs().max()
        torch.testing.assert_close(got.double() / scale, ref.double() / scale, rtol=0, atol=1e-2)
        torch.testing.assert_close(got.double() / scale, ex / scale, rtol=0, atol=2e-2)


def test_auto_plain_ce_on_cuda_takes_blocked_for_a_narrow_weight_before_an_auto_ce_kernel():
    """On CUDA an installed ``auto_ce`` kernel (Liger's) takes the plain CE of a weight in the compute
    dtype; a bf16 weight goes to ``blocked``, faster and leaner there than Liger with fp32 weight-gradient
    accumulation (``benchmarks/RESULTS.md``, H200)."""
    kernel = HeadBackend(
        name="a_cuda_kernel",
        fused_ce=lambda head, h, y, w: h.sum(),
        cuda_only=True,
        auto_ce=True,
        available=lambda: True,
    )
    with HEAD_BACKENDS.scoped():
        register_backend(kernel)
        wide = select_backend("auto", "weighted_ce", uniform=True, on_cuda=True, narrow_weight=False)
        narrow = select_backend("auto", "weighted_ce", uniform=True, on_cuda=True, narrow_weight=True)
        on_cpu = select_backend("auto", "weighted_ce", uniform=True, on_cuda=False, narrow_weight=False)
    assert (wide.backend.name, narrow.backend.name, on_cpu.backend.name) == (
        "a_cuda_kernel",
        "blocked",
        "chunked",
    )
    assert wide.fused and narrow.fused


def test_bf16_backward_makes_its_fp32_logits_a_slice_of_the_tokens_at_a_time(compiled_kernels, monkeypatch):
    """The bf16 gradient of a block is written whole, its fp32 logits recomputed `CAST_SLICES` slices of the
    tokens at a time (a quarter of the block's fp32 bytes live at once): the gradients equal those of the
    block made in one slice."""
    monkeypatch.setattr(entropy_kernels, "COMPILE_MIN_LOGITS", 1)
    g = torch.Generator().manual_seed(5)
    n, d, v, block = 77, 8, 700, 128
    h = torch.randn(n, d, generator=g).bfloat16()
    w = (torch.randn(v, d, generator=g) * 0.4).bfloat16()
    bias = torch.randn(v, generator=g) * 0.1  # not trained: added to the logits, no bias gradient
    y = torch.randint(0, v, (n,), generator=g)
    up = (torch.randn(n, generator=g), torch.randn(n, generator=g), torch.randn(n, generator=g))
    _lp, lse, ent = blocked_forward(h, w, bias, y, with_entropy=True, block=block, acc=torch.float32)
    made = []

    def recorded_mm_in(a, b, dtype):
        made.append(a.shape[0])
        return mm_in(a, b, dtype)

    def grads():
        made.clear()
        return blocked_backward(
            h, w, bias, targets=y, stats=(lse, ent), upstream=up, block=block, needs=(True, True, False)
        )

    monkeypatch.setattr(vocab_blocks, "mm_in", recorded_mm_in)
    sliced = grads()
    assert "_block_grad_bf16_kernel_" in compiled_kernels
    assert max(made) == 24 and sum(made) == n * -(-v // block), made  # ceil(77 / 4) = 20, rounded up to 8
    monkeypatch.setattr(vocab_blocks, "CAST_SLICES", 1)
    whole = grads()
    assert max(made) == n
    for got, ref in zip(sliced[:2], whole[:2], strict=True):
        torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2, atol=1e-5)
