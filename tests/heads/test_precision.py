"""The head under mixed precision: one compute dtype (fp32 for low-precision inputs) for every backend,
autocast or not, in forward and backward; a clear error for dtypes that cannot be reconciled; a frozen
output weight costs no gradient buffer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lit_losses.heads import HEAD_BACKENDS, FusedLMHead
from lit_losses.heads.output import check_head_inputs
from lit_losses.heads.precision import compute_dtype

ROOT = Path(__file__).resolve().parents[2]

IGNORE = -100
LOCAL = [n for n in HEAD_BACKENDS.names() if not HEAD_BACKENDS[n].cuda_only and HEAD_BACKENDS[n].available()]


def problem(hidden_dtype, weight_dtype, bias=True, n=40, d=32, v=257, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, d, generator=g) * 2).to(hidden_dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g) * 0.6).to(weight_dtype).requires_grad_()
    b = (torch.randn(v, generator=g)).to(weight_dtype).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::7] = IGNORE
    return hidden, weight, b, targets


def reference_logprobs(hidden, weight, bias, targets, dtype):
    """``log_softmax`` of logits computed in ``dtype`` from the given (already rounded) inputs."""
    b = None if bias is None else bias.to(dtype)
    logp = F.log_softmax(F.linear(hidden.to(dtype), weight.to(dtype), b), -1)
    picked = logp.gather(-1, targets.clamp_min(0)[:, None])[:, 0]
    return torch.where(targets != IGNORE, picked, 0.0)


PRECISIONS = {  # Lightning precision: (hidden states' dtype, output weight's dtype)
    "bf16-mixed": (torch.bfloat16, torch.float32),
    "bf16-true": (torch.bfloat16, torch.bfloat16),
    "16-mixed": (torch.float16, torch.float32),
    "16-true": (torch.float16, torch.float16),
}


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
@pytest.mark.parametrize("name", LOCAL)
def test_low_precision_inputs_are_as_accurate_as_fp32_logits_from_the_same_inputs(name, precision):
    hidden_dtype, weight_dtype = PRECISIONS[precision]
    hidden, weight, b, targets = problem(hidden_dtype, weight_dtype)
    ref64 = reference_logprobs(hidden, weight, b, targets, torch.float64)
    fp32_error = (reference_logprobs(hidden, weight, b, targets, torch.float32).double() - ref64).abs().max()
    low_error = (reference_logprobs(hidden, weight, b, targets, hidden_dtype).double() - ref64).abs().max()
    with torch.autocast("cpu", dtype=hidden_dtype):  # what Lightning's *-mixed wraps the step in
        out = FusedLMHead(weight, b, backend=name, chunk_size=16)(hidden, targets, "logprobs").logprobs
    assert out.dtype == torch.float32
    error = (out.double() - ref64).abs().max()
    assert error <= 2 * fp32_error + 1e-6, (float(error), float(fp32_error))
    assert low_error > 10 * error  # the test can tell fp32 logits from low-precision ones


@pytest.mark.parametrize("name", LOCAL)
@pytest.mark.parametrize("task", ["per_token", "weighted_ce", "pointwise"])
def test_every_backend_returns_the_compute_dtype_and_input_dtype_gradients(name, task):
    hidden, weight, b, targets = problem(torch.bfloat16, torch.float32)
    head = FusedLMHead(weight, b, backend=name, chunk_size=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if task == "per_token":
            loss = head(hidden, targets, "logprobs").logprobs.sum()
        elif task == "weighted_ce":
            loss = head.weighted_ce(hidden, targets, 0.1)
        else:
            loss = head.pointwise_loss(
                hidden, targets, lambda s, e, lp, lse, ent: lp.sum(), needs=["logprobs"]
            )
    assert loss.dtype == torch.float32
    got = torch.autograd.grad(loss, (hidden, weight, b))
    assert [g.dtype for g in got] == [torch.bfloat16, torch.float32, torch.float32]
    # backward saw the dtypes forward saw: the gradients of fp32 logits from the same inputs
    h32 = hidden.detach().float().requires_grad_()
    ref = -reference_logprobs(h32, weight, b, targets, torch.float32).sum()
    ref = (
        reference_logprobs(h32, weight, b, targets, torch.float32).sum()
        if task != "weighted_ce"
        else ref * 0.1
    )
    want = torch.autograd.grad(ref, (h32, weight, b))
    torch.testing.assert_close(got[0], want[0].bfloat16(), rtol=1e-2, atol=1e-3)
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("outputs", [("logprobs",), ("logprobs", "lse", "entropy")])
def test_chunked_backward_under_autocast_equals_backward_outside(outputs):
    hidden, weight, b, targets = problem(torch.bfloat16, torch.float32)
    head = FusedLMHead(weight, b, backend="chunked", chunk_size=16)
    results = []
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = head(hidden, targets, outputs)
            loss = sum(getattr(out, o).sum() for o in outputs)
            results.append(torch.autograd.grad(loss, (hidden, weight, b)))
    for a, c in zip(*results):
        assert torch.equal(a, c)


def test_irreconcilable_dtypes_name_the_tensor_and_both_dtypes():
    hidden, weight, _, targets = problem(torch.bfloat16, torch.float32)
    with pytest.raises(ValueError, match=r"'weight' has dtype torch.int8.*'hidden' \(dtype torch.bfloat16\)"):
        FusedLMHead(weight.detach().to(torch.int8))(hidden, targets)
    bias = torch.zeros(weight.shape[0], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"'bias' has dtype torch.int32.*'hidden' \(dtype torch.bfloat16\)"):
        FusedLMHead(weight, bias).weighted_ce(hidden, targets, 1.0)
    assert compute_dtype(hidden.double(), weight, None) == torch.float64  # higher precision is kept


class ShapeLog(TorchDispatchMode):
    """Records the shape of every tensor an op returns, and the matmuls."""

    def __init__(self):
        super().__init__()
        self.shapes, self.matmuls, self.operand_dtypes = [], 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.matmuls += 1
            self.operand_dtypes |= {a.dtype for a in args[-2:] if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("task", ["weighted_ce", "pointwise", "per_token"])
def test_a_frozen_output_weight_gets_no_gradient_buffer_nor_matmul(task):
    hidden, weight, b, targets = problem(torch.float32, torch.float32, n=64, v=301)
    chunks = 64 // 16

    def run(w, bias):
        head = FusedLMHead(w, bias, backend="chunked", chunk_size=16)
        with ShapeLog() as log:
            if task == "weighted_ce":
                loss = head.weighted_ce(hidden, targets, 0.1)
            elif task == "pointwise":
                loss = head.pointwise_loss(
                    hidden, targets, lambda s, e, lp, lse, ent: (lp - 0.1 * lse**2).sum()
                )
            else:
                out = head(hidden, targets, ("logprobs", "lse"))
                loss = (out.logprobs - 0.1 * out.lse**2).sum()
            (grad,) = torch.autograd.grad(loss, hidden)
        return grad, log

    grad_trained, log_trained = run(weight, b)
    grad_frozen, log_frozen = run(weight.detach(), b.detach())
    torch.testing.assert_close(grad_frozen, grad_trained, rtol=1e-6, atol=1e-7)
    assert tuple(weight.shape) in log_trained.shapes
    assert tuple(weight.shape) not in log_frozen.shapes  # no V x D gradient buffer
    assert log_trained.matmuls - log_frozen.matmuls == chunks  # one weight-gradient matmul less per chunk


def test_pointwise_loss_asks_a_backend_only_for_the_values_it_needs():
    hidden, weight, b, targets = problem(torch.float32, torch.float32)
    head = {name: FusedLMHead(weight, b, backend=name, chunk_size=16) for name in ("naive", "chunked")}

    def l1(s, e, lp, lse, ent):
        assert lse is None and ent is None
        return lp.abs().sum()

    got = head["naive"].pointwise_loss(hidden, targets, l1, needs=("logprobs",))
    ref = head["chunked"].pointwise_loss(hidden, targets, lambda s, e, lp, lse, ent: lp.abs().sum())
    torch.testing.assert_close(got, ref)
    if HEAD_BACKENDS["torch"].available():
        torch_head = FusedLMHead(weight, b, backend="torch")
        torch.testing.assert_close(torch_head.pointwise_loss(hidden, targets, l1, needs=("logprobs",)), ref)
        with pytest.raises(ValueError, match="'torch' cannot give \\['lse'\\]"):
            torch_head.pointwise_loss(hidden, targets, l1, needs=("logprobs", "lse"))


def low_precision_reference(hidden, weight, targets):
    """Log-probabilities from bf16 operands whose products are rounded to bf16, softmax in fp32."""
    logits = F.linear(hidden.detach().bfloat16(), weight.detach().bfloat16()).float()
    picked = F.log_softmax(logits, -1).gather(-1, targets.clamp_min(0)[:, None])[:, 0]
    return torch.where(targets != IGNORE, picked, 0.0)


@pytest.mark.parametrize("task", ["per_token", "weighted_ce", "pointwise"])
def test_low_matmul_precision_multiplies_bf16_operands_and_accumulates_in_fp32(task):
    """``bf16-mixed`` on the chunked backend with ``matmul_precision="low"``: fp32 weight and hidden under
    autocast → every matmul takes bf16 operands (tensor cores on CUDA), outputs and statistics stay fp32,
    gradients come back in fp32, and the values are those of bf16 products (not of fp32 ones)."""
    hidden, weight, _, targets = problem(torch.float32, torch.float32, bias=False, n=64, v=301)
    valid = targets != IGNORE
    log = ShapeLog()
    with torch.autocast("cpu", dtype=torch.bfloat16), log:
        head = FusedLMHead(weight, backend="chunked", chunk_size=16, matmul_precision="low")
        if task == "per_token":
            loss = -head(hidden, targets, "logprobs").logprobs.sum()
        elif task == "weighted_ce":
            loss = head.weighted_ce(hidden, targets, 1.0)
        else:
            loss = head.pointwise_loss(hidden, targets, lambda s, e, lp, lse, ent: -lp.sum())
        loss.backward()
    assert log.operand_dtypes == {torch.bfloat16}, log.operand_dtypes
    assert loss.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.float32
    low = -low_precision_reference(hidden, weight, targets)[valid].sum()
    full = -reference_logprobs(hidden, weight, None, targets, torch.float64)[valid].sum()
    loss = float(loss.detach())
    assert abs(loss - float(low)) < 0.1 * abs(float(full) - float(low)), (loss, low, full)


def test_auto_matmul_precision_is_full_precision_on_cpu():
    hidden, weight, b, targets = problem(torch.bfloat16, torch.float32)
    values = {}
    for precision in ("auto", "full", "low"):
        head = FusedLMHead(weight, b, backend="chunked", chunk_size=16, matmul_precision=precision)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            values[precision] = head(hidden, targets, ("logprobs", "entropy"))
    assert torch.equal(values["auto"].logprobs, values["full"].logprobs)
    assert not torch.equal(values["low"].logprobs, values["full"].logprobs)
    with pytest.raises(ValueError, match="matmul_precision 'half' is not one of"):
        FusedLMHead(weight, matmul_precision="half")


CHECK_A_BF16_WEIGHT = """
import json, sys
import torch
sys.path.insert(0, "benchmarks")
from resident import reset_peak_rss, status_kib
from lit_losses.heads.output import check_head_inputs
from lit_losses.validation import check_finite_weight
weight = torch.randn(4096, 4096).bfloat16()  # 32 MiB
hidden, targets = torch.randn(8, 4096).bfloat16(), torch.zeros(8, dtype=torch.long)
checks = {
    "weight": lambda: check_finite_weight(weight),
    "head": lambda: check_head_inputs(hidden, targets, weight, None, ignore_index=-100, check_finite=True),
}
added = {}
for name, check in checks.items():
    reset_peak_rss()
    base = status_kib("VmRSS")
    check()
    added[name] = (status_kib("VmHWM") - base) / 1024
