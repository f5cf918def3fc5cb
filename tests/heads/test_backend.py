"""Every registered head backend against a float64 reference written here (plain ``F.linear`` +
``log_softmax``): per-token outputs, ``weighted_ce`` and ``pointwise_loss``, values and gradients, each
through `FusedLMHead` and through the functional API (``linear_logprobs``, ``linear_cross_entropy``,
``linear_pointwise_loss``).

The cases are generated from `HEAD_BACKENDS`, so a newly registered backend is tested by this file without
editing it. A backend that is not available here (``torch`` without `F.linear_cross_entropy`, ``liger``
without CUDA and Liger-Kernel) is skipped; a ``cuda_only`` backend runs on CUDA. The backends over other
libraries' kernels with a narrower contract (``liger_scaled``, ``cce``) have their own files.
"""

from typing import get_args

import pytest
import torch
import torch.nn.functional as F

from lit_losses.heads import (
    BACKEND_OUTPUTS,
    BACKENDS,
    HEAD_BACKENDS,
    Backend,
    FusedLMHead,
    HeadBackend,
    linear_cross_entropy,
    linear_logprobs,
    linear_pointwise_loss,
)
from lit_losses.heads.backend import select_backend, valid_tokens
from lit_losses.heads.naive import naive_per_token
from lit_losses.heads.output import HEAD_OUTPUTS

IGNORE = -100
DTYPES = [torch.float64, torch.float32]
BIAS = [True, False]
APIS = ["module", "functional"]


def tolerance(dtype, name=None):
    """float64 to 1e-10, except Liger's kernel, which computes in fp32 whatever its inputs."""
    exact = dtype == torch.float64 and name != "liger"
    return dict(rtol=1e-10, atol=1e-10) if exact else dict(rtol=1e-5, atol=1e-5)


#: Backends over other libraries' kernels with a narrower contract (no bias; bf16 operands; no float64):
#: tested against float64 on CUDA in ``test_cuda_peers.py``, their refusals in ``test_peer_backends.py``.
PEER_KERNELS = ("liger_scaled", "cce")
#: The backends this tester takes through every case.
TESTED_HERE = [name for name in HEAD_BACKENDS.names() if name not in PEER_KERNELS]


def usable(name):
    """The backend ``name`` and the device it runs on; skips when it cannot run here (no GPU)."""
    backend = HEAD_BACKENDS[name]
    if backend.cuda_only and not torch.cuda.is_available():
        pytest.skip(f"head backend {name!r} needs CUDA")
    if not backend.available():
        pytest.skip(f"head backend {name!r} is not available here")
    return backend, ("cuda" if backend.cuda_only else "cpu")


def problem(dtype, bias, device="cpu", shape=(3, 13), d=16, v=101, seed=0):
    """Leaves ``(hidden [*shape, D], weight [V, D], bias [V] | None)`` in ``dtype`` with ignored positions."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, d, generator=g, dtype=torch.float64)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64) * 0.5
    b = torch.randn(v, generator=g, dtype=torch.float64) * 0.1 if bias else None
    targets = torch.randint(0, v, shape, generator=g)
    targets.view(-1)[::5] = IGNORE
    leaves = [None if x is None else x.to(device, dtype).requires_grad_() for x in (hidden, weight, b)]
    return (*leaves, targets.to(device))


def float64_leaves(leaves):
    """The same values as float64 leaves of their own (the reference's inputs)."""
    return [None if x is None else x.detach().double().requires_grad_() for x in leaves]


def reference(hidden, weight, bias, targets):
    """Per-token ``logprobs``, ``lse``, ``entropy`` from full logits (0 at ignored positions)."""
    logits = F.linear(hidden, weight, bias)
    logp = F.log_softmax(logits, dim=-1)
    valid = targets != IGNORE
    values = {
        "logprobs": logp.gather(-1, targets.clamp_min(0)[..., None])[..., 0],
        "lse": logits[..., 0] - logp[..., 0],
        "entropy": -(logp.exp() * logp).sum(-1),
    }
    return {name: torch.where(valid, value, 0.0) for name, value in values.items()}


def grads(loss, leaves):
    present = [x for x in leaves if x is not None]
    return torch.autograd.grad(loss, present)


def assert_matches(loss, leaves, ref_loss, ref_leaves, dtype, name=None):
    """``loss`` and its gradients w.r.t. ``leaves`` against the float64 reference; the gradients."""
    tol = tolerance(dtype, name)
    torch.testing.assert_close(loss.double(), ref_loss, **tol)
    got_grads = grads(loss, leaves)
    for got, ref in zip(got_grads, grads(ref_loss, ref_leaves), strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), ref, **tol)
    return got_grads


