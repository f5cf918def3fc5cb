"""The backends over other libraries' CUDA kernels (``liger_scaled``: Liger-Kernel's fused linear scaled
cross-entropy; ``cce``: Apple's cut-cross-entropy) against the float64 naive head: values and gradients of
every output they give, under random upstream gradients, with ignored positions; skipped without CUDA or
without the package.

Tolerances: fp32 operands to 1e-5 (relative, as the fp32 ``chunked`` backend); bf16 operands to a few bf16
roundings: values to 2 units of bf16's relative precision (Liger stores the entropy in bf16 and its SM90
kernel rounds the logits to fp16), gradients against the largest reference gradient (both kernels
accumulate them in bf16).
"""

import pytest
import torch

from lit_losses.heads import FusedLMHead, select_backend
from lit_losses.heads.cce import cce_available
from lit_losses.heads.higher_order import DoubleBackwardError
from lit_losses.heads.liger_scaled import liger_scaled_available

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

IGNORE = -100
DTYPES = [torch.float32, torch.bfloat16]
#: The per-token outputs each backend gives.
GIVES = {"liger_scaled": ("logprobs", "entropy"), "cce": ("logprobs",)}


def needs(name):
    available = {"liger_scaled": liger_scaled_available, "cce": cce_available}[name]
    if not available():
        install = {
            "liger_scaled": "liger-kernel>=0.8.5, and liger-kernel[cutedsl] on compute capability 9.0",
            "cce": "cut-cross-entropy>=25.1",
        }[name]
        pytest.skip(f"head backend {name!r} is not available here: needs {install}")


def takes_fp32(name):
    """cce: bf16/fp16 only; liger_scaled: fp32 except on compute capability 9.0 (its SM90 kernel)."""
    return name == "liger_scaled" and torch.cuda.get_device_capability() != (9, 0)