print(json.dumps(added))
"""


def test_the_finiteness_check_of_a_bf16_weight_on_cpu_makes_no_copy_of_it():
    """The head's input checks sum a bf16 weight on CPU in its own dtype: a float32 sum would first cast the
    whole weight (twice its bytes) at every call. Measured as the peak resident set of a subprocess."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", CHECK_A_BF16_WEIGHT],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    added = json.loads(out.stdout.strip().splitlines()[-1])
    assert max(added.values()) < 8, added  # MiB, against the weight's 32


def test_inputs_whose_sums_overflow_but_whose_entries_are_finite_pass_the_checks():
    """The finiteness checks read sums first; a sum that overflows (fp16: above 65504) is no bad value: the
    element-wise check then passes the call, and a real NaN is still refused by name."""
    hidden = torch.full((64, 8), 60000.0, dtype=torch.float16)
    weight = torch.full((100, 8), 60000.0, dtype=torch.float16)
    targets = torch.zeros(64, dtype=torch.long)
    assert not torch.isfinite(hidden.sum()) and not torch.isfinite(weight.sum())
    check_head_inputs(hidden, targets, weight, None, ignore_index=-100, check_finite=True)
    hidden[3, 2] = float("nan")
    with pytest.raises(ValueError, match="hidden states contain 1 non-finite value"):
        check_head_inputs(hidden, targets, weight, None, ignore_index=-100, check_finite=True)


