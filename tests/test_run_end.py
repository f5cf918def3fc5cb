"""``lit-losses fit`` ends with ``run_end.json`` (why, where, the final losses) and a summary."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import yaml

from tests.cli_runs import fit_short, read_scalars, run_end, run_folder

STOP_AT_3 = {
    "controller-metrics": [{"name": "state", "class": "TrainingState"}],
    "controllers": [
        {
            "name": "stop-at-3",
            "triggers": ["on_optimizer_step_end"],
            "rule": 'state["global_step"] >= 3',
            "operations": ["lightning.should_training_stop"],
        }
    ],
}


def test_main_job_ends_with_record_and_summary(tmp_path, capsys):
    fit_short(tmp_path / "run", "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.save_last=true")
    folder = run_folder(tmp_path / "run")
    record = run_end(folder)
    scalars = read_scalars(folder)
    assert record["reason"] == "max_steps" and record["step"] == 6
    last_logged = scalars["train/loss_total"][max(scalars["train/loss_total"])]
    assert record["train_loss"] == pytest.approx(last_logged, rel=1e-6)
    assert record["val_loss"] == pytest.approx(scalars["val/loss"][max(scalars["val/loss"])], rel=1e-6)
    assert record["checkpoints"] and all(Path(p).is_file() for p in record["checkpoints"])
    assert Path(record["log_dir"]) == folder.resolve()
    assert any(tag.startswith("lr-AdamW") for tag in scalars)  # LearningRateMonitor: the report's LR plot
    out = capsys.readouterr().out
    assert "lit-losses: fit ended at step 6: max_steps=6 reached" in out
    assert f"tensorboard --logdir {folder.resolve()}" in out
    assert f"lit-losses report {folder.resolve()}" in out
    assert record["checkpoints"][-1] in out
    assert Path(record["checkpoints"][-1]).name == "last.ckpt"  # saved at the very end, still recorded


def test_a_controller_stop_is_recorded_with_its_rule_and_step(tmp_path):
    config = tmp_path / "stop.yaml"
    config.write_text(yaml.safe_dump(STOP_AT_3))
    fit_short(tmp_path / "run", f"--trainer.callbacks.init_args.config={config}")
    folder = run_folder(tmp_path / "run")
    record = run_end(folder)
    assert record["reason"] == "controller" and record["step"] == 3
    assert record["controller"] == {"name": "stop-at-3", "step": 3}
    assert read_scalars(folder)["controller/stop-at-3/fired"] == {3: 1.0}  # marked on the time axis


def test_a_preempted_fit_records_its_exit_code_and_checkpoint(tmp_path):
    signal_at = [
        "--trainer.callbacks+=tests.test_real_path.SignalAtStep",
        "--trainer.callbacks.step=2",
    ]
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as stopped:
            fit_short(tmp_path / "run", *signal_at)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 143
    record = run_end(run_folder(tmp_path / "run"))
    assert record["reason"] == "preempted" and record["exit_code"] == 143 and record["step"] == 2
    assert Path(record["checkpoints"][-1]).name == "preempted-step=2.ckpt"
