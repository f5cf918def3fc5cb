"""The chunked backend and the dispatcher against the naive reference (float64 and float32)."""

import math

import pytest
import torch

from lit_losses.heads import FusedLMHead, chunked_ops, entropy_kernels
from lit_losses.heads.chunked import ChunkedLogProbs, chunk_size_for, default_chunk_size
from lit_losses.heads.chunked_ops import row_dot
from lit_losses.heads.torch_lce import torch_available

ALL = ("logprobs", "lse", "entropy")
ENTROPY_PATHS = ["per_token_entropy", "pointwise_entropy"]


def problem(n=37, d=16, v=101, dtype=torch.float64, bias=True, seed=0, ignore_every=5):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g, dtype=dtype) * 0.5).requires_grad_()
    b = (torch.randn(v, generator=g, dtype=dtype) * 0.1).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::ignore_every] = -100
    return hidden, weight, b, targets


def outputs_and_grads(backend, hidden, weight, bias, targets, outputs, upstream, chunk_size=8):
    out = FusedLMHead(weight, bias, backend=backend, chunk_size=chunk_size)(hidden, targets, outputs)
    values = [getattr(out, name) for name in outputs]
    loss = sum((v * g).sum() for v, g in zip(values, upstream))
    inputs = [x for x in (hidden, weight, bias) if x is not None]
    return values, torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("outputs", [ALL, ("logprobs",), ("entropy",), ("lse", "logprobs")])
def test_chunked_matches_naive(dtype, bias, outputs):
    hidden, weight, b, targets = problem(dtype=dtype, bias=bias)
    g = torch.Generator().manual_seed(1)
    upstream = [torch.randn(targets.shape, generator=g, dtype=dtype) for _ in outputs]
    ref_vals, ref_grads = outputs_and_grads("naive", hidden, weight, b, targets, outputs, upstream)
    vals, grads = outputs_and_grads("chunked", hidden, weight, b, targets, outputs, upstream)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for v, r in zip(vals, ref_vals):
        torch.testing.assert_close(v, r, **tol)
    for gr, r in zip(grads, ref_grads):
        torch.testing.assert_close(gr, r, **tol)


@pytest.mark.skipif(not torch_available(), reason="torch.nn.functional.linear_cross_entropy missing")
def test_torch_backend_matches_naive():
    hidden, weight, b, targets = problem(dtype=torch.float32)
    upstream = [torch.randn(targets.shape)]
    ref_vals, ref_grads = outputs_and_grads("naive", hidden, weight, b, targets, ("logprobs",), upstream)
    vals, grads = outputs_and_grads("torch", hidden, weight, b, targets, ("logprobs",), upstream)
    torch.testing.assert_close(vals[0], ref_vals[0], rtol=1e-5, atol=1e-5)
    for gr, r in zip(grads, ref_grads):
        torch.testing.assert_close(gr, r, rtol=1e-5, atol=1e-5)


def test_ignored_positions_get_zero_and_no_gradient():
    hidden, weight, b, targets = problem()
    out = FusedLMHead(weight, b, backend="chunked", chunk_size=4)(hidden, targets, ALL)
    ignored = targets == -100
    for name in ALL:
        assert (getattr(out, name)[ignored] == 0).all()
    (out.logprobs.sum() + out.lse.sum() + out.entropy.sum()).backward()
    assert (hidden.grad[ignored] == 0).all()
    assert (hidden.grad[~ignored].abs().sum(-1) > 0).all()


def test_gradcheck_float64_every_output_odd_shapes():
    """V = 50257, D = 96, 29 tokens with a chunk of 8 (not a multiple), bias, ignored positions."""
    hidden, weight, b, targets = problem(n=29, d=96, v=50257, bias=True, ignore_every=4)
    head = FusedLMHead(weight, b, backend="chunked", chunk_size=8)
    g = torch.Generator().manual_seed(3)
    upstream = [torch.randn(29, generator=g, dtype=torch.float64) for _ in ALL]

    def fn(h, w, bias):
        out = FusedLMHead(w, bias, backend="chunked", chunk_size=8)(h, targets, ALL)
        return tuple(getattr(out, k) * u for k, u in zip(ALL, upstream))

    assert head.vocab_size == 50257
    assert torch.autograd.gradcheck(fn, (hidden, weight, b), fast_mode=True, eps=1e-6, atol=1e-7)


