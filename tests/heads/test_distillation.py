"""`linear_distillation` against float64 references that materialize both logits (TRL's generalized JSD,
written again in `distillation_reference.py`), against Liger-Kernel's fused linear JSD, and its memory."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_losses.errors import ConfigError
from lit_losses.heads import linear_distillation
from lit_losses.heads.higher_order import DoubleBackwardError
from tests.heads import distillation_reference as ref

ROOT = Path(__file__).resolve().parents[2]
#: (loss, β): every loss, and β ∈ {0, 0.3, 0.5, 1} for jsd
LOSSES = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.0), ("jsd", 0.3), ("jsd", 0.5), ("jsd", 1.0)]
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-9), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def problem(dtype=torch.float64, n=13, ds=5, dt=7, v=37, bias=True, seed=0):
    """Student ``[n, ds]``, teacher ``[n, dt]`` (another width), targets with ignored positions."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, grad=False):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_(grad)

    student = (
        randn(n, ds, grad=True),
        randn(v, ds, scale=0.7, grad=True),
        randn(v, grad=True) if bias else None,
    )
    teacher = (randn(n, dt), randn(v, dt, scale=0.7), randn(v) if bias else None)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::4] = -100
    upstream = torch.randn(n, generator=g, dtype=torch.float64)
    return student, teacher, targets, upstream


def reference(student, teacher, targets, loss, beta, temperature):
    zs, zt = ref.logits(*student), ref.logits(*teacher)
    value = ref.divergence(zs, zt, loss=loss, beta=beta, temperature=temperature)
    return value.masked_fill(targets == -100, 0.0)


def student_grads(value, upstream, student):
    leaves = [x for x in student if x is not None]
    return torch.autograd.grad((value * upstream.to(value.dtype)).sum(), leaves)


def fused(student, teacher, targets, loss, beta, temperature, **options):
    (h_s, w_s, b_s), (h_t, w_t, b_t) = student, teacher
    return linear_distillation(
        h_s,
        w_s,
        h_t,
        w_t,
        loss=loss,
        beta=beta,
        temperature=temperature,
        student_bias=b_s,
        teacher_bias=b_t,
        targets=targets,
        **options,
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize(("loss", "beta"), LOSSES)
def test_values_and_student_gradients_match_the_float64_reference(loss, beta, temperature, dtype):
    bias = temperature != 1.0  # with and without biases, across the temperatures
    student, teacher, targets, upstream = problem(dtype=dtype, bias=bias, seed=int(temperature * 10))
    value = fused(student, teacher, targets, loss, beta, temperature, chunk_size=4)
    expected = reference(student, teacher, targets, loss, beta, temperature)
    assert value.dtype == dtype and value.shape == targets.shape
    torch.testing.assert_close(value.double(), expected, **TOL[dtype])
    grads = student_grads(value, upstream, student)
    expected_grads = student_grads(expected, upstream, student)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got.double(), want.double(), **TOL[dtype])
    assert all(bool(g[targets == -100].eq(0).all()) for g in grads[:1])  # ignored: no gradient


def test_jsd_at_the_ends_is_exactly_each_kl_and_the_kls_ignore_beta():
    student, teacher, targets, _ = problem()
    forward = fused(student, teacher, targets, "forward_kl", 0.5, 1.0)
    assert torch.equal(fused(student, teacher, targets, "jsd", 0.0, 1.0), forward)
    assert torch.equal(fused(student, teacher, targets, "forward_kl", 0.3, 1.0), forward)
    reverse = fused(student, teacher, targets, "reverse_kl", 0.5, 1.0)
    assert torch.equal(fused(student, teacher, targets, "jsd", 1.0, 1.0), reverse)
    near = fused(student, teacher, targets, "jsd", 1e-6, 1.0)  # the mixture formula tends to 0, not to the KL
    assert float(near.detach().abs().max()) < 1e-4 < float(forward.detach().abs().max())


