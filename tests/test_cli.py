import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml
from lightning.pytorch import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_losses.cli.app import cli_main as main

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "tiny_lm.yaml")
FAST = [
    "--trainer.max_steps=6",
    "--trainer.val_check_interval=3",
    "--trainer.limit_val_batches=2",
    "--trainer.log_every_n_steps=1",
    "--data.init_args.max_documents=30",
    "--model.init_args.n_layers=1",
]


def run_cli(args, tmp_path):
    root = str(tmp_path / "run")
    return main(
        [
            "fit",
            "--config",
            CONFIG,
            f"--trainer.default_root_dir={root}",
            f"--trainer.logger.init_args.save_dir={root}",
            *FAST,
            *args,
        ]
    ), Path(root)


def test_fit_from_shipped_config_writes_events_and_checkpoint(tmp_path):
    cli, root = run_cli([], tmp_path)
    assert cli.trainer.global_step == 6
    events = list(root.rglob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file"
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    losses = [e.value for e in acc.Scalars("train/loss_total")]
    assert len(losses) == 6 and all(v == v for v in losses)
    assert "val/loss" in acc.Tags()["scalars"]
    ckpts = list(root.rglob("*.ckpt"))
    assert ckpts, "no checkpoint written"

    common = ["--config", CONFIG, f"--ckpt_path={ckpts[0]}", "--trainer.logger=false", *FAST]
    common.append(f"--trainer.default_root_dir={tmp_path / 'eval'}")  # its config.yaml lands there
    validated = main(["validate", *common])
    assert validated.trainer.callback_metrics["val/loss"] > 0
    predicted = main(["predict", *common, "--trainer.limit_predict_batches=2"])
    logprobs = predicted.trainer.predict_loop.predictions
    assert 1 <= len(logprobs) <= 2 and all(lp.dim() == 2 and (lp <= 0).all() for lp in logprobs)


def test_config_file_is_valid_yaml_with_documented_sections():
    config = yaml.safe_load(Path(CONFIG).read_text())
    assert config["model"]["class_path"] == "lit_losses.TinyLM"
    assert config["data"]["class_path"] == "lit_losses.TextDataModule"


def test_help_lists_model_and_data_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--model.help", "TinyLM"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--model.d_model", "--model.head_backend", "--model.loss_agg", "--model.optimizer"):
        assert option in text
    with pytest.raises(SystemExit):
        main(["fit", "--data.help", "TextDataModule"])
    text = capsys.readouterr().out
    for option in ("--data.paths", "--data.vocab_size", "--data.tokens_per_batch", "--data.seq_len"):
        assert option in text
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    text = capsys.readouterr().out
    assert "--model" in text and "--data" in text and "--trainer.max_steps" in text


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("--data.init_args.paths=[/no/such/dir/*.txt]", "/no/such/dir/*.txt"),
        ("--data.init_args.vocab_size=100", "vocab_size=100"),
        ("--data.init_args.seq_len=1", "seq_len=1"),
        ("--data.init_args.tokens_per_batch=100", "tokens_per_batch=100"),
        ("--model.init_args.head_backend=fast", "'fast'"),
        ("--model.init_args.loss_agg=mean", "'mean'"),
    ],
)
def test_bad_input_fails_before_training_with_one_line(override, expected, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli([override], tmp_path)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("lit-losses: error:") and expected in err[-1], err[-1]
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").rglob("*.ckpt"))


def test_empty_corpus_fails_before_training(tmp_path, capsys):
    (tmp_path / "blank.txt").write_text("  \n\n")
    with pytest.raises(SystemExit) as exit_info:
        run_cli([f"--data.init_args.paths=[{tmp_path / 'blank.txt'}]"], tmp_path)
    assert exit_info.value.code == 2
    assert "corpus is empty" in capsys.readouterr().err


def test_unknown_config_key_is_rejected(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(["--model.init_args.bogus_key=3"], tmp_path)
    assert exit_info.value.code == 2
    assert "bogus_key" in capsys.readouterr().err


class RankLogDir(Callback):
    """Writes ``<out>/rank<r>.txt``: the rank's logger version and the trainer's log folder."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:
        text = f"{trainer.logger.version} {trainer.log_dir}"
        (Path(self.out) / f"rank{trainer.global_rank}.txt").write_text(text)


@pytest.mark.slow
@pytest.mark.ddp
def test_two_process_ddp_run_of_the_cli(tmp_path):
    root = tmp_path / "ddp"
    (root / "tensorboard" / "version_0").mkdir(parents=True)  # an earlier run's: this one claims version_1
    cmd = [
        sys.executable,
        "-m",
        "lit_losses.cli",
        "fit",
        "--config",
        CONFIG,
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        "--trainer.strategy=ddp",
        f"--trainer.default_root_dir={root}",
        f"--trainer.logger.init_args.save_dir={root}",
        "--trainer.enable_progress_bar=false",
        *FAST,
        "--trainer.callbacks+=tests.test_cli.RankLogDir",
        f"--trainer.callbacks.out={tmp_path}",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=420, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "max_steps=6" in proc.stderr + proc.stdout
    assert list(root.rglob("*.ckpt"))
    # rank 0 claimed version_1 and handed it to rank 1, which would otherwise pick version_2 on its own
    version_1 = root / "tensorboard" / "version_1"
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == [f"1 {version_1}"] * 2
    assert sorted(p.name for p in (root / "tensorboard").iterdir()) == ["version_0", "version_1"]
    assert (version_1 / "config.yaml").exists() and list((version_1 / "checkpoints").glob("*.ckpt"))


# ---- --ckpt_path with options that differ from the checkpoint's -----------------------------------------
REGULARIZERS = str(REPO / "configs" / "regularizers.yaml")


@pytest.fixture(scope="module")
def regularized_checkpoint(tmp_path_factory):
    """A checkpoint of the main job (shrunk) with configs/regularizers.yaml (z_loss and entropy)."""
    tmp_path = tmp_path_factory.mktemp("regularized")
    _, root = run_cli(["--config", REGULARIZERS, "--trainer.max_steps=3"], tmp_path)
    (ckpt,) = root.rglob("*.ckpt")
    return ckpt


def resume(ckpt, tmp_path, *args):
    return run_cli([f"--ckpt_path={ckpt}", "--trainer.max_steps=4", *args], tmp_path)[0]


def test_ckpt_path_applies_a_removed_regularizer_with_a_warning(regularized_checkpoint, tmp_path):
    with pytest.warns(UserWarning, match="differ from the checkpoint's; this run's apply") as caught:
        cli = resume(regularized_checkpoint, tmp_path)  # without configs/regularizers.yaml
    message = next(str(w.message) for w in caught if "this run's apply" in str(w.message))
    assert "model.init_args.regularizers[z_loss]: removed" in message
    assert "model.init_args.regularizers[entropy]: removed" in message
    assert len(cli.model.regularizer_set) == 0 and cli.trainer.global_step == 4  # not the checkpoint's two


def test_ckpt_path_applies_a_changed_weight_and_an_added_regularizer(regularized_checkpoint, tmp_path):
    extra = tmp_path / "more.yaml"
    extra.write_text(
        "model:\n  init_args:\n    regularizers:\n      - {name: z_loss, weight: 0.5}\n"
        "      - {name: confidence_penalty, weight: 0.01}\n"
    )
    with pytest.warns(UserWarning, match="this run's apply") as caught:
        cli = resume(regularized_checkpoint, tmp_path, "--config", str(extra))
    message = next(str(w.message) for w in caught if "this run's apply" in str(w.message))
    assert "regularizers[z_loss].weight: 0.0001 in the checkpoint, 0.5 now" in message
    assert (
        "regularizers[confidence_penalty]: added" in message and "regularizers[entropy]: removed" in message
    )
    terms = cli.model.regularizer_set
    assert sorted(terms.terms) == ["confidence_penalty", "z_loss"]
    assert (
        terms.state_dict()["z_loss"]["weight"] == 0.5
    )  # this run's weight, not the checkpoint's run-time one


def test_ckpt_path_with_the_same_options_is_silent_and_restores_run_time_weights(
    regularized_checkpoint, tmp_path
):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = resume(regularized_checkpoint, tmp_path, "--config", REGULARIZERS)
    assert not [w for w in caught if "differ from the checkpoint" in str(w.message)]
    assert sorted(cli.model.regularizer_set.terms) == ["entropy", "z_loss"]


def test_ckpt_path_applies_a_changed_learning_rate_to_the_optimizer_state(regularized_checkpoint, tmp_path):
    with pytest.warns(UserWarning, match=r"optimizer.lr: 0.002 in the checkpoint, 0.001 now"):
        cli = resume(
            regularized_checkpoint, tmp_path, "--config", REGULARIZERS, "--model.init_args.optimizer.lr=0.001"
        )
    (group, *_) = cli.trainer.optimizers[0].param_groups
    assert group["initial_lr"] == pytest.approx(0.001)
    assert cli.trainer.lr_scheduler_configs[0].scheduler.base_lrs[0] == pytest.approx(0.001)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--resume_changes=error"], "model.init_args.regularizers[z_loss]: removed"),
        (
            ["--config", REGULARIZERS, "--model.init_args.n_layers=2"],
            "model.init_args.n_layers: 1 in the checkpoint, 2 now",
        ),
        (
            [
                "--config",
                REGULARIZERS,
                "--model.class_path=lit_losses.TinyLM",
                "--model.init_args.d_model=96",
            ],
            "d_model: 192",
        ),
        (
            ["--config", REGULARIZERS, "--data.init_args.seq_len=128", "--resume_changes=error"],
            "data.init_args.seq_len: 256",
        ),
    ],
    ids=[
        "changed-regularizers-with-error-policy",
        "architecture",
        "architecture-d_model",
        "data-with-error-policy",
    ],
)
def test_ckpt_path_refuses_with_one_line(regularized_checkpoint, tmp_path, capsys, args, expected):
    with pytest.raises(SystemExit) as exit_info:
        resume(regularized_checkpoint, tmp_path, *args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("lit-losses: error: --ckpt_path ") and expected in err[-1], err[-1]