def upstream(targets, names, seed=1):
    """A random float64 weight per position for each output (the upstream gradient)."""
    g = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(targets.shape, generator=g, dtype=torch.float64).to(targets.device)
        for name in names
    }


def output_cases():
    """``(backend, outputs)``: each output a registered backend declares alone, and all of them together."""
    cases = []
    for name in TESTED_HERE:
        declared = HEAD_BACKENDS[name].outputs
        cases += [pytest.param(name, (o,), id=f"{name}-{o}") for o in declared]
        if len(declared) > 1:
            cases.append(pytest.param(name, declared, id=f"{name}-all"))
    return cases


# ---- per-token outputs -------------------------------------------------------------------------
def check_per_token(name, outputs, dtype, bias, v=101, api="module"):
    _, device = usable(name)
    *leaves, targets = problem(dtype, bias, device, v=v)
    ref_leaves = float64_leaves(leaves)
    hidden, weight, b = leaves
    if api == "module":
        out = FusedLMHead(weight, b, backend=name, chunk_size=8)(hidden, targets, outputs)
    else:
        out = linear_logprobs(hidden, weight, targets, b, outputs=outputs, backend=name, chunk_size=8)
    ref = reference(*ref_leaves, targets)
    g = upstream(targets, outputs)
    ignored = targets == IGNORE
    for field in ("logprobs", "lse", "entropy"):
        value = getattr(out, field)
        if field not in outputs:
            assert value is None
            continue
        assert value.shape == targets.shape
        assert bool((value[ignored] == 0).all())
        torch.testing.assert_close(value.double(), ref[field], **tolerance(dtype))
    loss = sum((getattr(out, k) * g[k].to(dtype)).sum() for k in outputs)
    ref_loss = sum((ref[k] * g[k]).sum() for k in outputs)
    grad_hidden = assert_matches(loss, leaves, ref_loss, ref_leaves, dtype)[0]
    assert bool((grad_hidden[ignored] == 0).all())  # ignored positions get no gradient


@pytest.mark.parametrize("bias", BIAS, ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("name", "outputs"), output_cases())
@pytest.mark.parametrize("api", APIS)
def test_per_token_outputs_match_the_reference(api, name, outputs, dtype, bias):
    check_per_token(name, outputs, dtype, bias, api=api)


