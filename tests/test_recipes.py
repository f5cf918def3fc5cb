"""The docs' recipes work as written: their files (the titled blocks) are written into a folder, and
``lit-losses fit --config <recipe>.yaml`` runs there, shortened only by command-line options."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

from lit_losses.cli.app import cli_main
from lit_losses.data import stdlib_sources
from tests.docs_blocks import DOCS, blocks, run_python_blocks, write_titled_blocks

SHORT = [
    "--trainer.max_steps=3",
    "--trainer.val_check_interval=2",
    "--trainer.limit_val_batches=1",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]


def fit_recipe(folder: Path, config: str, *args: str) -> dict:
    """Run the recipe's config in ``folder`` (its own module importable, as with ``PYTHONPATH=$PWD``)."""
    sys.path.insert(0, str(folder))
    try:
        cli_main(["fit", "--config", str(folder / config), *SHORT, *args])
    finally:
        sys.path.remove(str(folder))
    (record,) = folder.rglob("run_end.json")
    return json.loads(record.read_text())


@pytest.mark.slow
def test_own_gru_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_titled_blocks(DOCS / "recipes" / "own-gru-on-text.md", tmp_path)
    (tmp_path / "my_corpus").mkdir()
    for i, source in enumerate(stdlib_sources()[:20]):
        (tmp_path / "my_corpus" / f"{i}.txt").write_text(source, encoding="utf-8")
    small = [
        "--data.init_args.vocab_size=320",
        "--data.init_args.tokens_per_batch=512",
        "--model.init_args.d_model=32",
    ]
    record = fit_recipe(tmp_path, "gru.yaml", *small)
    assert record["reason"] == "max_steps" and record["step"] == 3 and record["checkpoints"]
    assert Path(record["log_dir"]).parts[-3:] == ("gru", "tensorboard", "version_0")


@pytest.mark.slow
def test_hf_llama_lora_recipe(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    monkeypatch.chdir(tmp_path)
    write_titled_blocks(DOCS / "recipes" / "hf-llama-lora-jsonl.md", tmp_path)
    (example,) = blocks(DOCS / "recipes" / "hf-llama-lora-jsonl.md", "json")
    lines = example.text.strip().splitlines()
    lines += [json.dumps({"text": source}) for source in stdlib_sources()[:20]]
    (tmp_path / "my_data").mkdir()
    (tmp_path / "my_data" / "train.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    small = [
        "--data.init_args.vocab_size=320",
        "--data.init_args.tokens_per_batch=512",
        "--model.init_args.config.hidden_size=32",
        "--model.init_args.config.intermediate_size=64",
    ]
    record = fit_recipe(tmp_path, "llama_lora.yaml", *small)
    assert record["reason"] == "max_steps" and record["step"] == 3


@pytest.mark.slow
def test_offline_ppo_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_python_blocks(DOCS / "recipes" / "offline-ppo-kl.md", tmp_path)  # writes my_rollouts.jsonl
    write_titled_blocks(DOCS / "recipes" / "offline-ppo-kl.md", tmp_path)
    record = fit_recipe(tmp_path, "ppo_kl.yaml")
    assert record["reason"] == "max_steps" and record["step"] == 3
    (events,) = {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}
    from lit_losses.cli.report_data import read_run

    tags = read_run(events).scalars
    assert {
        "train/base_loss/ratio_mean",
        "train/base_loss/clip_fraction",
        "regularizers/kl_reference/value",
    } <= set(tags)


@pytest.mark.slow
def test_dpo_lora_recipe(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    monkeypatch.chdir(tmp_path)
    write_titled_blocks(DOCS / "recipes" / "dpo-lora-jsonl.md", tmp_path)
    (example,) = blocks(DOCS / "recipes" / "dpo-lora-jsonl.md", "json")
    shipped = (DOCS.parent / "data" / "preference" / "pairs.jsonl").read_text(encoding="utf-8")
    (tmp_path / "my_pairs.jsonl").write_text(example.text.strip() + "\n" + shipped, encoding="utf-8")
    small = [
        "--data.init_args.vocab_size=320",
        "--data.init_args.cache_dir=cache",
        "--model.init_args.config.hidden_size=32",
        "--model.init_args.config.intermediate_size=64",
        "--model.init_args.config.num_hidden_layers=1",
        "--trainer.check_val_every_n_epoch=1",
    ]
    record = fit_recipe(tmp_path, "dpo_lora.yaml", *small)
    assert record["reason"] == "max_steps" and record["step"] == 3 and record["checkpoints"]
    assert set(record["metrics"]) >= {"rewards/accuracies", "rewards/margins", "logps/chosen"}


@pytest.mark.slow
def test_coming_from_trl_configs(tmp_path, monkeypatch):
    """The four jobs of the "Coming from TRL" page run on its stand-in model, data and rollouts."""
    pytest.importorskip("peft")
    monkeypatch.chdir(tmp_path)
    page = DOCS / "coming-from-trl.md"
    write_titled_blocks(page, tmp_path)
    for script in ("make_stand_in.py", "sample_rollouts.py"):
        runpy.run_path(str(tmp_path / script), run_name="__main__")
    expected = {
        "sft.yaml": ("cross_entropy", {"entropy", "mean_token_accuracy", "num_tokens"}),  # token_metrics
        "dpo.yaml": ("dpo", {"rewards/accuracies", "rewards/margins", "logits/chosen", "num_tokens"}),
        "grpo.yaml": ("ppo", set()),
        "distill.yaml": ("distillation", {"distillation/divergence", "distillation/top1_agreement"}),
    }
    for config, (base_loss, metrics) in expected.items():
        record = fit_recipe(tmp_path, config, "--trainer.check_val_every_n_epoch=1")
        assert record["reason"] == "max_steps" and record["step"] == 3, (config, record["detail"])
        assert record["objective"]["base_loss"] == base_loss and set(record["metrics"]) >= metrics, config
        for run_end in tmp_path.rglob("run_end.json"):
            run_end.unlink()  # the next fit_recipe finds its own record