@pytest.mark.parametrize(("loss", "beta"), [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3)])
def test_results_do_not_depend_on_the_chunk_size_nor_on_the_backend(loss, beta):
    student, teacher, targets, upstream = problem(n=23)
    results = []
    for options in ({"chunk_size": 1}, {"chunk_size": 5}, {"chunk_size": 64}, {"backend": "naive"}):
        value = fused(student, teacher, targets, loss, beta, 1.5, **options)
        results.append((value, *student_grads(value, upstream, student)))
    for other in results[1:]:
        for got, want in zip(other, results[0]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_teacher_gets_no_gradient_and_stays_unchanged_even_when_it_requires_grad():
    student, (h_t, w_t, b_t), targets, _ = problem()
    teacher = tuple(x.detach().clone().requires_grad_() for x in (h_t, w_t, b_t))
    before = [x.detach().clone() for x in teacher]
    for backend in ("chunked", "naive"):
        value = fused(student, teacher, targets, "jsd", 0.3, 2.0, backend=backend)
        value.sum().backward()
        assert all(x.grad is None for x in teacher)
        assert all(s.grad is not None for s in student)
    assert all(torch.equal(x, b) for x, b in zip(teacher, before))


def test_without_targets_every_position_counts_and_leading_dimensions_are_kept():
    student, teacher, _, _ = problem(n=12)
    shaped_s = (student[0].detach().reshape(3, 4, -1), *student[1:])
    shaped_t = (teacher[0].reshape(3, 4, -1), *teacher[1:])
    value = fused(shaped_s, shaped_t, None, "reverse_kl", 0.5, 1.0)
    expected = ref.divergence(ref.logits(*student), ref.logits(*teacher), "reverse_kl", 0.5, 1.0)
    assert value.shape == (3, 4)
    torch.testing.assert_close(value.reshape(-1), expected, rtol=1e-12, atol=1e-12)


def test_bf16_inputs_compute_in_fp32():
    student, teacher, targets, _ = problem(dtype=torch.bfloat16)
    value = fused(student, teacher, targets, "jsd", 0.5, 1.0)
    expected = reference(student, teacher, targets, "jsd", 0.5, 1.0)  # from the same bf16 values
    assert value.dtype == torch.float32
    torch.testing.assert_close(value.double(), expected, rtol=1e-5, atol=1e-5)
    value.sum().backward()
    assert student[1].grad.dtype == torch.bfloat16


def test_chunked_refuses_a_second_derivative_and_naive_gives_it():
    student, teacher, targets, _ = problem()
    value = fused(student, teacher, targets, "jsd", 0.5, 1.0)
    with pytest.raises(DoubleBackwardError, match="naive"):
        torch.autograd.grad(value.sum(), student[0], create_graph=True)
    h = student[0]
    value = fused(student, teacher, targets, "jsd", 0.5, 1.0, backend="naive")
    (grad,) = torch.autograd.grad(value.sum(), h, create_graph=True)
    expected = reference(student, teacher, targets, "jsd", 0.5, 1.0)
    (want,) = torch.autograd.grad(expected.sum(), h, create_graph=True)
    torch.testing.assert_close(
        torch.autograd.grad(grad.square().sum(), h)[0], torch.autograd.grad(want.square().sum(), h)[0]
    )


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_agrees_with_liger_fused_linear_jsd_on_cpu(beta):
    """Liger-Kernel's ``LigerFusedLinearJSDLoss`` with soft weight 1 and hard weight 0 is the mean over the
    valid tokens of the same per-token generalized JSD (its β convention is TRL's)."""
    chunked_loss = pytest.importorskip("liger_kernel.chunked_loss")
    student, teacher, targets, _ = problem(dtype=torch.float32, n=20, v=64)
    peer = chunked_loss.LigerFusedLinearJSDLoss(
        weight_hard_loss=0.0, weight_soft_loss=1.0, beta=beta, temperature=2.0, compiled=False, chunk_size=8
    )
    theirs = peer(student[0], student[1], teacher[0], teacher[1], targets, student[2], teacher[2])
    ours = fused(student, teacher, targets, "jsd", beta, 2.0).sum() / (targets != -100).sum()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    for got, want in zip(torch.autograd.grad(ours, student), torch.autograd.grad(theirs, student)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bad_inputs_raise_one_clear_error():
    student, teacher, targets, _ = problem()
    wide = (teacher[0], torch.zeros(40, 7, dtype=torch.float64), None)
    with pytest.raises(ValueError, match=r"student's vocabulary has V=37 .* teacher's V=40"):
        fused(student, wide, targets, "forward_kl", 0.5, 1.0)
    with pytest.raises(ConfigError, match=r"beta must be in \[0, 1\], got 1.5"):
        fused(student, teacher, targets, "jsd", 1.5, 1.0)
    for temperature in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature must be finite and > 0"):
            fused(student, teacher, targets, "jsd", 0.5, temperature)
    with pytest.raises(ConfigError, match="did you mean 'reverse_kl'"):
        fused(student, teacher, targets, "reverse_k", 0.5, 1.0)
    with pytest.raises(ValueError, match=r"student_hidden.shape=.* and teacher_hidden.shape=.* differ"):
        fused(student, (teacher[0][:5], *teacher[1:]), None, "jsd", 0.5, 1.0)
    with pytest.raises(ValueError, match=r"teacher_hidden width 6 .* teacher_weight width 7"):
        fused(student, (teacher[0][:, :6], *teacher[1:]), None, "jsd", 0.5, 1.0)
    nan_teacher = (teacher[0].clone().fill_(float("nan")), *teacher[1:])
    with pytest.raises(ValueError, match=r"teacher_hidden .* non-finite"):
        fused(student, nan_teacher, targets, "jsd", 0.5, 1.0)


def measure(loss, n):
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "distillation.py"),
        "--one",
        f"fused:{loss}",
        "--shape",
        f"{n}x256x65536",
        "--chunk-size",
        "256",
        "--no-warmup",
    ]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_memory_is_the_gradient_and_two_chunks_and_grows_with_tokens_as_n_times_d():
    """N = 512, D = 256, V = 65536 fp32, chunk 256: one forward + backward adds at most 3 x (the student
    weight's gradient + two fp32 chunks of 256 x V) to the subprocess's peak RSS above its inputs; from
    N = 256 to 512 it adds O(N·D) (256 more tokens x V would be 64 MiB)."""
    big, small = measure("jsd", 512), measure("jsd", 256)
    assert big["floor_mib"] == 64 + 128
    assert big["ratio"] <= 3.0, big
    assert big["added_mib"] - small["added_mib"] < 8, (small, big)


