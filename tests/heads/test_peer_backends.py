"""The backends over other libraries' CUDA kernels (``liger_scaled``, ``cce``) without a GPU: what they
declare, that ``auto`` never picks them, and their refusals (CPU tensors, a missing package). Their values
and gradients are tested on CUDA (`test_cuda_peers.py`)."""

import sys

import pytest
import torch

from lit_losses.heads import (
    BACKEND_OUTPUTS,
    BACKENDS,
    HEAD_BACKENDS,
    FusedLMHead,
    peer_kernels,
    select_backend,
)
from lit_losses.heads import cce as cce_backend
from lit_losses.heads import liger_scaled as liger_scaled_backend
from lit_losses.heads.peer_kernels import empty_rows, refuse_bias, require_dtype

PEERS = {"liger_scaled": ("logprobs", "entropy"), "cce": ("logprobs",)}


@pytest.mark.parametrize(("name", "outputs"), PEERS.items())
def test_registered_with_their_outputs_cuda_only_and_not_for_auto(name, outputs):
    backend = HEAD_BACKENDS[name]
    assert name in BACKENDS
    assert backend.outputs == outputs == BACKEND_OUTPUTS[name]
    assert backend.cuda_only and not backend.auto_ce and backend.fused_pointwise is None
    assert not backend.available() or torch.cuda.is_available()


def test_cce_has_a_fused_plain_ce_for_any_weights_and_liger_scaled_none():
    assert HEAD_BACKENDS["cce"].takes_weights(uniform=False)
    assert HEAD_BACKENDS["liger_scaled"].fused_ce is None
    assert select_backend("cce", "weighted_ce", uniform=False, on_cuda=True).fused
    assert not select_backend("liger_scaled", "weighted_ce", uniform=False, on_cuda=True).fused


@pytest.mark.parametrize("on_cuda", [False, True])
@pytest.mark.parametrize("narrow_weight", [False, True])
def test_auto_never_picks_them(on_cuda, narrow_weight):
    chosen = {
        select_backend("auto", "per_token", outputs=o, narrow_weight=narrow_weight).backend.name
        for o in PEERS.values()
    }
    for uniform in (True, False):
        route = select_backend(
            "auto", "weighted_ce", uniform=uniform, on_cuda=on_cuda, narrow_weight=narrow_weight
        )
        chosen.add(route.backend.name)
    for with_entropy in (("logprobs", "lse"), ("logprobs", "lse", "entropy")):
        chosen.add(
            select_backend(
                "auto", "pointwise", outputs=with_entropy, narrow_weight=narrow_weight
            ).backend.name
        )
    assert not chosen & set(PEERS)


def cpu_problem(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 8, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(11, 8, generator=g, dtype=dtype, requires_grad=True)
    return hidden, weight, torch.tensor([1, -100, 3, 10, 0])


@pytest.mark.parametrize("name", PEERS)
def test_cpu_tensors_are_refused_naming_the_backend_and_chunked(name):
    hidden, weight, targets = cpu_problem()
    with pytest.raises(RuntimeError, match=rf"{name!r} runs on CUDA tensors only.*backend='chunked'"):
        FusedLMHead(weight, backend=name)(hidden, targets, PEERS[name])
    with pytest.raises(RuntimeError, match=rf"{name!r} runs on CUDA tensors only"):
        FusedLMHead(weight, backend=name).weighted_ce(hidden, targets, torch.rand(5))


@pytest.mark.parametrize("name", PEERS)
def test_outputs_they_cannot_give_are_refused(name):
    hidden, weight, targets = cpu_problem()
    with pytest.raises(ValueError, match=rf"{name!r} cannot give \['lse'\]; use one of .*'chunked'"):
        FusedLMHead(weight, backend=name)(hidden, targets, ("lse",))
    with pytest.raises(ValueError, match=rf"{name!r} cannot give"):
        FusedLMHead(weight, backend=name).pointwise_loss(hidden, targets, lambda *a: a[2].sum())


@pytest.mark.parametrize(
    ("module", "package", "call"),
    [
        (cce_backend, "cut_cross_entropy", lambda h, w, y: cce_backend.cce_logprobs(h, w, y)),
        (
            liger_scaled_backend,
            "liger_kernel",
            lambda h, w, y: liger_scaled_backend.liger_scaled_logprobs_entropy(h, w, y),
        ),
    ],
    ids=["cce", "liger_scaled"],
)
def test_a_missing_package_is_a_runtime_error_saying_what_to_install(monkeypatch, module, package, call):
    for name in [m for m in sys.modules if m == package or m.startswith(f"{package}.")]:
        monkeypatch.setitem(sys.modules, name, None)  # import fails as when not installed (submodules too)
    monkeypatch.setitem(sys.modules, package, None)
    monkeypatch.setattr(peer_kernels, "require_cuda", lambda backend, hidden: None)  # reach the import on CPU
    hidden, weight, targets = cpu_problem()
    with pytest.raises(
        RuntimeError, match=rf"head backend {module.NAME!r} needs .*pip install 'lit_losses\["
    ):
        call(hidden.detach(), weight.detach(), targets.clamp_min(0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not HEAD_BACKENDS[module.NAME].available()


def test_dtype_bias_and_accumulation_refusals():
    hidden = torch.zeros(2, 3)
    with pytest.raises(
        ValueError, match=r"'cce' takes operands in bfloat16, float16 here, got torch.float32"
    ):
        require_dtype("cce", hidden, torch.float32, dtypes=(torch.bfloat16, torch.float16))
    with pytest.raises(ValueError, match=r"accumulates in fp32 at most, but accum_dtype=torch.float64"):
        require_dtype("liger_scaled", hidden, torch.float64, dtypes=(torch.float32,))
    require_dtype("liger_scaled", hidden, torch.float32, dtypes=(torch.float32,))
    refuse_bias("cce", None)
    with pytest.raises(ValueError, match=r"'liger_scaled' has no bias term"):
        refuse_bias("liger_scaled", torch.zeros(3))


def test_no_valid_token_is_an_empty_result_in_the_graph():
    h = torch.zeros(0, 4, requires_grad=True)
    w = torch.randn(6, 4, requires_grad=True)
    out = empty_rows(h, w, torch.float32)
    assert out.shape == (0,) and out.dtype == torch.float32
    gh, gw = torch.autograd.grad(out.sum(), (h, w))
    assert gh.shape == h.shape and float(gw.abs().sum()) == 0.0
