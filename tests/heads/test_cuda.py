"""The head on CUDA (chunked, blocked, liger) against the naive reference; skipped without CUDA."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from lit_losses.heads import FusedLMHead, entropy_kernels, liger
from lit_losses.heads.chunked_ops import matmul_into
from lit_losses.heads.liger import liger_available, liger_uniform_ce_sum

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ALL = ("logprobs", "lse", "entropy")
TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def problem(n=300, d=64, v=5000, dtype=torch.float32, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g)
    weight = torch.randn(v, d, generator=g) * 0.2
    b = torch.randn(v, generator=g) * 0.1 if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::7] = -100
    leaves = [x.to("cuda", dtype).requires_grad_() if x is not None else None for x in (hidden, weight, b)]
    return (*leaves, targets.cuda())


def per_token_loss_and_grads(backend, hidden, weight, bias, targets, upstream):
    out = FusedLMHead(weight, bias, backend=backend, chunk_size=64)(hidden, targets, ALL)
    loss = sum((getattr(out, k).float() * u).sum() for k, u in zip(ALL, upstream, strict=True))
    return loss, torch.autograd.grad(loss, [x for x in (hidden, weight, bias) if x is not None])


@pytest.mark.parametrize("backend", ["chunked", "blocked"])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_on_cuda_matches_naive_fp32(bias, backend):
    hidden, weight, b, targets = problem(bias=bias)
    upstream = [torch.randn(targets.shape, device="cuda") for _ in ALL]
    ref, ref_grads = per_token_loss_and_grads("naive", hidden, weight, b, targets, upstream)
    got, grads = per_token_loss_and_grads(backend, hidden, weight, b, targets, upstream)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["chunked", "blocked"])
def test_chunked_on_cuda_bf16_accumulates_in_fp32(backend):
    hidden, weight, _, targets = problem(dtype=torch.bfloat16)
    h32, w32 = (x.detach().float().requires_grad_() for x in (hidden, weight))
    upstream = [torch.randn(targets.shape, device="cuda") for _ in ALL]
    ref, ref_grads = per_token_loss_and_grads("naive", h32, w32, None, targets, upstream)
    got, grads = per_token_loss_and_grads(backend, hidden, weight, None, targets, upstream)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-1)
    for g, r in zip(grads, ref_grads, strict=True):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float() / r.abs().max(), r / r.abs().max(), rtol=0, atol=2e-2)


def test_bad_target_on_cuda_is_a_value_error_not_a_device_assert():
    hidden, weight, _, targets = problem()
    targets[5] = weight.shape[0]
    with pytest.raises(ValueError, match=rf"target {weight.shape[0]} .*V={weight.shape[0]}"):
        FusedLMHead(weight, backend="chunked")(hidden, targets)


@pytest.mark.skipif(not liger_available(), reason="needs a CUDA device and the [liger] extra")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_liger_plain_ce_matches_the_chunked_fast_path(dtype):
    hidden, weight, _, targets = problem(dtype=dtype)
    w = 1.0 / int((targets != -100).sum())
    results = {}
    for backend in ("chunked", "liger"):
        loss = FusedLMHead(weight, backend=backend).weighted_ce(hidden, targets, w)
        results[backend] = (loss.float(), *torch.autograd.grad(loss, (hidden, weight)))
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    for got, ref in zip(results["liger"], results["chunked"], strict=True):
        torch.testing.assert_close(got.float(), ref.float(), **tol)


@pytest.mark.skipif(not liger_available(), reason="needs a CUDA device and the [liger] extra")
def test_auto_takes_liger_for_uniform_plain_ce_and_chunked_otherwise(monkeypatch):
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return liger_uniform_ce_sum(*args, **kwargs)

    monkeypatch.setattr(liger, "liger_uniform_ce_sum", counting)
    hidden, weight, _, targets = problem()
    head = FusedLMHead(weight, backend="auto")
    uniform = head.weighted_ce(hidden, targets, 0.5)
    per_token_w = torch.full(targets.shape, 0.5, device="cuda")
    weighted = head.weighted_ce(hidden, targets, per_token_w)
    assert len(calls) == 1  # the uniform call only
    torch.testing.assert_close(uniform, weighted, rtol=1e-5, atol=1e-5)


LIGER = pytest.param(
    "liger",
    marks=pytest.mark.skipif(not liger_available(), reason="needs a CUDA device and the [liger] extra"),
)


@pytest.mark.parametrize("backend", ["chunked", LIGER])
def test_bf16_mixed_on_cuda_multiplies_bf16_operands_with_fp32_products(backend):
    """``bf16-mixed`` (fp32 weight and hidden, autocast on): the default ``matmul_precision="auto"`` hands
    the matmuls bf16 operands (tensor cores); the chunked kernel keeps their products in fp32
    (``torch.mm(..., out_dtype=float32)``), Liger's kernel rounds them to bf16 (its own design): the loss
    and gradients are those of the cross-entropy of these logits of the bf16-rounded operands."""
    hidden, weight, _, targets = problem()
    w = 1.0 / int((targets != -100).sum())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = FusedLMHead(weight, backend=backend).weighted_ce(hidden, targets, w)
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert loss.dtype == grads[0].dtype == grads[1].dtype == torch.float32
    h16, w16 = (x.detach().bfloat16().float().requires_grad_() for x in (hidden, weight))
    valid = targets != -100
    logits = h16 @ w16.T  # fp32 products of the bf16 operands
    if backend == "liger":
        logits = logits + (logits.detach().bfloat16().float() - logits.detach())  # rounded, same gradient
    ref = F.cross_entropy(logits[valid], targets[valid])
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, torch.autograd.grad(ref, (h16, w16)), strict=True):
        torch.testing.assert_close(g / r.abs().max(), r / r.abs().max(), rtol=0, atol=1e-2)


def test_forward_logits_under_bf16_autocast_on_cuda_is_differentiable():
    """``forward_logits`` with bf16 operands stays differentiable (the fp32-product kernel has no
    derivative: it is used only where autograd does not record)."""
    hidden, weight, _, _ = problem()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = FusedLMHead(weight).forward_logits(hidden)
    logits.square().mean().backward()
    assert logits.dtype == torch.float32 and hidden.grad is not None and weight.grad is not None
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        exact = FusedLMHead(weight).forward_logits(hidden)
    torch.testing.assert_close(
        exact, hidden.detach().bfloat16().float() @ weight.detach().bfloat16().float().T
    )


@pytest.mark.parametrize("bias", [False, True])
def test_blocked_on_cuda_float64_to_1e10(bias):
    """The blocked backend's CUDA path (eager passes) against the float64 naive head, values and gradients."""
    hidden, weight, b, targets = problem(n=120, d=32, v=3000, dtype=torch.float64, bias=bias)
    upstream = [torch.randn(targets.shape, device="cuda", dtype=torch.float64) for _ in ALL]
    ref, ref_grads = per_token_loss_and_grads("naive", hidden, weight, b, targets, upstream)
    got, grads = per_token_loss_and_grads("blocked", hidden, weight, b, targets, upstream)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def test_auto_plain_ce_with_a_bf16_weight_on_cuda_returns_a_bf16_gradient_without_an_fp32_copy():
    """``auto`` takes ``blocked`` for a bf16 weight (with or without Liger): peak memory stays below the
    weight's fp32 size above the inputs, and the gradient matches fp32's within bf16 rounding."""
    hidden, weight, _, targets = problem(n=256, d=256, v=32000, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = FusedLMHead(weight, chunk_size=64).weighted_ce(hidden, targets, 1 / 256)
    loss.backward()
    added = torch.cuda.max_memory_allocated() - base
    assert weight.grad.dtype == torch.bfloat16
    assert added < 1.25 * (weight.numel() * 2 + 2 * 64 * 32000 * 4), added
    h32, w32 = (x.detach().float().requires_grad_() for x in (hidden, weight))
    valid = targets != -100
    ref = F.cross_entropy(h32[valid] @ w32.T, targets[valid], reduction="sum") / 256
    ref.backward()
    torch.testing.assert_close(loss.float(), ref, rtol=1e-2, atol=1e-2)
    scale = w32.grad.abs().max()
    torch.testing.assert_close(weight.grad.float() / scale, w32.grad / scale, rtol=0, atol=2e-2)


@pytest.mark.parametrize("backend", ["chunked", "blocked"])
@pytest.mark.parametrize("bias", [False, True])
def test_compiled_triton_kernels_on_cuda_match_naive_fp32(backend, bias, compiled_kernels, monkeypatch):
    """Every block through the compiled (Triton) kernels, fp32: values and gradients of the three outputs
    equal the naive head's."""
    monkeypatch.setattr(entropy_kernels, "COMPILE_MIN_LOGITS", 1)
    hidden, weight, b, targets = problem(bias=bias)
    upstream = [torch.randn(targets.shape, device="cuda") for _ in ALL]
    ref, ref_grads = per_token_loss_and_grads("naive", hidden, weight, b, targets, upstream)
    got, grads = per_token_loss_and_grads(backend, hidden, weight, b, targets, upstream)
    assert compiled_kernels, "the compiled kernels did not run"
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["chunked", "blocked"])
def test_compiled_triton_kernels_on_cuda_bf16_against_float64(backend, compiled_kernels, monkeypatch):
    """bf16 weight and hidden states through the compiled kernels (``blocked``: the logit gradient written
    straight in bf16 by the kernel) against the float64 naive head, to bf16 accuracy."""
    monkeypatch.setattr(entropy_kernels, "COMPILE_MIN_LOGITS", 1)
    hidden, weight, _, targets = problem(dtype=torch.bfloat16)
    h64, w64 = (x.detach().double().requires_grad_() for x in (hidden, weight))
    upstream = [torch.randn(targets.shape, device="cuda", dtype=torch.float64) for _ in ALL]
    ref, ref_grads = per_token_loss_and_grads("naive", h64, w64, None, targets, upstream)
    got, grads = per_token_loss_and_grads(backend, hidden, weight, None, targets, upstream)
    if backend == "blocked":
        assert "_block_grad_bf16_kernel_" in compiled_kernels, compiled_kernels
    torch.testing.assert_close(got.double(), ref, rtol=2e-3, atol=1e-1)
    for g, r in zip(grads, ref_grads, strict=True):
        assert g.dtype == torch.bfloat16
        scale = r.abs().max()
        torch.testing.assert_close(g.double() / scale, r / scale, rtol=0, atol=2e-2)


