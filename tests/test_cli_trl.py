"""A TRL user's path through ``lit-losses``: a Hub model with its own tokenizer (from the local Hugging Face
cache, no ``vocab_size``; also as the frozen reference or teacher), another data class than the default
one, ``--model.grpo.help``, TRL's ``max_length`` on text data, and the warmup as a fraction of the run."""

from __future__ import annotations

import csv
import dataclasses
import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers")

from lit_losses import GRPOPreset, PreferenceDataModule
from lit_losses.cli.app import cli_main
from lit_losses.data.hf_text import HFTextDataModule
from lit_losses.optim import OptimizerConfig
from lit_losses.parallel import ParallelConfig

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "data" / "tokenizers" / "chatml-bpe"
SFT = REPO / "data" / "sft" / "prompt_completion.jsonl"
PAIRS = REPO / "data" / "preference" / "pairs.jsonl"
HUB_ID = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
TINY = ["--model.init_args.d_model=16", "--model.init_args.n_layers=1", "--model.init_args.n_heads=2"]


def tokenizer_size() -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(TOKENIZER))


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A Hugging Face cache (``HF_HUB_CACHE``) holding ``HUB_ID``, laid out as ``hf download`` leaves it:
    ``models--<org>--<name>/refs/main`` names the commit of ``snapshots/<commit>/``, which holds a tiny
    Llama of the shipped tokenizer's vocabulary and that tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    cache = tmp_path_factory.mktemp("hub")
    repo = cache / f"models--{HUB_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


