"""A controller's ``lightning.should_training_stop`` sets ``lit-losses``' exit status (``exit_code``)."""

from pathlib import Path

import pytest

from lit_losses.cli.app import cli_main

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")

REPO = Path(__file__).resolve().parents[2]
STOP_AT_2 = """
controller-metrics:
  - {name: s, class: TrainingState}
operations:
  - {name: lightning, class: LightningOperations, arguments: {%s}}
controllers:
  - {name: enough, triggers: [on_optimizer_step_end], rule: 's["global_step"] >= 2',
     operations: [lightning.should_training_stop]}
"""


def fit(tmp_path: Path, arguments: str):
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 8)
    (tmp_path / "ctl.yaml").write_text(STOP_AT_2 % arguments)
    m, d = "--model.init_args.", "--data.init_args."
    return cli_main(
        [
            "fit",
            f"--config={REPO / 'configs' / 'tiny_lm.yaml'}",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.max_steps=5",
            "--trainer.limit_val_batches=0",
            f"--trainer.default_root_dir={tmp_path / 'run'}",
            "--trainer.callbacks+=lit_losses.TrainingController",
            f"--trainer.callbacks.config={tmp_path / 'ctl.yaml'}",
            f"{m}d_model=16",
            f"{m}n_heads=2",
            f"{m}n_layers=1",
            f"{d}vocab_size=300",
            f"{d}seq_len=16",
            f"{d}tokens_per_batch=32",
            f"{d}cache_dir={tmp_path / 'cache'}",
            f"{d}paths=[{tmp_path / 'corpus.txt'}]",
            f"{d}val_fraction=0",  # one document: no validation item to hold out
        ]
    )


def test_stop_with_exit_code_exits_with_it_and_says_which_controller(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        fit(tmp_path, "exit_code: 3")
    assert exit_info.value.code == 3
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lit-losses:")]
    assert lines == ["lit-losses: controller 'enough' stopped training at step 2 (exit code 3)"]


def test_stop_without_exit_code_ends_like_a_finished_run(tmp_path):
    cli = fit(tmp_path, "")
    assert cli.trainer.global_step == 2  # stopped by the rule, before max_steps=5
    controller = next(c for c in cli.trainer.callbacks if hasattr(c, "stop"))
    assert (controller.stop.controller, controller.stop.step, controller.stop.exit_code) == (
        "enough",
        2,
        None,
    )
