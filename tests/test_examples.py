"""The scripts in examples/ run as documented."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_custom_gradient_regularizer_example_checks_its_gradient_and_trains():
    module = runpy.run_path(str(EXAMPLES / "custom_gradient_regularizer.py"))
    telemetry = module["main"](steps=2)
    term = telemetry["regularizers"]["sequence_floor_penalty"]
    assert term["weight"] == 0.5 and term["value"] > 0 and term["error"] == 0.0
    assert abs(term["contribution"] - 0.5 * term["value"]) < 1e-5
    # the external NumPy gradient equals autograd's gradient of the same formula
    import torch

    g = torch.Generator().manual_seed(3)
    logprobs = (-torch.rand(4, 5, generator=g, dtype=torch.float64) * 8).requires_grad_()
    mask = torch.rand(4, 5, generator=g) > 0.3
    value = module["sequence_floor_op"](logprobs, mask, -4.0)
    (grad,) = torch.autograd.grad(value, logprobs)
    rows = mask.any(1)
    means = (logprobs * mask).sum(1) / mask.sum(1).clamp_min(1)
    reference = torch.nn.functional.softplus(-4.0 - means)[rows].mean()
    (ref_grad,) = torch.autograd.grad(reference, logprobs)
    torch.testing.assert_close(value, reference.detach())
    torch.testing.assert_close(grad, ref_grad)


def test_examples_run_as_scripts():
    for script in sorted(EXAMPLES.glob("*.py")):
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{script.name}: {proc.stderr[-2000:]}"


def test_async_regularizer_example_skips_and_flags_the_slow_and_the_failed_call():
    module = runpy.run_path(str(EXAMPLES / "async_regularizer.py"))
    errors = module["main"](steps=8)
    assert errors == [0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # call 3 timed out, call 6 failed
