"""``configs/rl_rollout_correction.yaml`` through the CLI (in-process, fewer steps): PPO on records with
both log-probabilities (``data/rollouts_fp8.jsonl``: an FP8 engine's and the trainer's) with verl's
sequence weight and k3 rejection; it logs the mismatch telemetry, starts at π_old (PPO's ratio 1: nothing
clipped), rejects some completions and not all, and trains."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_losses.cli import cli_main

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "rl_rollout_correction.yaml"
DATA = REPO / "data" / "rollouts_fp8.jsonl"
STEPS = 8
TAGS = (
    "rollout_logprob_diff_mean",
    "rollout_logprob_diff_max",
    "rollout_k3_kl",
    "rollout_is_weight_mean",
    "rollout_is_truncated_fraction",
    "rollout_rs_masked_fraction",
    "clip_fraction",
)


@pytest.mark.timeout(300)
def test_rollout_correction_config_trains_and_logs_the_mismatch(tmp_path):
    root = tmp_path / "run"
    args = [
        "fit",
        "--config",
        str(CONFIG),
        f"--trainer.max_steps={STEPS}",
        f"--data.init_args.paths=[{DATA}]",
    ]
    args += [f"--trainer.default_root_dir={root}", f"--trainer.logger.init_args.save_dir={root}"]
    args += ["--trainer.enable_progress_bar=false"]
    cli = cli_main(args)
    assert cli.trainer.global_step == STEPS
    correction = cli.model.objective.base_loss.correction
    assert correction.rollout_is == "sequence" and correction.rejection[0].option == "seq_max_k3"
    (events,) = {p.parent for p in root.rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events))
    acc.Reload()
    values = {tag: [e.value for e in acc.Scalars(f"train/base_loss/{tag}")] for tag in TAGS}
    for tag, series in values.items():
        assert len(series) == STEPS and all(math.isfinite(x) for x in series), (tag, series)
    # the largest mismatch of any step is at most the file's, and the mean is about the file's
    records = [json.loads(line) for line in DATA.read_text().splitlines()]
    gaps = [abs(o - q) for r in records for o, q in zip(r["old_logprobs"], r["logprobs"]) if q is not None]
    assert max(values["rollout_logprob_diff_max"]) <= max(gaps) + 1e-6
    mean_gap = sum(gaps) / len(gaps)
    assert all(0.5 < v / mean_gap < 2 for v in values["rollout_logprob_diff_mean"]), (mean_gap, values)
    assert values["clip_fraction"][0] == 0.0  # the first step's policy is π_old: PPO's ratio is 1
    assert 0 < max(values["rollout_rs_masked_fraction"]) < 1, values  # some completions rejected, not all
    assert max(values["rollout_is_truncated_fraction"]) > 0