def error_line(capsys) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("lit-losses: error:")]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_cached_hub_model_with_its_own_tokenizer_validates_as_transformers_computes(hub_cache, tmp_path):
    """``model_name_or_path`` and ``tokenizer`` a Hub id in the local cache, no ``vocab_size``: the model
    keeps its vocabulary (the tokenizer's size reaches it), and ``lit-losses validate`` gives the loss that
    the checkpoint's own ``transformers`` model gives on the same rows (float64 reference)."""
    data_args = {"paths": [str(SFT)], "seq_len": 64, "tokens_per_batch": 256, "packing": False}
    data_args["val_fraction"] = 0.25
    config = {
        "trainer": {
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(tmp_path / "logs"), "name": "run"},
            },
            "default_root_dir": str(tmp_path),
        },
        "model": {"class_path": "lit_losses.HFCausalLM", "init_args": {"model_name_or_path": HUB_ID}},
        "data": {
            "class_path": "lit_losses.data.hf_text.HFTextDataModule",
            "init_args": {"tokenizer": HUB_ID, **data_args},
        },
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "lit_losses.cli", "validate", "--config", str(tmp_path / "run.yaml"), *QUIET]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (metrics,) = (tmp_path / "logs").rglob("metrics.csv")
    (row,) = [r for r in csv.DictReader(metrics.open()) if r.get("val/loss")]
    hparams = yaml.safe_load(next((tmp_path / "logs").rglob("hparams.yaml")).read_text())
    assert hparams["vocab_size"] == tokenizer_size()  # the tokenizer's size, not TextDataModule's 32768

    from transformers import AutoModelForCausalLM

    snapshot = hub_cache / f"models--{HUB_ID.replace('/', '--')}" / "snapshots" / COMMIT
    reference = AutoModelForCausalLM.from_pretrained(snapshot).double().eval()
    data = HFTextDataModule(str(TOKENIZER), **data_args)
    data.setup("validate")
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for batch in data.val_dataloader():
            logits = reference(batch["input_ids"]).logits
            labels = batch["labels"]
            total += torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), reduction="sum"
            )
            count += int((labels != -100).sum())
    assert count > 0
    torch.testing.assert_close(float(row["val/loss"]), float(total / count), rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("model.init_args.model_name_or_path", "tiny-org/not-downloaded"),
        ("data.init_args.tokenizer", "tiny-org/gone"),
    ],
)
def test_a_hub_id_outside_the_cache_is_one_line_naming_the_option_and_the_download(
    option, value, tmp_path, capsys, monkeypatch
):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    tokenizer = value if option.startswith("data") else str(TOKENIZER)
    args = [
        "fit",
        "--model=HFCausalLM",
        f"--model.init_args.model_name_or_path={value if option.startswith('model') else HUB_ID}",
        "--data=lit_losses.data.hf_text.HFTextDataModule",
        f"--data.init_args.tokenizer={tokenizer}",
        f"--data.init_args.paths=[{SFT}]",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    with pytest.raises(SystemExit) as stop:
        cli_main(args)
    assert stop.value.code == 2
    line = error_line(capsys)
    assert (
        f"{option} {value!r} is neither a local directory nor a Hub id in the local Hugging Face cache"
        in line
    )
    assert str(tmp_path / "empty-cache") in line and f"hf download {value}" in line


def test_another_data_class_takes_its_own_defaults_and_gives_the_model_the_tokenizer_size(tmp_path, capsys):
    """``data.class_path: PreferenceDataModule`` with a tokenizer: every option left out is the class's own
    default (none of TextDataModule's: ``vocab_size``, ``val_fraction``), and the model is built with the
    tokenizer's vocabulary."""
    given = {"paths": [str(PAIRS)], "tokenizer": str(TOKENIZER), "max_length": 64, "tokens_per_batch": 512}
    config = {"data": {"class_path": "lit_losses.PreferenceDataModule", "init_args": given}}
    (tmp_path / "pref.yaml").write_text(yaml.safe_dump(config))
    args = ["fit", "--config", str(tmp_path / "pref.yaml"), *TINY, f"--trainer.default_root_dir={tmp_path}"]
    with pytest.raises(SystemExit) as stop:
        cli_main([*args, "--print_config"])
    assert stop.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)["data"]["init_args"]
    defaults = {k: p.default for k, p in inspect.signature(PreferenceDataModule).parameters.items()}
    assert {k: v for k, v in printed.items() if k not in given} == {
        k: v for k, v in defaults.items() if k not in given
    }
    cli = cli_main([*args, "--trainer.max_steps=1", "--trainer.logger=false", *QUIET])
    assert cli.model.hparams.vocab_size == tokenizer_size() == cli.model.output_projection()[0].shape[0]
    assert cli.datamodule.val_set is None  # val_fraction 0.0: every pair trains
    assert cli.trainer.global_step == 1


@pytest.mark.parametrize(
    ("args", "fields"),
    [
        (["--model.grpo.help"], GRPOPreset),
        (["--model.init_args.dpo.help"], "DPOPreset"),
        (["--model=HFCausalLM", "--model.init_args.parallel.help"], ParallelConfig),
    ],
)
def test_the_nested_help_that_model_help_advertises_prints_its_fields(args, fields, capsys):
    import lit_losses

    cls = getattr(lit_losses, fields) if isinstance(fields, str) else fields
    with pytest.raises(SystemExit) as stop:
        cli_main(["fit", *args])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    option = args[-1].replace(".init_args", "").removesuffix(".help")
    assert f"Help for {option}.help=" in out
    missing = [f.name for f in dataclasses.fields(cls) if f"{option}.{f.name} " not in out]
    assert not missing


