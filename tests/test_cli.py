import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_losses.cli import cli_main as main

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


@pytest.mark.slow
@pytest.mark.ddp
def test_two_process_ddp_run_of_the_cli(tmp_path):
    root = tmp_path / "ddp"
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
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "max_steps=6" in proc.stderr + proc.stdout
    assert list(root.rglob("*.ckpt"))