def test_gradcheck_float64_exhaustive_small():
    hidden, weight, b, targets = problem(n=7, d=5, v=11, ignore_every=3)

    def fn(h, w, bias):
        out = FusedLMHead(w, bias, backend="chunked", chunk_size=3)(h, targets, ALL)
        return out.logprobs, out.lse, out.entropy

    assert torch.autograd.gradcheck(fn, (hidden, weight, b))


@pytest.mark.parametrize("uniform", [True, False])
def test_weighted_ce_fast_path_matches_naive(uniform):
    hidden, weight, b, targets = problem(dtype=torch.float64)
    w = 0.37 if uniform else torch.rand(targets.shape, dtype=torch.float64)
    head = FusedLMHead(weight, b, backend="chunked", chunk_size=8)
    loss = head.weighted_ce(hidden, targets, w)
    grads = torch.autograd.grad(loss * 1.7, (hidden, weight, b))
    logprobs = FusedLMHead(weight, b, backend="naive")(hidden, targets).logprobs
    ref = -(w * logprobs).sum()
    ref_grads = torch.autograd.grad(ref * 1.7, (hidden, weight, b))
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    for gr, r in zip(grads, ref_grads):
        torch.testing.assert_close(gr, r, rtol=1e-12, atol=1e-12)


def test_tied_embedding_gradients_accumulate_into_the_shared_weight():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 8).double()
    ids = torch.randint(0, 50, (2, 6))
    targets = torch.randint(0, 50, (2, 6))

    def loss_with(backend):
        emb.zero_grad()
        hidden = torch.tanh(emb(ids))
        out = FusedLMHead(emb.weight, backend=backend, chunk_size=4)(hidden, targets, ALL)
        (out.logprobs.sum() + 0.3 * out.entropy.sum()).backward()
        return emb.weight.grad.clone()

    torch.testing.assert_close(loss_with("chunked"), loss_with("naive"), rtol=1e-12, atol=1e-12)


def test_bf16_inputs_accumulate_in_fp32():
    hidden, weight, _, targets = problem(n=40, d=32, v=300, dtype=torch.float32, bias=False)
    h16, w16 = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    out = FusedLMHead(w16, backend="chunked", chunk_size=16)(h16, targets, ALL)
    assert out.logprobs.dtype == torch.float32
    ref = FusedLMHead(w16.float(), backend="naive")(h16.float(), targets, ALL)
    torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=2e-2, atol=2e-2)
    out.logprobs.sum().backward()
    assert h16.grad.dtype == torch.bfloat16 and w16.grad.dtype == torch.bfloat16


def test_no_logits_sized_tensor_is_saved_for_backward():
    hidden, weight, b, targets = problem(n=64, d=8, v=1000, dtype=torch.float32)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        FusedLMHead(weight, b, backend="chunked", chunk_size=16)(hidden, targets, ALL)
    assert max(saved) < 64 * 1000 / 4  # weight [1000, 8] is the largest; logits would be 64 000


def test_direct_op_without_entropy_returns_an_empty_entropy():
    hidden, weight, b, targets = problem(n=5, d=4, v=9)
    lp, lse, ent = ChunkedLogProbs.apply(hidden, weight, b, targets.clamp_min(0), False, 2, torch.float32)
    assert ent.numel() == 0 and lp.shape == lse.shape == (5,)


# ---- the folded projections (CPU): repeated targets, extreme logits, mixed precision ------------
PATHS = ["per_token", "per_token_entropy", "weighted_ce", "pointwise", "pointwise_entropy"]


def _loss(path, head, hidden, targets, upstream):
    """A loss through one chunked entry point, built from per-token values and ``upstream`` weights."""
    if path in ("per_token", "per_token_entropy"):
        with_entropy = path == "per_token_entropy"
        out = head(hidden, targets, ("logprobs", "lse", "entropy") if with_entropy else ("logprobs", "lse"))
        loss = (upstream[0] * out.logprobs + upstream[1] * out.lse).sum()
        return loss + (upstream[2] * out.entropy).sum() if with_entropy else loss
    if path == "weighted_ce":
        return head.weighted_ce(hidden, targets, upstream[0].abs())
    valid = targets != head.ignore_index
    g_lp, g_lse, g_ent = (u[valid] for u in upstream)
    with_entropy = path == "pointwise_entropy"

    def chunk_loss(s, e, lp, lse, ent):
        loss = (g_lp[s:e] * lp).sum() + (g_lse[s:e] * lse.square()).sum()
        return loss + (g_ent[s:e] * ent).sum() if with_entropy else loss

    return head.pointwise_loss(hidden, targets, chunk_loss, with_entropy=with_entropy)