class WrappedWeight(torch.Tensor):
    """A tensor subclass standing for a wrapped weight (a DTensor, a quantized tensor)."""


def test_a_nan_in_a_weight_of_a_tensor_subclass_is_refused_too():
    """Only a plain weight's finiteness is read together with the other checks; any other (a subclass such
    as a DTensor) is still checked, on its own."""
    weight = torch.randn(50, 8)
    weight[7, 1] = float("nan")
    hidden, targets = torch.randn(4, 8), torch.zeros(4, dtype=torch.long)
    for w in (
        weight,
        weight.as_subclass(WrappedWeight),
        torch.nn.Parameter(weight).as_subclass(WrappedWeight),
    ):
        with pytest.raises(ValueError, match=r"output weight \(shape \(50, 8\)\) contains 1 non-finite"):
            check_head_inputs(hidden, targets, w, None, ignore_index=-100, check_finite=True)
    check_head_inputs(
        hidden, targets, weight.as_subclass(WrappedWeight), None, ignore_index=-100, check_finite=False
    )


@pytest.mark.parametrize("subclass", [False, True], ids=["plain", "tensor_subclass"])
def test_per_token_weights_are_checked_with_the_head_inputs(subclass):
    """Per-token weights of a weighted cross-entropy are read with the head's other checks: the loss equals
    the float64 weighted sum over the valid tokens, weights whose sum merely overflows pass, and a NaN among
    them is refused by position (a plain tensor in the one read, any other on its own)."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 5, 8), torch.randn(40, 8)
    targets = torch.randint(0, 40, (3, 5))
    targets[1, 2:] = -100
    weights = torch.rand(3, 5) * 10
    wrap = (lambda t: t.as_subclass(WrappedWeight)) if subclass else (lambda t: t)
    got = FusedLMHead(weight, backend="blocked").weighted_ce(hidden, targets, wrap(weights))
    logp = torch.log_softmax(hidden.double() @ weight.double().T, -1)
    valid = targets != -100
    want = -(weights.double()[valid] * logp[valid].gather(1, targets[valid][:, None])[:, 0]).sum()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)
    huge = torch.full((3, 5), 3e38)
    assert not torch.isfinite(huge.sum())
    check_head_inputs(
        hidden, targets, weight, None, ignore_index=-100, check_finite=True, token_weights=wrap(huge)
    )
    weights[2, 4] = float("nan")
    with pytest.raises(ValueError, match=r"token_weights hold 1 non-finite value\(s\).*position \(2, 4\)"):
        FusedLMHead(weight, backend="blocked").weighted_ce(hidden, targets, wrap(weights))


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_a_bf16_accumulation_gives_bf16_outputs_on_either_pass(compiled, monkeypatch):
    """``accum_dtype=torch.bfloat16`` with bf16 inputs: the ``blocked`` outputs are bf16 whether the
    compiled kernels (which compute a bf16 block's statistics in fp32) or the eager passes run."""
    from lit_losses.heads import entropy_kernels

    if compiled:
        monkeypatch.setattr(entropy_kernels, "COMPILE_MIN_LOGITS", 1)
    else:
        monkeypatch.setenv(entropy_kernels.ENV_SWITCH, "0")
    hidden, weight, _, targets = problem(torch.bfloat16, torch.bfloat16, bias=False)
    head = FusedLMHead(weight, backend="blocked", accum_dtype=torch.bfloat16, chunk_size=16)
    out = head(hidden, targets, ("logprobs", "lse", "entropy"))
    assert {out.logprobs.dtype, out.lse.dtype, out.entropy.dtype} == {torch.bfloat16}