def problem(dtype, n=300, d=64, v=5000, seed=0):
    """Leaves ``hidden [n, D]``, ``weight [V, D]`` on CUDA in ``dtype``, targets with ignored positions, and
    the same values as float64 leaves (the reference's inputs)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g)
    weight = torch.randn(v, d, generator=g) * 0.2
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::7] = IGNORE
    leaves = [x.to("cuda", dtype).requires_grad_() for x in (hidden, weight)]
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    return leaves, ref_leaves, targets.cuda()


def value_tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)


def assert_grads_close(grads, ref_grads, dtype):
    """Gradients in their leaves' dtype; fp32: elementwise to 1e-5 relative to the largest reference entry,
    bf16: to 4e-2 of it (bf16 operands, and bf16 accumulation: cce adds the hidden states' gradient over
    ~40 vocabulary blocks in bf16, Liger's SM90 kernel reuses its bf16 entropy in backward)."""
    atol = 1e-5 if dtype == torch.float32 else 4e-2
    for got, ref in zip(grads, ref_grads, strict=True):
        assert got.dtype == dtype
        scale = ref.abs().max()
        assert float(scale) > 0
        torch.testing.assert_close(got.double() / scale, ref / scale, rtol=0, atol=atol)


def per_token(name, leaves, targets, outputs):
    hidden, weight = leaves
    return FusedLMHead(weight, backend=name)(hidden, targets, outputs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("name", "outputs"),
    [
        ("liger_scaled", ("logprobs",)),
        ("liger_scaled", ("entropy",)),
        ("liger_scaled", ("logprobs", "entropy")),
        ("cce", ("logprobs",)),
    ],
)
def test_per_token_outputs_and_gradients_match_float64_naive(name, outputs, dtype):
    needs(name)
    leaves, ref_leaves, targets = problem(dtype)
    if dtype == torch.float32 and not takes_fp32(name):
        with pytest.raises(ValueError, match=rf"{name!r} .*float32.*backend='chunked'"):
            per_token(name, leaves, targets, outputs)
        return
    out = per_token(name, leaves, targets, outputs)
    ref = FusedLMHead(ref_leaves[1], backend="naive")(ref_leaves[0], targets, outputs)
    ignored = targets == IGNORE
    g = torch.Generator().manual_seed(1)
    upstream = {k: torch.randn(targets.shape, generator=g, dtype=torch.float64).cuda() for k in outputs}
    for k in outputs:
        value = getattr(out, k)
        assert value.dtype == torch.float32  # promote(operands, fp32)
        assert bool((value[ignored] == 0).all())
        torch.testing.assert_close(value.double(), getattr(ref, k), **value_tol(dtype))
    loss = sum((getattr(out, k) * upstream[k].float()).sum() for k in outputs)
    ref_loss = sum((getattr(ref, k) * upstream[k]).sum() for k in outputs)
    grads = torch.autograd.grad(loss, leaves)
    assert bool((grads[0][ignored] == 0).all())  # ignored positions get no gradient
    assert_grads_close(grads, torch.autograd.grad(ref_loss, ref_leaves), dtype)


@pytest.mark.parametrize("uniform", [True, False], ids=["uniform", "per_token"])
@pytest.mark.parametrize("name", ["liger_scaled", "cce"])
def test_plain_cross_entropy_matches_float64_naive(name, uniform):
    """``weighted_ce``: cce's fused path, liger_scaled's per-token logprobs; bf16 operands (both kernels)."""
    needs(name)
    leaves, ref_leaves, targets = problem(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    w = 0.37 if uniform else torch.rand(targets.shape, generator=g, dtype=torch.float64).cuda()
    loss = FusedLMHead(leaves[1], backend=name).weighted_ce(leaves[0], targets, w)
    ref_loss = FusedLMHead(ref_leaves[1], backend="naive").weighted_ce(ref_leaves[0], targets, w)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-2, atol=1e-2)
    grads = torch.autograd.grad(loss * 1.7, leaves)
    assert_grads_close(grads, torch.autograd.grad(ref_loss * 1.7, ref_leaves), torch.bfloat16)


@pytest.mark.parametrize("name", ["liger_scaled", "cce"])
def test_temperature_is_the_heads(name):
    """The head's ``temperature`` (applied before the backend) gives the tempered softmax's outputs."""
    needs(name)
    leaves, ref_leaves, targets = problem(torch.bfloat16)
    out = FusedLMHead(leaves[1], backend=name, temperature=0.7)(leaves[0], targets, GIVES[name])
    ref = FusedLMHead(ref_leaves[1], backend="naive", temperature=0.7)(ref_leaves[0], targets, GIVES[name])
    for k in GIVES[name]:
        torch.testing.assert_close(getattr(out, k).double(), getattr(ref, k), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["liger_scaled", "cce"])
def test_refusals_name_the_backend_and_what_to_use(name):
    needs(name)
    leaves, _, targets = problem(torch.bfloat16)
    hidden, weight = leaves
    bias = torch.zeros(weight.shape[0], device="cuda", dtype=weight.dtype)
    with pytest.raises(ValueError, match=rf"{name!r} has no bias.*backend='chunked'"):
        FusedLMHead(weight, bias, backend=name)(hidden, targets, ("logprobs",))
    with pytest.raises(ValueError, match=rf"{name!r} cannot give \['lse'\]"):
        FusedLMHead(weight, backend=name)(hidden, targets, ("lse",))
    with pytest.raises(ValueError, match=rf"{name!r} takes operands in .*float64"):
        FusedLMHead(weight.double(), backend=name)(hidden.double(), targets, ("logprobs",))
    out = FusedLMHead(weight, backend=name)(hidden, targets, ("logprobs",))
    with pytest.raises(DoubleBackwardError, match=rf"{name!r}"):
        torch.autograd.grad(out.logprobs.sum(), hidden, create_graph=True)


@pytest.mark.parametrize("name", ["liger_scaled", "cce"])
def test_no_valid_token_gives_zeros_and_zero_gradients(name):
    needs(name)
    leaves, _, targets = problem(torch.bfloat16)
    out = FusedLMHead(leaves[1], backend=name)(leaves[0], torch.full_like(targets, IGNORE), GIVES[name])
    loss = sum(getattr(out, k).sum() for k in GIVES[name])
    assert float(loss) == 0.0
    assert all(float(g.abs().sum()) == 0.0 for g in torch.autograd.grad(loss, leaves))


@pytest.mark.parametrize("name", ["liger_scaled", "cce"])
def test_auto_never_picks_them_on_cuda(name):
    needs(name)
    assert FusedLMHead(torch.zeros(8, 4, device="cuda")).resolve_backend(GIVES[name]) != name
    for uniform in (True, False):
        for narrow in (True, False):
            route = select_backend("auto", "weighted_ce", uniform=uniform, on_cuda=True, narrow_weight=narrow)
            assert route.backend.name != name
