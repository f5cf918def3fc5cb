"""How ``lit-losses`` reads its options: whole names only (no argparse abbreviation), the default classes
of ``model`` and ``data`` wherever a run names its classes (command line, ``--config``, environment,
default config files), and the options a run gives itself."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import yaml

from lit_losses import PreferenceDataModule, RegularizedLM, TextDataModule
from lit_losses.cli.app import LitLossesCLI, LitLossesParser, cli_main
from lit_losses.cli.report import report_main
from lit_losses.data.datamodule import FileDataModule

REPO = Path(__file__).resolve().parents[1]


def error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("--trainer.max_st=3", "trainer.max_st: not an option of Trainer; did you mean 'max_steps'?"),
        # argparse took this one as --model.init_args.optimizer.lr=0.5, silently
        (
            "--model.init_args.optimizer.l=0.5",
            "model.init_args.optimizer.l: not an option of OptimizerConfig; did you mean 'lr'?",
        ),
        ("--model.dpo.bet=0.2", "model.init_args.dpo.bet: not an option of DPOPreset; did you mean 'beta'?"),
    ],
)
def test_an_abbreviated_option_is_refused_with_the_closest_name(option, expected, capsys):
    with pytest.raises(SystemExit) as stop:
        cli_main(["fit", option, "--print_config"])
    assert stop.value.code == 2
    assert error_line(capsys) == f"lit-losses: error: {expected}"


def test_an_abbreviated_report_option_is_refused(tmp_path, capsys):
    (tmp_path / "metrics.csv").write_text("epoch,step,train/loss_total\n0,0,4.0\n")
    with pytest.raises(SystemExit) as stop:
        report_main([str(tmp_path), "--ou", str(tmp_path / "r.html")])  # argparse took it as --out
    assert stop.value.code == 2
    assert error_line(capsys).startswith("lit-losses: error: report: unrecognized arguments: --ou")
    assert not (tmp_path / "r.html").exists()


PREFERENCE = {  # TRL's DPO on the shipped pairs, with TinyLM
    "model": {
        "class_path": "lit_losses.TinyLM",
        "init_args": {"dpo": {"beta": 0.1}, "ref_model": "initial_policy"},
    },
    "data": {
        "class_path": "lit_losses.PreferenceDataModule",
        "init_args": {"paths": ["data/preference/pairs.jsonl"], "vocab_size": 300, "max_length": 32},
    },
}


@pytest.mark.parametrize(
    ("config", "bound"),
    [("tiny_lm.yaml", "max_documents"), (PREFERENCE, "max_records"), ("grpo.yaml", "max_records")],
    ids=["TextDataModule", "PreferenceDataModule", "RLDataModule"],
)
def test_a_val_fraction_that_leaves_no_validation_batch_is_one_line(
    config, bound, tmp_path, capsys, monkeypatch
):
    """One item read: ``val_fraction`` > 0 holds out none; Lightning would only warn (an empty validation
    loader) and train on; every data module refuses it before the first step."""
    monkeypatch.chdir(REPO)  # the configs name data/… relative to the repository
    if isinstance(config, dict):
        (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    path = tmp_path / "run.yaml" if isinstance(config, dict) else REPO / "configs" / config
    args = ["fit", "--config", str(path), f"--data.init_args.{bound}=1", "--data.init_args.val_fraction=0.25"]
    args += [f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false", "--trainer.max_steps=1"]
    args += ["--model.init_args.n_layers=1", "--trainer.enable_progress_bar=false"]
    with pytest.raises(SystemExit) as stop:
        cli_main(args)
    assert stop.value.code == 2
    assert error_line(capsys) == (
        "lit-losses: error: data.val_fraction=0.25 leaves no validation micro-batch: 1 item(s) read, 0 held "
        "out; give more data (data.paths), or data.val_fraction=0 to train without validation"
    )
    assert not list(tmp_path.rglob("*.ckpt"))


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("--data.init_args.seq_len=1", "data.seq_len=1 must be >= 2"),
        ("--data.init_args.val_fraction=1.5", "data.val_fraction=1.5 must be in [0, 1)"),
        ("--data.init_args.paths=[/no/such/dir/*.txt]", "/no/such/dir/*.txt"),
    ],
)
def test_hf_text_data_refuses_its_options_before_loading_the_tokenizer(option, expected, tmp_path, capsys):
    """A bad option of ``HFTextDataModule`` is the error, not its tokenizer (here: no tokenizer at all),
    which is loaded only once the cheap checks passed, as the other data modules do."""
    pytest.importorskip("transformers")
    args = [
        "fit",
        "--data=lit_losses.data.hf_text.HFTextDataModule",
        f"--data.init_args.tokenizer={tmp_path}",
    ]
    with pytest.raises(SystemExit) as stop:
        cli_main([*args, option, f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false"])
    assert stop.value.code == 2
    line = error_line(capsys)
    assert expected in line and "tokenizer" not in line, line


PAIRS = REPO / "data" / "preference" / "pairs.jsonl"
PREFERENCE_DATA = {"class_path": "lit_losses.PreferenceDataModule", "init_args": {"paths": [str(PAIRS)]}}


def printed_data(capsys, args, **cli_options) -> dict:
    """The ``data`` section that ``lit-losses fit --print_config`` prints."""
    with pytest.raises(SystemExit) as stop:
        if cli_options:  # LitLossesCLI as a program embeds it
            LitLossesCLI(
                RegularizedLM,
                FileDataModule,
                subclass_mode_model=True,
                subclass_mode_data=True,
                args=args,
                parser_class=LitLossesParser,
                auto_configure_optimizers=False,
                **cli_options,
            )
        else:
            cli_main(args)
    assert stop.value.code == 0, capsys.readouterr().err
    return yaml.safe_load(capsys.readouterr().out)["data"]


def own_defaults(cls) -> dict:
    return {k: p.default for k, p in inspect.signature(cls).parameters.items() if k != "paths"}


@pytest.mark.parametrize("variable", ["PL_FIT__CONFIG", "PL_FIT__DATA"])
def test_a_data_class_named_by_an_environment_variable_takes_its_own_defaults(
    variable, tmp_path, capsys, monkeypatch
):
    """With the environment read (``JSONARGPARSE_DEFAULT_ENV=true``), a class that an environment variable
    names is chosen as on the command line: every option it leaves out is the class's own default, none of
    the default class's (`TextDataModule`'s ``vocab_size: 32768``, ``val_fraction: 0.02``)."""
    (tmp_path / "data.yaml").write_text(yaml.safe_dump({"data": PREFERENCE_DATA}))
    value = str(tmp_path / "data.yaml") if variable.endswith("CONFIG") else json.dumps(PREFERENCE_DATA)
    monkeypatch.setenv("JSONARGPARSE_DEFAULT_ENV", "true")
    monkeypatch.setenv(variable, value)
    data = printed_data(capsys, ["fit", "--print_config"])
    assert data["class_path"] == "lit_losses.PreferenceDataModule"
    options = {k: v for k, v in data["init_args"].items() if k != "paths"}
    assert options == own_defaults(PreferenceDataModule)
    assert options["vocab_size"] is None and options["val_fraction"] == 0.0


@pytest.mark.parametrize("where", ["main", "fit"])
def test_a_data_class_named_by_a_default_config_file_takes_its_own_defaults(where, tmp_path, capsys):
    """``parser_kwargs={"default_config_files": [...]}`` (of the main parser: options under ``fit``; or of
    ``fit``'s): the class the file names, with its own defaults."""
    config = {"fit": {"data": PREFERENCE_DATA}} if where == "main" else {"data": PREFERENCE_DATA}
    (tmp_path / "defaults.yaml").write_text(yaml.safe_dump(config))
    files = {"default_config_files": [str(tmp_path / "defaults.yaml")]}
    data = printed_data(
        capsys, ["fit", "--print_config"], parser_kwargs=files if where == "main" else {"fit": files}
    )
    assert data["class_path"] == "lit_losses.PreferenceDataModule"
    assert {k: v for k, v in data["init_args"].items() if k != "paths"} == own_defaults(PreferenceDataModule)


def test_without_a_class_named_the_default_classes_apply_with_their_defaults(capsys, monkeypatch):
    monkeypatch.setenv("JSONARGPARSE_DEFAULT_ENV", "true")
    monkeypatch.setenv("PL_FIT__TRAINER__MAX_STEPS", "3")  # the environment is read, and names no class
    data = printed_data(capsys, ["fit", "--data.init_args.seq_len=64", "--print_config"])
    assert data["class_path"] == "lit_losses.TextDataModule"
    init_args = {k: v for k, v in data["init_args"].items() if k != "paths"}
    assert init_args == {**own_defaults(TextDataModule), "seq_len": 64}


@pytest.mark.parametrize("vocab_size", [32768, 320])  # TinyLM's own default (given: refused); the data's
def test_options_given_as_a_dict_are_told_from_the_defaults(vocab_size, tmp_path, capsys):
    """LightningCLI also takes its options as a dict: a ``model.init_args.vocab_size`` given there other
    than the data's is refused, even at the model's own default, which the parse with the defaults cannot
    tell from one left out; the data's own value is taken."""
    run = {
        "trainer": {
            "max_steps": 1,
            "logger": False,
            "enable_checkpointing": False,
            "default_root_dir": str(tmp_path),
        },
        "model": {"init_args": {"vocab_size": vocab_size, "d_model": 16, "n_layers": 1, "n_heads": 2}},
        "data": {
            "init_args": {"vocab_size": 320, "max_documents": 12, "seq_len": 32, "tokens_per_batch": 64}
        },
    }
    if vocab_size == 320:
        cli = cli_main({"fit": {**run, "trainer": {**run["trainer"], "enable_progress_bar": False}}})
        assert cli.model.hparams.vocab_size == 320 and cli.trainer.global_step == 1
        return
    with pytest.raises(SystemExit) as stop:
        cli_main({"fit": run})
    assert stop.value.code == 2
    assert "model.init_args.vocab_size=32768 differs from data.init_args.vocab_size=320" in error_line(capsys)
