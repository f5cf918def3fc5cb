"""``lit-losses fit --config configs/sft_prompt_completion.yaml`` (in-process, a few steps) trains on the
shipped prompt-completion JSONL's completion tokens only (``completion_only_loss``), and on the shipped
conversations' assistant turns only (``assistant_only_loss``, a Hugging Face tokenizer with a chat
template): every micro-batch the model sees is checked against the records, tokenized here directly."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest

pytest.importorskip("transformers")

from transformers import AutoTokenizer

from lit_losses.cli import cli_main

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "sft_prompt_completion.yaml"
PROMPT_COMPLETION = REPO / "data" / "sft" / "prompt_completion.jsonl"
CONVERSATIONAL = REPO / "data" / "sft" / "conversational.jsonl"
CHAT_TOKENIZER = REPO / "data" / "tokenizers" / "chatml-bpe"
STEPS = 3


class RecordTargets(L.Callback):
    """Keeps every training micro-batch's tokens, labels, segments and the loader's count of its
    labelled tokens (the denominator of the token-mean loss)."""

    def __init__(self) -> None:
        self.batches: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        kept = {key: batch[key].clone() for key in ("input_ids", "labels", "segment_ids")}
        self.batches.append(kept | {"counted": batch["global_stats"].get_local().num_tokens})


def seen_sequences(batch: dict) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    out = []
    for ids, labels, segs in zip(batch["input_ids"], batch["labels"], batch["segment_ids"]):
        for s in segs.unique().tolist():
            if s:
                targets = labels[segs == s]
                out.append((tuple(ids[segs == s].tolist()), tuple(targets[targets != -100].tolist())))
    return out


def fit(root: Path, *args: str):
    cli = cli_main(
        [
            "fit",
            "--config",
            str(CONFIG),
            f"--trainer.max_steps={STEPS}",
            f"--trainer.default_root_dir={root}",
            f"--trainer.logger.init_args.save_dir={root}",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            "--trainer.limit_val_batches=1",
            "--trainer.callbacks+=tests.test_sft_prompt_completion.RecordTargets",
            *args,
        ]
    )
    assert cli.trainer.global_step == STEPS
    (recorder,) = [c for c in cli.trainer.callbacks if isinstance(c, RecordTargets)]
    assert len(recorder.batches) == STEPS
    return cli, recorder.batches


def check(batches: list[dict], expected: set) -> None:
    """Every sequence of every micro-batch is a record's (tokens, trained targets), and the loader counted
    exactly those targets."""
    for batch in batches:
        sequences = seen_sequences(batch)
        assert sequences and set(sequences) <= expected
        assert batch["counted"] == sum(len(targets) for _, targets in sequences)


def records_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_fit_on_prompt_completion_trains_on_completion_tokens_only(tmp_path):
    cli, batches = fit(
        tmp_path / "run",
        f"--data.init_args.paths=[{PROMPT_COMPLETION}]",
        f"--data.init_args.cache_dir={tmp_path / 'cache'}",
    )
    assert cli.datamodule.completion_only_loss is True
    bpe, expected = cli.datamodule.tokenizer, set()
    for record in records_of(PROMPT_COMPLETION):
        prompt = bpe.encode(record["prompt"]).ids
        full = bpe.encode(record["prompt"] + record["completion"] + "<|endoftext|>").ids
        expected.add((tuple(full), tuple(full[len(prompt) :])))
    check(batches, expected)


def test_fit_on_conversations_trains_on_assistant_turns_only(tmp_path):
    cli, batches = fit(
        tmp_path / "run",
        "--data.class_path=lit_losses.data.hf_text.HFTextDataModule",
        f"--data.init_args.tokenizer={CHAT_TOKENIZER}",
        "--data.init_args.vocab_size=700",
        f"--data.init_args.paths=[{CONVERSATIONAL}]",
        "--data.init_args.assistant_only_loss=true",
        "--data.init_args.completion_only_loss=null",
    )
    assert cli.datamodule.assistant_only_loss is True
    tok = AutoTokenizer.from_pretrained(str(CHAT_TOKENIZER))
    im_end, expected = tok.convert_tokens_to_ids("<|im_end|>"), set()
    for record in records_of(CONVERSATIONAL):
        full = tok.apply_chat_template(record["messages"], tokenize=True, return_dict=True)["input_ids"]
        turns = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        expected.add((tuple(full), tuple(t for c in turns for t in [*tok(c)["input_ids"], im_end])))
    check(batches, expected)
