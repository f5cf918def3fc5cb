"""``model.distillation`` from the command line: the shipped recipe's options parse, and each bad input
fails before training with exit code 2 and one ``lit-losses: error:`` line naming the value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lit_losses.cli import cli_main

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")

REPO = Path(__file__).resolve().parents[1]
M, D = "--model.init_args.", "--data.init_args."
TEACHER = dict(model_type="llama", vocab_size=300, hidden_size=24, intermediate_size=32, num_hidden_layers=1)
TEACHER["num_attention_heads"] = 2
TEXT = "the quick brown fox jumps over the lazy dog. " * 8
RECORD = {"tokens": [2, 5, 6], "teacher_topk_ids": [None, [5, 1], [6, 2]]}
RECORD["teacher_topk_logprobs"] = [None, [-0.7, -2.0], [-0.25, -2.5]]
WIDER = {
    "teacher_topk_ids": [None, [5, 1, 3], [6, 2, 3]],
    "teacher_topk_logprobs": [None, [-1, -2, -3], [-1, -2, -3]],
}


def run(tmp_path: Path, *args: str, text_data: bool = True) -> None:
    base = ["fit", "--config", str(REPO / "configs" / "tiny_lm.yaml"), "--trainer.logger=false"]
    base += ["--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path / 'run'}"]
    base += ["--trainer.enable_checkpointing=false", f"{M}d_model=16", f"{M}n_heads=2", f"{M}n_layers=1"]
    if text_data:
        (tmp_path / "corpus.txt").write_text(TEXT)
        base += [f"{D}vocab_size=300", f"{D}seq_len=16", f"{D}tokens_per_batch=32"]
        base += [f"{D}cache_dir={tmp_path / 'cache'}", f"{D}paths=[{tmp_path / 'corpus.txt'}]"]
        base += [f"{D}val_fraction=0"]  # one document: no validation item to hold out
    cli_main([*base, *args])


def teacher_args(**changes) -> list[str]:
    return [f"{M}distillation={json.dumps({'teacher': {**TEACHER, **changes}, 'loss': 'jsd'})}"]


def offline(tmp_path: Path, records: list[dict]) -> list[str]:
    path = tmp_path / "topk.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    init = {"paths": [str(path)], "vocab_size": 8, "seq_len": 4, "tokens_per_batch": 8}
    data = {"class_path": "lit_losses.data.DistillationDataModule", "init_args": init}
    config = tmp_path / "offline.yaml"  # as a recipe writes it
    config.write_text(
        yaml.safe_dump({"model": {"init_args": {"distillation": {"teacher": None}}}, "data": data})
    )
    return ["--config", str(config)]


CASES = {
    "vocabularies_differ": (
        lambda tmp: teacher_args(vocab_size=301),
        "has a vocabulary of 301 tokens and the student (TinyLM) 300",
    ),
    "beta_outside": (
        lambda tmp: [*teacher_args(), f"{M}distillation.beta=1.5"],
        "model.distillation.beta must be in [0, 1], got 1.5",
    ),
    "temperature_zero": (
        lambda tmp: [*teacher_args(), f"{M}distillation.temperature=0"],
        "model.distillation.temperature must be a finite number > 0, got 0",
    ),
    "temperature_negative": (
        lambda tmp: [*teacher_args(), f"{M}distillation.temperature=-1.0"],
        "model.distillation.temperature must be a finite number > 0, got -1.0",
    ),
    "teacher_missing": (
        lambda tmp: [f"{M}distillation.teacher={tmp / 'no_teacher'}"],
        "no such file or directory",
    ),
    "teacher_unknown_type": (
        lambda tmp: teacher_args(model_type="lama"),
        "model.distillation.teacher.model_type 'lama' is not a transformers model type",
    ),
    "k_differs": (
        lambda tmp: offline(tmp, [RECORD, {**RECORD, **WIDER}]),
        "topk.jsonl:2: teacher_topk_ids has k=3 entries per position",
    ),
    "logprob_positive": (
        lambda tmp: offline(tmp, [{**RECORD, "teacher_topk_logprobs": [None, [0.5, -2.0], [-0.25, -2.5]]}]),
        "topk.jsonl:1 position 1: teacher_topk_logprobs holds 0.5 > 0",
    ),
    "mass_above_one": (
        lambda tmp: offline(tmp, [{**RECORD, "teacher_topk_logprobs": [None, [-0.1, -0.2], [-0.25, -2.5]]}]),
        "topk.jsonl:1 position 1: teacher_topk_logprobs hold a mass Σ exp = 1.7236 > 1",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_distillation_input_is_one_line_before_training(name, tmp_path, capsys):
    extra, expected = CASES[name]
    args = extra(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        run(tmp_path, *args, text_data="--config" not in args)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert exit_info.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith("lit-losses: error: "), err
    assert expected in lines[0], lines[0]


def test_the_recipe_sets_a_teacher_of_another_width_and_the_students_vocabulary():
    recipe = yaml.safe_load((REPO / "configs" / "distill.yaml").read_text())
    base = yaml.safe_load((REPO / "configs" / "hf_causal_lm.yaml").read_text())
    teacher = recipe["model"]["init_args"]["distillation"]["teacher"]
    student = base["model"]["init_args"]["config"]
    assert teacher["hidden_size"] != student["hidden_size"]
    assert teacher["vocab_size"] == base["data"]["init_args"]["vocab_size"]


@pytest.mark.slow
def test_the_recipe_distils_a_hugging_face_student_from_a_hugging_face_teacher(tmp_path):
    """``lit-losses fit --config configs/hf_causal_lm.yaml --config configs/distill.yaml``, short."""
    configs = [
        "--config",
        str(REPO / "configs" / "hf_causal_lm.yaml"),
        "--config",
        str(REPO / "configs" / "distill.yaml"),
    ]
    short = ["--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.logger=false"]
    short += ["--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false"]
    short += [f"--trainer.default_root_dir={tmp_path}", f"{D}max_documents=20", f"{D}vocab_size=512"]
    short += [f"{M}distillation.teacher.vocab_size=512", f"{D}tokens_per_batch=1024"]
    cli = cli_main(["fit", *configs, *short])
    model = cli.model
    metrics = model.telemetry["metrics"]
    assert metrics["distillation/divergence"] > 0 and metrics["distillation/hard_ce"] > 0
    teacher = model.frozen_model("teacher").runner
    assert teacher.lm.config.hidden_size == 256 != model.output_projection()[0].shape[1]