@pytest.mark.parametrize("name", ["chunked", "vocab_parallel"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_entropy_with_a_vocabulary_the_blocked_row_dot_reads(name, dtype):
    """V = 192, a multiple of the 64-column blocks of the entropy's row dot (V = 101 above takes vecdot)."""
    check_per_token(name, ("logprobs", "lse", "entropy"), dtype, True, v=192)


@pytest.mark.parametrize(
    "name", [n for n in HEAD_BACKENDS.names() if set(HEAD_BACKENDS[n].outputs) != set(HEAD_OUTPUTS)]
)
def test_undeclared_outputs_are_refused(name):
    missing = [o for o in HEAD_OUTPUTS if o not in HEAD_BACKENDS[name].outputs]
    *leaves, targets = problem(torch.float32, False)
    head = FusedLMHead(leaves[1], backend=name)
    with pytest.raises(ValueError, match=rf"{name!r} cannot give"):
        head(leaves[0], targets, missing)
    assert BACKEND_OUTPUTS[name] == HEAD_BACKENDS[name].outputs


# ---- plain cross-entropy -----------------------------------------------------------------------
def weighted_ce(api, name, leaves, targets, w):
    """``Σ_t w_t · (−log p_t[y_t])`` with ``FusedLMHead.weighted_ce`` or ``linear_cross_entropy``."""
    hidden, weight, bias = leaves
    if api == "module":
        return FusedLMHead(weight, bias, backend=name, chunk_size=8).weighted_ce(hidden, targets, w)
    options = dict(token_weights=w, reduction="sum", backend=name, chunk_size=8)
    return linear_cross_entropy(hidden, weight, targets, bias, **options)


def check_weighted_ce(name, uniform, dtype, bias, api="module"):
    backend, device = usable(name)
    *leaves, targets = problem(dtype, bias, device)
    ref_leaves = float64_leaves(leaves)
    w = 0.37 if uniform else torch.rand(targets.shape, generator=torch.Generator().manual_seed(2)).double()
    w_backend = w if uniform else w.to(device, dtype)
    if backend.fused_ce is not None and not backend.takes_weights(uniform):
        with pytest.raises(ValueError, match="one weight for every token"):
            weighted_ce(api, name, leaves, targets, w_backend)
        return
    loss = weighted_ce(api, name, leaves, targets, w_backend) * 1.7
    ref_w = w if uniform else w.to(device)
    ref_loss = -(ref_w * reference(*ref_leaves, targets)["logprobs"]).sum() * 1.7
    assert_matches(loss, leaves, ref_loss, ref_leaves, dtype, name)


@pytest.mark.parametrize("bias", BIAS, ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("uniform", [True, False], ids=["uniform", "per_token"])
@pytest.mark.parametrize("name", TESTED_HERE)
@pytest.mark.parametrize("api", APIS)
def test_weighted_ce_matches_the_reference(api, name, uniform, dtype, bias):
    check_weighted_ce(name, uniform, dtype, bias, api=api)


@pytest.mark.parametrize("name", TESTED_HERE)
def test_linear_cross_entropy_mean_is_torchs_cross_entropy(name):
    _, device = usable(name)
    *leaves, targets = problem(torch.float64, True, device)
    ref_leaves = float64_leaves(leaves)
    loss = linear_cross_entropy(leaves[0], leaves[1], targets, leaves[2], backend=name, chunk_size=8)
    ref_loss = F.cross_entropy(F.linear(*ref_leaves).flatten(0, -2), targets.flatten(), ignore_index=IGNORE)
    assert_matches(loss, leaves, ref_loss, ref_leaves, torch.float64, name)
    none_valid = torch.full_like(targets, IGNORE)
    assert float(linear_cross_entropy(leaves[0], leaves[1], none_valid, backend=name).detach()) == 0.0


# ---- pointwise losses --------------------------------------------------------------------------
def chunk_loss(s, e, lp, lse, ent):
    loss = (lp * 2 + 0.1 * lse**2).sum()
    return loss if ent is None else loss + 0.3 * ent.sum()


def pointwise_loss(api, name, leaves, targets, with_entropy):
    """``Σ chunk_loss`` with ``FusedLMHead.pointwise_loss`` or ``linear_pointwise_loss``."""
    hidden, weight, bias = leaves
    if api == "module":
        head = FusedLMHead(weight, bias, backend=name, chunk_size=8)
        return head.pointwise_loss(hidden, targets, chunk_loss, with_entropy=with_entropy)
    options = dict(with_entropy=with_entropy, backend=name, chunk_size=8)
    return linear_pointwise_loss(hidden, weight, targets, chunk_loss, bias, **options)


def check_pointwise(name, with_entropy, dtype, bias, api="module"):
    backend, device = usable(name)
    *leaves, targets = problem(dtype, bias, device)
    ref_leaves = float64_leaves(leaves)
    needed = ("logprobs", "lse", "entropy") if with_entropy else ("logprobs", "lse")
    # a backend computes it fused, from its per-token outputs, or (no per-token mode) delegates to chunked
    if backend.fused_pointwise is None and backend.outputs and not backend.gives(needed):
        with pytest.raises(ValueError, match="cannot give"):
            pointwise_loss(api, name, leaves, targets, with_entropy)
        return
    loss = pointwise_loss(api, name, leaves, targets, with_entropy)
    ref = reference(*ref_leaves, targets)
    valid = targets != IGNORE
    ent = ref["entropy"][valid] if with_entropy else None
    ref_loss = chunk_loss(0, int(valid.sum()), ref["logprobs"][valid], ref["lse"][valid], ent)
    assert_matches(loss, leaves, ref_loss, ref_leaves, dtype)


@pytest.mark.parametrize("bias", BIAS, ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_entropy", [False, True], ids=["lp_lse", "lp_lse_entropy"])
@pytest.mark.parametrize("name", TESTED_HERE)
@pytest.mark.parametrize("api", APIS)
def test_pointwise_loss_matches_the_reference(api, name, with_entropy, dtype, bias):
    check_pointwise(name, with_entropy, dtype, bias, api=api)


# ---- the registry and the choice of backend ---------------------------------------------------
def test_backend_names_are_the_literal_and_all_registered():
    assert get_args(Backend) == BACKENDS
    assert BACKENDS[0] == "auto"
    assert set(BACKENDS[1:]) <= set(HEAD_BACKENDS.names())
    assert set(BACKEND_OUTPUTS) == set(HEAD_BACKENDS.names())


def test_auto_on_cpu_is_blocked_for_per_token_outputs_and_chunked_for_the_fused_losses():
    assert select_backend("auto", "per_token", outputs=("logprobs", "entropy")).backend.name == "blocked"
    for uniform in (True, False):
        route = select_backend("auto", "weighted_ce", uniform=uniform, on_cuda=False)
        assert (route.backend.name, route.fused) == ("chunked", True)
    route = select_backend("auto", "pointwise", outputs=("logprobs", "lse"))
    assert (route.backend.name, route.fused) == ("chunked", True)


@pytest.fixture
def scratch_registry():
    """`HEAD_BACKENDS` with what a test registers removed afterwards."""
    with HEAD_BACKENDS.scoped() as registry:
        yield registry


def test_a_newly_registered_backend_is_usable_by_name(scratch_registry):
    """What the parametrized tests above run for every registered backend, on one registered here."""
    scratch_registry.register(
        "reference_copy",
        HeadBackend(name="reference_copy", outputs=("logprobs", "lse"), per_token=naive_per_token),
    )
    assert BACKEND_OUTPUTS["reference_copy"] == ("logprobs", "lse")
    check_per_token("reference_copy", ("logprobs", "lse"), torch.float64, True)
    check_weighted_ce("reference_copy", False, torch.float64, True)
    check_pointwise("reference_copy", False, torch.float64, False)
    check_pointwise("reference_copy", True, torch.float64, False)  # no entropy: refused


def test_backend_descriptions_are_checked():
    with pytest.raises(ValueError, match="unknown outputs"):
        HeadBackend(name="x", outputs=("logits",), per_token=naive_per_token)
    with pytest.raises(ValueError, match="per_token exactly when"):
        HeadBackend(name="x", outputs=("logprobs",))
    with pytest.raises(ValueError, match="auto_ce needs"):
        HeadBackend(name="x", outputs=("logprobs",), per_token=naive_per_token, auto_ce=True)
    with pytest.raises(TypeError, match="must be a HeadBackend"):
        HEAD_BACKENDS.register("x", naive_per_token)


@pytest.mark.parametrize("contiguous", [True, False])
def test_valid_tokens_are_the_masked_rows_in_row_major_order(contiguous):
    """One index gathers the valid rows of a tensor whose rows are one view; a slice of longer rows (no
    such view) is read through the mask: both give the rows ``hidden[targets != ignore_index]``, and
    gradients flow back to exactly those rows."""
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 7, 5, generator=g, requires_grad=True)
    hidden = full if contiguous else full[:, :-1]
    targets = torch.randint(0, 9, hidden.shape[:-1], generator=g)
    targets[targets > 6] = -100
    valid, h, y = valid_tokens(hidden, targets, -100)
    assert torch.equal(valid, targets != -100) and y.dtype == torch.long
    torch.testing.assert_close(h, hidden[valid], rtol=0, atol=0)
    assert torch.equal(y, targets[valid])
    (h * torch.arange(h.shape[0])[:, None]).sum().backward()
    expected = torch.zeros_like(hidden)
    expected[valid] = torch.arange(h.shape[0], dtype=expected.dtype)[:, None].expand(-1, 5)
    got = full.grad if contiguous else full.grad[:, :-1]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