@pytest.mark.parametrize("path", PATHS)
def test_repeated_targets_within_a_chunk(path):
    """Many tokens of one chunk share a target: their weight-gradient rows must add up."""
    hidden, weight, b, targets = problem(n=30, d=12, v=40, ignore_every=7)
    targets[targets != -100] = torch.tensor([3, 3, 3, 7, 3, 7] * 5)[: int((targets != -100).sum())]
    upstream = [
        torch.randn(targets.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        for i in range(3)
    ]
    results = {}
    for backend in ("naive", "chunked"):
        head = FusedLMHead(weight, b, backend=backend, chunk_size=8)
        loss = _loss(path, head, hidden, targets, upstream)
        results[backend] = (loss, *torch.autograd.grad(loss, (hidden, weight, b)))
    for got, ref in zip(results["chunked"], results["naive"], strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("path", PATHS)
def test_extreme_logits_in_float32_against_float64(path):
    """Logits of a few hundred and target log-probabilities below −800: fp32 stays within 1e-5."""
    hidden, weight, b, targets = problem(n=24, d=16, v=500, ignore_every=6, dtype=torch.float32)
    with torch.no_grad():
        weight.mul_(80.0)
    inputs32 = [hidden, weight, b]
    hidden, weight, b = (x.detach().double().requires_grad_() for x in inputs32)  # the same values
    upstream = [
        torch.randn(targets.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        for i in range(3)
    ]
    ref_head = FusedLMHead(weight, b, backend="naive")
    ref_loss = _loss(path, ref_head, hidden, targets, upstream)
    ref_grads = torch.autograd.grad(ref_loss, (hidden, weight, b))
    lp = ref_head(hidden, targets).logprobs
    assert lp.min() < -800  # the regime this test is about
    head = FusedLMHead(inputs32[1], inputs32[2], backend="chunked", chunk_size=8)
    loss = _loss(path, head, inputs32[0], targets, [u.float() for u in upstream])
    grads = torch.autograd.grad(loss, inputs32)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, ref_grads, strict=True):
        scale = ref.abs().max()
        torch.testing.assert_close(got.double() / scale, ref / scale, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_bf16_gradients_match_the_fp32_reference(path):
    """bf16 inputs take the unfolded projection (fp32 logit gradients): gradients within bf16 precision."""
    hidden, weight, _, targets = problem(n=40, d=32, v=300, dtype=torch.float32, bias=False)
    h16, w16 = (x.detach().bfloat16().requires_grad_() for x in (hidden, weight))
    h32, w32 = (x.detach().float().requires_grad_() for x in (h16, w16))
    upstream = [torch.randn(targets.shape, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ref_loss = _loss(path, FusedLMHead(w32, backend="naive"), h32, targets, upstream)
    ref_grads = torch.autograd.grad(ref_loss, (h32, w32))
    loss = _loss(path, FusedLMHead(w16, backend="chunked", chunk_size=16), h16, targets, upstream)
    grads = torch.autograd.grad(loss, (h16, w16))
    torch.testing.assert_close(loss.float(), ref_loss, rtol=2e-2, atol=2e-2)
    for got, ref in zip(grads, ref_grads, strict=True):
        assert got.dtype == torch.bfloat16
        scale = ref.abs().max()
        torch.testing.assert_close(got.float() / scale, ref / scale, rtol=0, atol=2e-2)


# ---- the entropy passes: row dot, centering, degenerate rows, chunk memory ---------------------
@pytest.mark.parametrize("shape", [(7, 320), (5, 101), (3, 64), (4, 0), (0, 64)])
@pytest.mark.parametrize("contiguous", [True, False])
def test_row_dot_is_each_rows_dot_product(shape, contiguous):
    """Blocked where V is a multiple of the block, ``vecdot`` otherwise (odd V, empty rows, strided views)."""
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(shape[::-1] if not contiguous else shape, generator=g) for _ in range(2))
    if not contiguous:
        a, b = a.t(), b.t()
    ref = (a.double() * b.double()).sum(1)
    torch.testing.assert_close(row_dot(a, b).double(), ref, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("path", ENTROPY_PATHS)
def test_entropy_of_uniform_and_one_hot_rows(path, entropy_kernel):
    """Equal logits give H = log V; a row whose target owns all the mass gives H = 0 (not negative, not NaN)
    and the plain NLL gradient, in fp32, against float64."""
    hidden = torch.zeros(6, 4)
    hidden[3:, 0] = 1.0
    weight = torch.zeros(50, 4)
    weight[7, 0] = 400.0  # rows 3-5: logit 400 at token 7, 0 elsewhere
    targets = torch.tensor([1, 2, 3, 7, 7, 7])
    upstream = [
        torch.randn(6, generator=torch.Generator().manual_seed(i), dtype=torch.float64) for i in range(3)
    ]
    results = {}
    for dtype in (torch.float64, torch.float32):
        h, w = (x.to(dtype).requires_grad_() for x in (hidden, weight))
        head = FusedLMHead(w, backend="naive" if dtype == torch.float64 else "chunked", chunk_size=4)
        entropy = head(h, targets, ("entropy",)).entropy
        loss = _loss(path, head, h, targets, [u.to(dtype) for u in upstream])
        results[dtype] = (entropy.double(), *(x.double() for x in torch.autograd.grad(loss, (h, w))))
    entropy = results[torch.float32][0]
    torch.testing.assert_close(
        entropy[:3], torch.full((3,), math.log(50), dtype=torch.float64), rtol=0, atol=1e-6
    )
    assert entropy[3:].abs().max() < 1e-6
    for got, ref in zip(results[torch.float32], results[torch.float64], strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_entropy_of_near_one_hot_rows_does_not_depend_on_the_target(entropy_kernel):
    """H ≈ 1e-22 whether the target is the likely token or one at log p ≈ −60: H is read relative to each
    row's most probable token, not the target (never negative, never off by the target's rounding)."""
    n, d, V = 64, 8, 256
    g = torch.Generator().manual_seed(0)
    hidden = torch.zeros(n, d)
    hidden[:, 0], hidden[:, 1] = 1.0, torch.rand(n, generator=g)
    weight = torch.zeros(V, d)
    weight[:, 0] = -29.7 + 0.01 * torch.randn(V, generator=g)
    weight[5, 0] = 30.3
    weight[:, 1] = 0.001 * torch.randn(V, generator=g)
    head = FusedLMHead(weight, backend="chunked", chunk_size=16)
    ref = FusedLMHead(weight.double(), backend="naive")(
        hidden.double(), torch.full((n,), 9), "entropy"
    ).entropy
    for target in (5, 9):
        entropy = head(hidden, torch.full((n,), target), ("entropy",)).entropy
        assert entropy.min() >= 0
        torch.testing.assert_close(entropy.double(), ref, rtol=1e-4, atol=1e-12)


def test_eager_entropy_paths_halve_the_tokens_per_chunk_on_cpu(monkeypatch):
    """The eager entropy passes keep ``log p`` and ``p`` (two ``[chunk, V]`` tensors): on CPU half the
    tokens of a default chunk, the same memory as the other paths. Chunks the compiled kernels take keep
    one work tensor and the full size. An explicit chunk size is kept."""
    head = FusedLMHead(torch.zeros(128256, 8))
    assert chunk_size_for(head, 4096) == default_chunk_size(4096, 128256) == 261
    monkeypatch.setattr(entropy_kernels, "_failed", {})
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    monkeypatch.setenv(entropy_kernels.ENV_SWITCH, "1")
    assert chunk_size_for(head, 4096, with_entropy=True) == 261
    assert chunk_size_for(FusedLMHead(torch.zeros(4096, 8)), 4096, with_entropy=True) == 1024  # eager, fits
    monkeypatch.setenv(entropy_kernels.ENV_SWITCH, "0")
    assert chunk_size_for(head, 4096, with_entropy=True) == 130
    assert chunk_size_for(FusedLMHead(torch.zeros(128256, 8), chunk_size=64), 4096, with_entropy=True) == 64


@pytest.mark.parametrize("path", ENTROPY_PATHS)
def test_compiled_entropy_kernels_against_float64(path, entropy_kernel):
    """Both kernels on odd chunks (8 tokens, remainders of 5 and of 1 row, which the eager passes take),
    repeated targets, ignored positions, a chunk whose entropy gradient is zero, with and without bias:
    float64 through the kernels to 1e-11 of the naive head; fp32 with logits of a few hundred to 1e-5
    of float64."""
    for n in (35, 40):  # 29 and 33 valid tokens
        hidden, weight, b, targets = problem(n=n, d=12, v=192, ignore_every=6)
        targets[targets != -100] = torch.tensor([3, 3, 7, 3, 9, 3] * 6)[: int((targets != -100).sum())]
        upstream = [
            torch.randn(targets.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
            for i in range(3)
        ]
        upstream[2][:10] = 0.0  # the first chunk's valid tokens: no entropy gradient
        for bias in (b, None):
            inputs = [x for x in (hidden, weight, bias) if x is not None]
            ref = _loss(path, FusedLMHead(weight, bias, backend="naive"), hidden, targets, upstream)
            ref_grads = torch.autograd.grad(ref, inputs)
            head = FusedLMHead(weight, bias, backend="chunked", chunk_size=8)
            loss = _loss(path, head, hidden, targets, upstream)
            for got, want in zip((loss, *torch.autograd.grad(loss, inputs)), (ref, *ref_grads), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12)
    inputs32 = [x.detach().float().requires_grad_() for x in (hidden, weight * 80.0, b)]
    loss = _loss(
        path,
        FusedLMHead(*inputs32[1:], backend="chunked", chunk_size=8),
        inputs32[0],
        targets,
        [u.float() for u in upstream],
    )
    grads = torch.autograd.grad(loss, inputs32)
    inputs64 = [x.detach().double().requires_grad_() for x in inputs32]
    ref = _loss(path, FusedLMHead(*inputs64[1:], backend="naive"), inputs64[0], targets, upstream)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, torch.autograd.grad(ref, inputs64), strict=True):
        scale = want.abs().max()
        torch.testing.assert_close(got.double() / scale, want / scale, rtol=1e-5, atol=1e-5)
    if entropy_kernel:
        assert set(entropy_kernel) == {"_entropy_kernel", "_entropy_grad_kernel_"}


@pytest.mark.parametrize("path", ENTROPY_PATHS)
def test_compiled_entropy_at_a_production_vocabulary(path, compiled_kernels, monkeypatch):
    """V = 32768 at the default threshold (chunks of 512 rows and a remainder of 1), against float64: the
    entropy (uniform rows: log V) and the gradients are as close as the eager passes' (Inductor's
    kernel for long rows is not the one the small-V tests run; an fp32 sum over them was 100× worse),
    with one ``[chunk, V]`` work tensor (no ``p``) for the chunks the kernels take."""
    V, n = 32768, 513
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, 8, generator=g)
    hidden[:4] = 0.0  # uniform rows
    weight = torch.randn(V, 8, generator=g)
    targets = torch.randint(0, V, (n,), generator=g)
    upstream = [
        torch.randn(n, generator=torch.Generator().manual_seed(i), dtype=torch.float64) for i in range(3)
    ]
    h64, w64 = (x.double().requires_grad_() for x in (hidden, weight))
    ref_head = FusedLMHead(w64, backend="naive")
    ref_entropy = ref_head(h64, targets, ("entropy",)).entropy.detach()
    torch.testing.assert_close(ref_entropy[:4], torch.full((4,), math.log(V), dtype=torch.float64))
    ref = _loss(path, ref_head, h64, targets, upstream)
    ref_grads = torch.autograd.grad(ref, (h64, w64))

    def errors():
        """Relative errors of the fp32 chunked head against float64: entropy (uniform rows, other rows),
        loss, ∂/∂hidden, ∂/∂W."""
        h32, w32 = (x.clone().requires_grad_() for x in (hidden, weight))
        head = FusedLMHead(w32, backend="chunked", chunk_size=512)
        entropy = head(h32, targets, ("entropy",)).entropy
        loss = _loss(path, head, h32, targets, [u.float() for u in upstream])
        grads = torch.autograd.grad(loss, (h32, w32))
        entropies = [(entropy[:4], ref_entropy[:4]), (entropy[4:], ref_entropy[4:])]
        pairs = [*entropies, (loss, ref), *zip(grads, ref_grads, strict=True)]
        return [float((got.double() - want).abs().max() / want.abs().max()) for got, want in pairs]

    taken = []
    take = chunked_ops.LogitScratch.take
    monkeypatch.setattr(
        chunked_ops.LogitScratch,
        "take",
        lambda self, name, rows: taken.append((name, rows)) or take(self, name, rows),
    )
    compiled = errors()
    assert {rows for name, rows in taken if name == "probs"} == {1}  # only the 1-row remainder's eager pass
    assert set(compiled_kernels) == {"_entropy_kernel", "_entropy_grad_kernel_"}
    monkeypatch.setenv(entropy_kernels.ENV_SWITCH, "0")
    eager = errors()
    assert max(compiled) < 1e-4, (compiled, eager)
    for c, e in zip(compiled, eager, strict=True):
        assert c <= 2 * e + 1e-7, (compiled, eager)


def test_compiled_entropy_in_inference_mode(entropy_kernel):
    """Validation runs under ``torch.inference_mode``: the entropy kernel runs there too."""
    hidden, weight, b, targets = problem(n=21, v=192)
    ref = FusedLMHead(weight, b, backend="naive")(hidden, targets, ("entropy",)).entropy
    with torch.inference_mode():
        got = FusedLMHead(weight.float(), b.float(), backend="chunked", chunk_size=8)(
            hidden.float(), targets, ("entropy",)
        )
    torch.testing.assert_close(got.entropy.double(), ref.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ENTROPY_PATHS)
@pytest.mark.parametrize("broken", ["_entropy_kernel", "_entropy_grad_kernel_"])
def test_a_failed_compile_warns_once_and_the_eager_passes_take_over(
    broken, path, compiled_kernels, monkeypatch
):
    """A kernel that cannot be compiled (no C++ compiler, say): one warning naming the error, the eager
    passes from then on (the per-token path's backward and the fused pointwise path), the same exact
    result."""
    monkeypatch.setattr(entropy_kernels, "COMPILE_MIN_LOGITS", 1)
    compiled = entropy_kernels._compiled

    def compile_or_fail(kernel):
        if kernel.__name__ != broken:
            return compiled(kernel)

        def fail(*args):
            raise RuntimeError("no C++ compiler found\n(details)")

        return fail

    monkeypatch.setattr(entropy_kernels, "_compiled", compile_or_fail)
    hidden, weight, b, targets = problem(n=30, v=192)
    upstream = [
        torch.randn(30, generator=torch.Generator().manual_seed(i), dtype=torch.float64) for i in range(3)
    ]
    ref = _loss(path, FusedLMHead(weight, b, backend="naive"), hidden, targets, upstream)
    ref_grads = torch.autograd.grad(ref, (hidden, weight, b))
    head = FusedLMHead(weight, b, backend="chunked", chunk_size=8)
    with pytest.warns(
        RuntimeWarning,
        match=r"could not compile or run the entropy kernels on cpu \(RuntimeError: no C\+\+ "
        r"compiler found\); using the eager passes",
    ) as record:
        for _ in range(2):
            loss = _loss(path, head, hidden, targets, upstream)
            grads = torch.autograd.grad(loss, (hidden, weight, b))
            for got, want in zip((loss, *grads), (ref, *ref_grads), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12)
    assert len([w for w in record if "could not compile or run" in str(w.message)]) == 1
    assert not entropy_kernels.use_compiled_entropy_kernels(torch.device("cpu"), 10**6, 10**6)
    # a failed C++ build leaves CUDA's Triton kernels on (and the reverse)
    assert entropy_kernels.use_compiled_entropy_kernels(torch.device("cuda"), 10**6, 10**6)
    entropy_kernels._failed.clear()  # the fixture's check is about unexpected failures


def test_running_out_of_memory_in_a_kernel_is_raised_not_taken_for_a_failed_compile(
    compiled_kernels, monkeypatch
):
    """An out-of-memory error inside a kernel reaches the caller, and the kernels stay on."""

    def out_of_memory(kernel):
        def run(*args):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

        return run

    monkeypatch.setattr(entropy_kernels, "_compiled", out_of_memory)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="out of memory"):
        entropy_kernels.entropy(torch.zeros(4, 8))
    assert not entropy_kernels._failed
    assert entropy_kernels.use_compiled_entropy_kernels(torch.device("cpu"), 10**6, 10**6)


@pytest.mark.parametrize("switch", [("LIT_LOSSES_COMPILE_KERNELS", "off"), ("TORCH_COMPILE_DISABLE", "1")])
def test_switches_keep_the_eager_passes(switch, monkeypatch):
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    monkeypatch.setattr(entropy_kernels, "_failed", {})
    monkeypatch.setenv(entropy_kernels.ENV_SWITCH, "1")
    cpu = torch.device("cpu")
    assert entropy_kernels.use_compiled_entropy_kernels(cpu, 512, 32768)
    assert not entropy_kernels.use_compiled_entropy_kernels(cpu, 511, 32768)  # below the threshold
    assert not entropy_kernels.use_compiled_entropy_kernels(torch.device("meta"), 512, 32768)  # CPU only
    monkeypatch.setenv(*switch)
    assert not entropy_kernels.use_compiled_entropy_kernels(cpu, 512, 32768)


def test_at_the_recompile_limit_the_eager_passes_take_those_inputs_only(compiled_kernels, monkeypatch):
    """Dynamo refusing a new build (its recompile limit) is not a failed compile: one warning, the eager
    passes for that call, the kernels stay on for the inputs they were built for."""
    monkeypatch.setattr(entropy_kernels, "COMPILE_MIN_LOGITS", 1)
    compiled = entropy_kernels._compiled

    def refuse_float64(kernel):
        def call(log_p, *rest):
            if log_p.dtype == torch.float64:
                raise RuntimeError("FailOnRecompileLimitHit: recompile_limit reached with fullgraph=True")
            return compiled(kernel)(log_p, *rest)

        return call

    monkeypatch.setattr(entropy_kernels, "_compiled", refuse_float64)
    hidden, weight, b, targets = problem(n=30, v=192)
    ref = FusedLMHead(weight, b, backend="naive")(hidden, targets, ("entropy",)).entropy.detach()
    with pytest.warns(RuntimeWarning, match="reached torch.compile's recompile limit"):
        got = FusedLMHead(weight, b, backend="chunked", chunk_size=8)(hidden, targets, ("entropy",)).entropy
    torch.testing.assert_close(got.detach(), ref, rtol=1e-12, atol=1e-13)
    assert not entropy_kernels._failed and not compiled_kernels  # eager, and not switched off
    FusedLMHead(weight.float(), b.float(), backend="chunked", chunk_size=8)(
        hidden.float(), targets, ("entropy",)
    )
    assert compiled_kernels  # fp32 inputs still take the kernels


# ---- bad input -------------------------------------------------------------------------------
def test_target_out_of_range_names_value_and_vocab():
    hidden, weight, b, targets = problem(v=101)
    targets[3] = 101
    with pytest.raises(ValueError, match=r"target 101 .*V=101"):
        FusedLMHead(weight, b)(hidden, targets)
    targets[3] = -7
    with pytest.raises(ValueError, match=r"target -7"):
        FusedLMHead(weight, b)(hidden, targets)


def test_width_mismatch_names_both_shapes():
    hidden, weight, b, targets = problem(d=16)
    with pytest.raises(ValueError, match=r"\(37, 15\).*\(101, 16\)"):
        FusedLMHead(weight, b)(hidden[:, :15], targets)


def test_non_finite_hidden_is_reported_unless_disabled():
    hidden, weight, b, targets = problem()
    bad = hidden.detach().clone()
    bad[2, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        FusedLMHead(weight, b)(bad, targets)
    out = FusedLMHead(weight, b, check_finite=False)(bad, targets)
    assert out.logprobs.isnan().any()


def test_unsupported_output_names_a_backend_that_can():
    hidden, weight, b, targets = problem(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"'torch' cannot give \['entropy'\].*chunked"):
        FusedLMHead(weight, b, backend="torch")(hidden, targets, ("logprobs", "entropy"))
    with pytest.raises(ValueError, match="unknown head backend"):
        FusedLMHead(weight, b, backend="fast")
    with pytest.raises(ValueError, match="unknown head output"):
        FusedLMHead(weight, b)(hidden, targets, ("logits",))


def test_liger_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the liger backend is tested in test_liger.py")
    hidden, weight, b, targets = problem(dtype=torch.float32)
    with pytest.raises(RuntimeError, match="liger"):
        FusedLMHead(weight, b, backend="liger").weighted_ce(hidden, targets, 1.0)


def test_forward_logits_is_the_linear_map():
    hidden, weight, b, _ = problem()
    torch.testing.assert_close(FusedLMHead(weight, b).forward_logits(hidden), hidden @ weight.T + b)
