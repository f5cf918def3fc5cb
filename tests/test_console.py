"""The console of the main job: no Lightning tips, no LeafSpec deprecation, a bar counting optimizer steps."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.cli_runs import MAIN_JOB, REPO, SHORT


def test_main_job_console_has_no_tips_or_deprecations_and_counts_optimizer_steps(tmp_path):
    root = tmp_path / "run"
    args = [a for a in SHORT if "progress_bar" not in a and "max_steps" not in a]
    args += ["--trainer.max_steps=4", "--trainer.accumulate_grad_batches=3", "--trainer.val_check_interval=6"]
    args += [f"--trainer.default_root_dir={root}", f"--trainer.logger.init_args.save_dir={root}"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "lit_losses.cli", "fit", *MAIN_JOB, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    assert "Tip:" not in console and "LeafSpec" not in console
    assert "Warning" not in console, console[-3000:]
    counts = re.findall(r"Epoch 0:.*?\| (\d+)/(\d+) \[", console)
    assert counts and counts[-1] == ("4", "4"), counts  # 4 optimizer steps of 3 micro-batches each
    assert {total for _, total in counts} == {"4"}
    assert "lit-losses: fit ended at step 4: max_steps=4 reached" in console


def test_a_class_path_that_is_not_importable_says_how_to_make_it_importable(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "lit_losses.cli", "fit", "--model.class_path", "mypkg.MyLM"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("lit-losses: error: model.class_path 'mypkg.MyLM': No module named 'mypkg'")
    assert "PYTHONPATH=" in proc.stderr and "pip install -e ." in proc.stderr


def test_the_step_bar_of_a_later_epoch_rates_only_that_epochs_steps(tmp_path):
    """A multi-epoch run with ``max_steps``: at the second epoch the bar stands at the run's step and its
    rate counts from there (it used to divide every step of the run by the epoch's first milliseconds)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lit_losses.cli.console import StepProgressBar

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def training_step(self, batch, batch_idx):
            return (self.w * batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    seen = []

    class Probe(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            bar = trainer.progress_bar_callback.train_progress_bar
            seen.append((trainer.current_epoch, bar.n, bar.format_dict["initial"], bar.total))

    bar = StepProgressBar()
    trainer = L.Trainer(
        max_steps=6,
        callbacks=[bar, Probe()],
        logger=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), DataLoader(torch.ones(4, 1), batch_size=1))
    assert seen == [(0, 0, 0, 6), (1, 4, 4, 6)]


@pytest.mark.parametrize(
    ("env", "kept"), [({}, True), ({"RANK": "0"}, True), ({"RANK": "1"}, False), ({"LOCAL_RANK": "1"}, False)]
)
def test_the_seed_line_prints_once_per_run_from_rank_zero(env, kept, monkeypatch):
    import logging

    from lit_losses.cli.console import PER_RANK_LOGGERS, quiet_console

    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    quiet_console()
    logger = logging.getLogger(PER_RANK_LOGGERS[0])
    record = logger.makeRecord(logger.name, logging.INFO, "", 0, "[rank: 1] Seed set to 0", None, None)
    assert logger.filter(record) is kept