def test_trls_max_length_on_text_data_is_refused_before_training(tmp_path, capsys):
    """Text data keeps one name for the longest row, ``seq_len``; TRL's ``max_length`` (the preference data's
    name) is refused there, never taken silently beside it."""
    args = [
        "fit",
        *TINY,
        "--data=lit_losses.data.hf_text.HFTextDataModule",
        f"--data.init_args.tokenizer={TOKENIZER}",
        f"--data.init_args.paths=[{SFT}]",
        "--data.init_args.max_length=64",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    with pytest.raises(SystemExit) as stop:
        cli_main(args)
    assert stop.value.code == 2
    line = error_line(capsys)
    assert "data.init_args.max_length: not an option of HFTextDataModule" in line
    assert "data.init_args.seq_len for text data" in line
    assert not list(tmp_path.rglob("*.ckpt"))


@pytest.mark.parametrize("total", [1, 7, 8, 30, 1000])
@pytest.mark.parametrize("fraction", [0.0, 0.03, 0.25, 0.5])
def test_a_warmup_fraction_counts_the_steps_as_transformers(total, fraction, tmp_path):
    from transformers import TrainingArguments

    expected = TrainingArguments(output_dir=str(tmp_path), warmup_steps=fraction).get_warmup_steps(total)
    assert OptimizerConfig(warmup_steps=fraction).warmup(total) == expected
    assert OptimizerConfig(warmup_ratio=fraction).warmup(total) == expected


def test_warmup_ratio_sets_the_schedule_of_a_run(tmp_path):
    """``optimizer.warmup_ratio`` through ``lit-losses fit``: the learning rate of each of the run's 8 steps
    rises over ``ceil(0.25 × 8) = 2`` steps from ``lr/3``, then decays linearly to 0 at step 8."""
    optimizer = {"lr": 0.01, "warmup_ratio": 0.25, "schedule": "linear", "min_lr_ratio": 0.0}
    args = [
        "fit",
        *TINY,
        f"--model.init_args.optimizer={json.dumps(optimizer)}",
        "--data.init_args.vocab_size=320",
        "--data.init_args.max_documents=12",
        "--data.init_args.seq_len=32",
        "--data.init_args.tokens_per_batch=64",
        "--trainer.max_steps=8",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        f"--trainer.default_root_dir={tmp_path}",
        *QUIET,
    ]
    cli = cli_main(args)
    scheduler = cli.trainer.lr_scheduler_configs[0].scheduler
    assert cli.trainer.global_step == 8
    warmup = [1 / 3 + (2 / 3) * k / 2 for k in range(2)]
    expected = [0.01 * f for f in warmup + [1 - (k - 2) / 6 for k in range(2, 9)]]
    torch.testing.assert_close([0.01 * scheduler.lr_lambdas[0](k) for k in range(9)], expected)
    assert scheduler.get_last_lr()[0] == pytest.approx(expected[8])


def test_warmup_steps_and_warmup_ratio_together_are_refused(tmp_path, capsys):
    optimizer = json.dumps({"warmup_steps": 20, "warmup_ratio": 0.1})
    with pytest.raises(SystemExit) as stop:
        cli_main(
            [
                "fit",
                *TINY,
                f"--model.init_args.optimizer={optimizer}",
                f"--trainer.default_root_dir={tmp_path}",
            ]
        )
    assert stop.value.code == 2
    assert "optimizer.warmup_steps=20 and optimizer.warmup_ratio=0.1 both set the warmup" in error_line(
        capsys
    )


def test_a_run_on_a_tokenizers_vocabulary_resumes_and_refuses_another_vocabulary(tmp_path, capsys):
    """The vocabulary a data module gives the model (the tokenizer's size) is the checkpoint's when the
    run resumes with the same options; another one is refused before training, naming both sizes: given
    as ``data.vocab_size``, or a tokenizer of another size in the same directory."""
    from tests.data.chat_tokenizer import build

    root, tokenizer = tmp_path / "run", tmp_path / "tokenizer"
    shutil.copytree(TOKENIZER, tokenizer)
    args = [
        "fit",
        *TINY,
        "--data=lit_losses.data.hf_text.HFTextDataModule",
        f"--data.init_args.tokenizer={tokenizer}",
        f"--data.init_args.paths=[{SFT}]",
        "--data.init_args.seq_len=64",
        "--data.init_args.tokens_per_batch=128",
        "--trainer.logger=false",
        f"--trainer.default_root_dir={root}",
        *QUIET,
    ]
    cli_main([*args, "--trainer.max_steps=1"])
    (ckpt,) = root.rglob("*.ckpt")
    resumed = cli_main([*args, "--trainer.max_steps=2", f"--ckpt_path={ckpt}"])
    assert resumed.trainer.global_step == 2 and resumed.model.hparams.vocab_size == tokenizer_size()
    with pytest.raises(SystemExit) as stop:
        cli_main([*args, "--trainer.max_steps=3", f"--ckpt_path={ckpt}", "--data.init_args.vocab_size=800"])
    assert stop.value.code == 2
    assert f"data.init_args.vocab_size: {tokenizer_size()} in the checkpoint, 800 now" in error_line(capsys)
    shutil.rmtree(tokenizer)
    build(tokenizer, vocab_size=650)
    with pytest.raises(SystemExit) as stop:
        cli_main([*args, "--trainer.max_steps=3", f"--ckpt_path={ckpt}"])
    assert stop.value.code == 2
    expected = f"model.init_args.vocab_size: {tokenizer_size()} in the checkpoint, 650 now (data.vocab_size"
    assert expected in error_line(capsys)


FROZEN_OPTIONS = {  # option → (model options naming the Hub id, data, name of the frozen model)
    "ref_model": (
        {"dpo": {"loss_type": "sigmoid", "beta": 0.1}, "ref_model": HUB_ID},
        {
            "class_path": "lit_losses.PreferenceDataModule",
            "init_args": {"paths": [str(PAIRS)], "max_length": 64},
        },
        "reference",
    ),
    "distillation.teacher": (
        {"distillation": {"teacher": HUB_ID, "loss": "jsd"}},
        {"class_path": "lit_losses.data.hf_text.HFTextDataModule", "init_args": {"paths": [str(SFT)]}},
        "teacher",
    ),
}


def frozen_run_config(tmp_path: Path, option: str, source: str) -> Path:
    """A TinyLM run (the tokenizer's vocabulary) whose ``model.<option>`` is ``source``, as a config file."""
    model, data, _ = FROZEN_OPTIONS[option]
    model = json.loads(json.dumps(model).replace(HUB_ID, source))
    data = {**data, "init_args": {**data["init_args"], "tokenizer": str(TOKENIZER), "tokens_per_batch": 256}}
    config = {"model": {"class_path": "lit_losses.TinyLM", "init_args": model}, "data": data}
    (tmp_path / "frozen.yaml").write_text(yaml.safe_dump(config))
    return tmp_path / "frozen.yaml"


@pytest.mark.parametrize("option", list(FROZEN_OPTIONS))
def test_a_cached_hub_model_is_a_frozen_reference_or_teacher(option, hub_cache, tmp_path, monkeypatch):
    """``model.ref_model`` / ``model.distillation.teacher`` a Hub id in the local cache (as
    ``model_name_or_path``): the run trains with that model frozen, whose log-probabilities are the
    snapshot's ``transformers`` model's (float64 reference), and the hyper-parameters keep the id."""
    from huggingface_hub import constants
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    config = frozen_run_config(tmp_path, option, HUB_ID)
    args = ["fit", "--config", str(config), *TINY, "--trainer.max_steps=1", "--trainer.logger=false"]
    cli = cli_main(
        [*args, "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={tmp_path}", *QUIET]
    )
    assert cli.trainer.global_step == 1
    hparams = cli.model.hparams
    given = hparams["ref_model"] if option == "ref_model" else hparams["distillation"]["teacher"]
    assert given == HUB_ID
    frozen = cli.model.frozen_model(FROZEN_OPTIONS[option][2])
    data = HFTextDataModule(
        str(TOKENIZER), paths=[str(SFT)], seq_len=64, tokens_per_batch=256, packing=False, val_fraction=0.25
    )
    data.setup("validate")
    batch = next(iter(data.val_dataloader()))
    labels = batch["labels"]
    snapshot = hub_cache / f"models--{HUB_ID.replace('/', '--')}" / "snapshots" / COMMIT
    reference = AutoModelForCausalLM.from_pretrained(snapshot).double().eval()
    with torch.no_grad():
        logp = reference(batch["input_ids"]).logits.log_softmax(-1)
        got = frozen.logprobs(batch, labels)
    expected = logp.gather(-1, labels.clamp_min(0)[..., None])[..., 0] * (labels != -100)
    assert int((labels != -100).sum()) > 0
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("option", list(FROZEN_OPTIONS))
def test_a_frozen_hub_id_outside_the_cache_is_the_same_one_line(option, tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    config = frozen_run_config(tmp_path, option, "tiny-org/not-downloaded")
    with pytest.raises(SystemExit) as stop:
        cli_main(["fit", "--config", str(config), *TINY, f"--trainer.default_root_dir={tmp_path}"])
    assert stop.value.code == 2
    line = error_line(capsys)
    assert (
        f"model.{option} 'tiny-org/not-downloaded' is neither a local directory nor a Hub id in the local "
        "Hugging Face cache" in line
    )
    assert str(tmp_path / "empty-cache") in line and "hf download tiny-org/not-downloaded" in line
    assert not list(tmp_path.rglob("*.ckpt"))


TEXT_RUN = [  # TextDataModule's BPE vocabulary of 320 tokens, one step
    *TINY,
    "--data.init_args.vocab_size=320",
    "--data.init_args.max_documents=12",
    "--data.init_args.seq_len=32",
    "--data.init_args.tokens_per_batch=64",
    "--trainer.max_steps=1",
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
    *QUIET,
]


@pytest.mark.parametrize("where", ["command_line", "config_file"])
@pytest.mark.parametrize("vocab_size", [500, 32768])  # 32768: TinyLM's own default, given
def test_a_model_vocab_size_other_than_the_datas_is_refused(where, vocab_size, tmp_path, capsys):
    """The data module's ``vocab_size`` replaces the model's when it is built: a model value given that
    differs (even TinyLM's default, written out) is one line naming both options and values, exit 2."""
    given = [f"--model.init_args.vocab_size={vocab_size}"]
    if where == "config_file":
        config = {"model": {"class_path": "lit_losses.TinyLM", "init_args": {"vocab_size": vocab_size}}}
        (tmp_path / "model.yaml").write_text(yaml.safe_dump(config))
        given = ["--config", str(tmp_path / "model.yaml")]
    with pytest.raises(SystemExit) as stop:
        cli_main(["fit", *given, *TEXT_RUN, f"--trainer.default_root_dir={tmp_path}"])
    assert stop.value.code == 2
    line = error_line(capsys)
    assert f"model.init_args.vocab_size={vocab_size} differs from data.init_args.vocab_size=320" in line


def test_a_model_vocab_size_equal_to_the_datas_is_taken(tmp_path):
    cli = cli_main(
        ["fit", "--model.init_args.vocab_size=320", *TEXT_RUN, f"--trainer.default_root_dir={tmp_path}"]
    )
    assert cli.trainer.global_step == 1
    assert cli.model.hparams.vocab_size == 320 == cli.model.output_projection()[0].shape[0]


def test_a_model_vocab_size_other_than_the_tokenizers_is_refused(tmp_path, capsys):
    """With a tokenizer the data's vocabulary is its size (``data.init_args.vocab_size`` left null)."""
    args = [
        "fit",
        *TINY,
        "--model.init_args.vocab_size=999",
        "--data=lit_losses.data.hf_text.HFTextDataModule",
        f"--data.init_args.tokenizer={TOKENIZER}",
        f"--data.init_args.paths=[{SFT}]",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    with pytest.raises(SystemExit) as stop:
        cli_main(args)
    assert stop.value.code == 2
    expected = (
        f"model.init_args.vocab_size=999 differs from data.vocab_size={tokenizer_size()} (HFTextDataModule's "
        "own: data.init_args.vocab_size is null), which the model takes when it is built"
    )
    assert expected in error_line(capsys)
