"""``lit-losses fit`` ends with ``run_end.json`` (why, where, the final losses) and a summary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.cli_runs import REPO, fit_short, read_scalars, run_end, run_folder

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


@pytest.mark.slow
def test_the_printed_resume_command_resumes_the_preempted_run(tmp_path, capsys):
    """After a preemption the summary prints the whole command that resumes the run; running exactly that
    command (in a shell, as a user pastes it) continues from the preemption checkpoint to max_steps (the
    saved config still holds the callback that sent the signal at step 2, which a run from step 2 on never
    reaches)."""
    signal_at = ["--trainer.callbacks+=tests.test_real_path.SignalAtStep", "--trainer.callbacks.step=2"]
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit):
            fit_short(tmp_path / "run", *signal_at)
    finally:
        signal.signal(signal.SIGTERM, previous)
    record = run_end(run_folder(tmp_path / "run"))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  resume with:  ")]
    assert len(lines) == 1, lines
    command = lines[0].removeprefix("  resume with:  ")
    assert command == record["resume_command"]
    config = Path(record["log_dir"]) / "config.yaml"
    assert command == f"lit-losses fit --config {config} --ckpt_path {record['checkpoints'][-1]}"
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # where lit-losses is
    env = dict(os.environ, PYTHONPATH=str(REPO), PATH=path, PYTHONWARNINGS="ignore")
    proc = subprocess.run(command, shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = sorted((tmp_path / "run").rglob("run_end.json"), key=lambda p: p.stat().st_mtime)[-1]
    assert json.loads(resumed.read_text())["reason"] == "max_steps"
    assert json.loads(resumed.read_text())["step"] == 6
    before = read_scalars(Path(record["log_dir"]))["train/loss_total"]
    after = read_scalars(resumed.parent)["train/loss_total"]
    assert sorted(before) == [0, 1] and sorted(after) == [2, 3, 4, 5]  # from step 2 on, none trained twice


def test_a_trainer_option_lightning_refuses_at_set_up_is_one_line_and_no_run(tmp_path, capsys):
    """``val_check_interval`` larger than the epoch: Lightning refuses it once the data is set up, after
    the loggers wrote the hyper-parameters. The run never started: one error line, exit code 2, no summary,
    no ``run_end.json``, no version folder nor config file left."""
    root = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:
        fit_short(root, "--trainer.val_check_interval=100000")
    captured = capsys.readouterr()
    assert stop.value.code == 2
    errors = [line for line in captured.err.splitlines() if line.startswith("lit-losses: error:")]
    assert len(errors) == 1 and "trainer.val_check_interval=100000 is larger than the number" in errors[0]
    assert "fit ended" not in captured.out and "tensorboard --logdir" not in captured.out, captured.out
    assert not list(root.rglob("run_end.json")) and not list(root.rglob("version_*"))
    assert not list(root.rglob("config*.yaml")) and not list(root.rglob("hparams.yaml"))


def test_the_summary_prints_a_token_count_as_a_whole_number():
    from lit_losses.cli.run_end import summary_text

    record = {
        "reason": "max_steps",
        "detail": "max_steps=3 reached",
        "step": 3,
        "train_loss": 0.5,
        "val_loss": None,
        "log_dir": "runs/x",
        "checkpoints": [],
        "metrics": {"train/num_tokens": 1566.0, "train/entropy": 2.5},
    }
    assert "train/num_tokens 1566, train/entropy 2.5000" in summary_text(record)
