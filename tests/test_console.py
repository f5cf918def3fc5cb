"""The console of the main job: no Lightning tips, no LeafSpec deprecation, a bar counting optimizer steps."""

from __future__ import annotations

import os
import re
import subprocess
import sys

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
