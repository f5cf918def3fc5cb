"""DDP: a rule that holds on one rank only makes every rank stop at the same step, without a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("ddp_stop.py")


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_rank1_only_rule_stops_both_ranks_at_the_same_step(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=SCRIPT.parents[2],
        env={**os.environ, "PYTHONPATH": str(SCRIPT.parents[2])},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["step"] for r in results] == [2, 2]
    assert all([f["step"] for f in r["fired"]] == [2] for r in results)


SPIKE_SCRIPT = Path(__file__).with_name("ddp_spike.py")


def run_two_ranks(mode: str, out: Path) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, str(SPIKE_SCRIPT), mode, str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=SPIKE_SCRIPT.parents[2],
        env={**os.environ, "PYTHONPATH": str(SPIKE_SCRIPT.parents[2])},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_spike_recovery_rolls_back_on_both_ranks_at_the_same_step(tmp_path):
    """The poisoned micro-batch is in rank 0's shard only; the step's global loss spikes, both ranks roll
    back at that step and end with the same weights."""
    results = run_two_ranks("spike", tmp_path)
    assert [r["fired"] for r in results] == [[41], [41]]
    assert [r["step"] for r in results] == [45, 45]
    assert results[0]["weights"] == results[1]["weights"]


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_a_rule_failing_on_one_rank_stops_every_rank(tmp_path):
    results = run_two_ranks("error", tmp_path)
    assert [r["step"] for r in results] == [1, 1]
    assert (
        "rule 'proc[\"rank\"] == 1 and train_loss[\"los\"] > 0' raised KeyError: 'los' at step 1"
        in (results[1]["error"])
    )
    assert "train_loss={'loss': " in results[1]["error"]
    assert results[0]["error"] == (
        "controller 'typo-on-rank-1': rule 'proc[\"rank\"] == 1 and train_loss[\"los\"] > 0' failed on "
        "another rank at step 1 on on_optimizer_step_end"
    )


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_a_custom_action_on_rank_0_stops_every_rank(tmp_path):
    results = run_two_ranks("custom", tmp_path)
    assert [r["step"] for r in results] == [3, 3]
    assert [r["fired"] for r in results] == [[3], [3]]