@pytest.mark.parametrize("backend", ["chunked", "naive"])
def test_return_top1_tells_where_the_two_argmaxes_agree(backend):
    student, teacher, targets, _ = problem(n=40, v=7)  # a small vocabulary: some positions agree
    values, agree = fused(student, teacher, targets, "jsd", 0.5, 2.0, backend=backend, return_top1=True)
    zs, zt = ref.logits(*student), ref.logits(*teacher)
    expected = (zs.argmax(-1) == zt.argmax(-1)) & (targets != -100)
    assert agree.dtype == torch.bool and torch.equal(agree, expected)
    assert 0 < int(expected.sum()) < int((targets != -100).sum())
    assert torch.equal(values, fused(student, teacher, targets, "jsd", 0.5, 2.0, backend=backend))


@pytest.mark.parametrize(("loss", "beta"), [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3)])
def test_token_weights_give_the_weighted_sum_with_gradients_computed_in_forward(loss, beta):
    student, teacher, targets, _ = problem(n=23)
    weights = torch.rand(targets.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    weights[targets == -100] = 1e6  # unused at ignored positions
    per_token = fused(student, teacher, targets, loss, beta, 1.5, chunk_size=5)
    expected = (per_token * weights.masked_fill(targets == -100, 0)).sum()
    want = torch.autograd.grad(expected * 1.7, [x for x in student if x is not None])
    for backend in ("chunked", "naive"):
        total, agree = fused(
            student,
            teacher,
            targets,
            loss,
            beta,
            1.5,
            chunk_size=5,
            backend=backend,
            token_weights=weights,
            return_top1=True,
        )
        assert total.shape == () and agree.shape == targets.shape
        torch.testing.assert_close(total, expected, rtol=1e-12, atol=1e-12)
        got = torch.autograd.grad(total * 1.7, [x for x in student if x is not None])
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_the_weighted_fast_path_refuses_a_second_derivative():
    student, teacher, targets, _ = problem()
    total = fused(student, teacher, targets, "jsd", 0.5, 1.0, token_weights=torch.ones(targets.shape))
    with pytest.raises(DoubleBackwardError, match="token_weights"):
        torch.autograd.grad(total, student[0], create_graph=True)
