"""Real run: 2-process CPU DDP with accumulate_grad_batches=3 equals one process over the global batch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.aggregation import ddp_step

SCRIPT = Path(ddp_step.__file__)


def run_ddp(mode: str, loader: str, out: Path, objective: str = "ce") -> dict:
    cmd = [sys.executable, str(SCRIPT), mode, loader, str(out), objective]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=SCRIPT.parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def max_relative_error(grads: dict, reference: dict) -> float:
    return max(
        float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for n, g in reference.items()
    )


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_ddp_accumulated_step_equals_the_full_batch_step(tmp_path, mode):
    ddp_step.run(mode, "full", str(tmp_path / "full.pt"))
    reference = torch.load(tmp_path / "full.pt")
    exact = run_ddp(mode, "global", tmp_path / "global.pt")
    naive = run_ddp(mode, "naive", tmp_path / "naive.pt")

    # the micro-batches really differ in their counts (otherwise the naive run could agree by chance)
    counts = [int((b["labels"] != -100).sum()) for b in ddp_step.micro_batches()]
    assert len(set(counts)) > 1, counts

    assert max_relative_error(exact["grads"], reference["grads"]) < 1e-5
    assert exact["loss"] == pytest.approx(reference["loss"], rel=1e-6)
    # per-micro-batch normalization (the naive approach) is caught by the same comparison
    assert max_relative_error(naive["grads"], reference["grads"]) > 1e-3
    assert abs(naive["loss"] - reference["loss"]) > 1e-4 * abs(reference["loss"])


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_ppo_step_equals_the_single_process_step(tmp_path):
    """``ppo`` + ``kl_reference`` + ``entropy`` in ``seq-mean-token-sum-norm`` with per-sequence weights:
    2 DDP processes × 3 accumulated micro-batches take the gradient, the loss and the RL telemetry of one
    process over the global batch."""
    mode = "seq-mean-token-sum-norm"
    ddp_step.run(mode, "full", str(tmp_path / "full.pt"), "ppo")
    reference = torch.load(tmp_path / "full.pt")
    exact = run_ddp(mode, "global", tmp_path / "global.pt", "ppo")

    assert max_relative_error(exact["grads"], reference["grads"]) < 1e-5
    assert exact["loss"] == pytest.approx(reference["loss"], rel=1e-6)
    keys = {f"train/base_loss/{k}" for k in ("clip_fraction", "ratio_mean", "approx_kl", "advantage_mean")}
    assert keys <= set(reference["telemetry"])
    assert 0.05 < reference["telemetry"]["train/base_loss/clip_fraction"] < 0.95  # PPO clips some tokens
    assert exact["telemetry"] == pytest.approx(reference["telemetry"], rel=1e-5, abs=1e-7)


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_step_with_each_rollout_correction_equals_the_single_process_step(tmp_path):
    """Every correction of `ddp_step.ROLLOUT_CORRECTIONS` (TRL's four modes and IcePop, verl's token and
    sequence weights and rejections, the off-policy mask, π_old absent), one fit each in the same 2 DDP
    processes × 3 accumulated micro-batches: the gradient, the loss and the telemetry (means and the max
    of the mismatch, shares truncated, masked and rejected) of one process over the global batch. A
    rejection changes the step's counts: the loader applies it before counting."""
    mode = "seq-mean-token-mean"
    ddp_step.run(mode, "full", str(tmp_path / "full.pt"), "rollout")
    run_ddp_files(mode, tmp_path / "global.pt", "rollout")
    for i, (args, _) in enumerate(ddp_step.ROLLOUT_CORRECTIONS):
        reference = torch.load(tmp_path / f"full.pt.{i}")
        exact = torch.load(tmp_path / f"global.pt.{i}")
        assert max_relative_error(exact["grads"], reference["grads"]) < 1e-5, args
        assert exact["loss"] == pytest.approx(reference["loss"], rel=1e-6), args
        rollout = {k for k in reference["telemetry"] if "rollout" in k or "off_policy" in k}
        assert rollout and exact["telemetry"] == pytest.approx(reference["telemetry"], rel=1e-5, abs=1e-7), (
            args
        )
        shares = [v for k, v in reference["telemetry"].items() if k in rollout and k.endswith("_fraction")]
        assert any(0 < share < 1 for share in shares), args  # the correction acts on some tokens, not all


def run_ddp_files(mode: str, out: Path, objective: str) -> None:
    """`run_ddp` for an objective that saves one file per fit (``out.i``)."""
    cmd = [sys.executable, str(SCRIPT), mode, "global", str(out), objective]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=SCRIPT.parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