@pytest.mark.parametrize("accumulate", [False, True])
def test_matmul_into_takes_bf16_products_in_fp32_without_a_product_sized_temporary(accumulate):
    """``out (+)= a @ b`` of bf16 operands into an fp32 ``out`` (the blocked head's ``∂/∂h``, the chunked
    head's ``V × D`` accumulator): written in place, exact to fp32 accumulation against float64 (a product
    rounded to bf16 would miss by ~1e-3 relative), and no fp32 temporary of the product's size (the adding
    call from PyTorch 2.10 on: before, the product is added, to the same values)."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(shape, generator=g).cuda().bfloat16() for shape in ((1024, 512), (512, 2048)))
    out = torch.randn(1024, 2048, generator=g).cuda()
    ref = (out.double() if accumulate else 0) + a.double() @ b.double()
    matmul_into(torch.empty_like(out), a, b, accumulate=accumulate)  # cuBLAS's workspace, allocated once
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got = matmul_into(out, a, b, accumulate=accumulate)
    added = torch.cuda.max_memory_allocated() - before
    assert got.data_ptr() == out.data_ptr()
    if not accumulate or TORCH_VERSION >= (2, 10):
        assert added < out.numel() * out.element_size() // 4, added
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("per_token_weights", [False, True])
def test_plain_ce_step_reads_the_device_at_most_a_few_times(per_token_weights):
    """One plain cross-entropy forward + backward with its input checks synchronizes with the host at most
    twice (the checks, per-token weights' included, in one read; the valid tokens' index, which selects
    the weights too): each read stalls the queue in a training step."""
    hidden, weight, _, targets = problem(n=512, d=64, v=5000, dtype=torch.bfloat16)
    weights = torch.rand(targets.shape, device="cuda") if per_token_weights else 1.0 / 512
    head = FusedLMHead(weight, backend="blocked")

    def step():
        head.weighted_ce(hidden, targets, weights).backward()

    step()  # compiles the kernels, allocates cuBLAS's workspace
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 2, [str(w.message) for w in syncs]


@pytest.mark.parametrize("bias", [False, True])
def test_low_logits_on_cuda_is_the_loss_of_a_bf16_linear_and_halves_the_blocks(bias, monkeypatch):
    """``matmul_precision="low_logits"`` on CUDA: the plain cross-entropy is that of the logits a bf16
    ``nn.Linear`` writes (cuBLAS's rounding, the bias included), in fp32 from there; its peak memory above
    the inputs is below ``low``'s (bf16 blocks, the gradient written over them)."""
    monkeypatch.setattr(entropy_kernels, "COMPILE_MIN_LOGITS", 1)
    hidden, weight, b, targets = problem(n=2048, d=256, v=32000, dtype=torch.bfloat16, bias=bias)
    valid = targets != -100
    logits = F.linear(hidden.detach(), weight.detach(), None if b is None else b.detach()).float()
    want = F.cross_entropy(logits[valid], targets[valid], reduction="sum")
    peaks = {}
    for precision in ("low", "low_logits"):
        head = FusedLMHead(weight, b, backend="blocked", matmul_precision=precision, chunk_size=256)
        head.weighted_ce(hidden, targets, 1.0).backward()  # compiles the kernels
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = head.weighted_ce(hidden, targets, 1.0)
        loss.backward()
        torch.cuda.synchronize()
        peaks[precision] = torch.cuda.max_memory_allocated() - base
        if precision == "low_logits":
            torch.testing.assert_close(loss.double(), want.double(), rtol=2e-6, atol=0)
    assert peaks["low_logits"] < peaks["low"], peaks
