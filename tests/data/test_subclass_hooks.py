"""The data modules' public hooks that a user subclass overrides or calls: ``RLDataModule.read_rows()``,
``DistillationDataModule.read_rows()`` and ``PreferenceDataModule.read_records()`` (no arguments: every
record, checked, shuffled and cut). A subclass that filters the records there trains on exactly the records
it keeps; the reference is the kept records themselves (their tokens, or the tokenizer called directly)."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from lit_losses.data import DistillationDataModule, PreferenceDataModule, RLDataModule
from lit_losses.data.preference_records import Record
from lit_losses.data.rl_records import RLRow

V = 40


def write(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def segments(data) -> Counter:
    """The input tokens of every packed segment of the training micro-batches."""
    found: Counter = Counter()
    for index in range(len(data.train_set)):
        batch = data.train_set[index]
        for ids, seg in zip(batch["input_ids"], batch["segment_ids"], strict=True):
            for s in seg.unique().tolist():
                if s > 0:
                    found[tuple(ids[seg == s].tolist())] += 1
    return found


def rl_records(count: int) -> list[dict]:
    rng = random.Random(0)
    records = []
    for i in range(count):
        tokens = [i + 1, *(rng.randrange(V) for _ in range(rng.randint(1, 5)))]
        logprobs = [None, *(-rng.random() for _ in tokens[1:])]
        records.append({"tokens": tokens, "logprobs": logprobs, "advantage": 1.0 if i % 3 else -1.0})
    return records


class PositiveRL(RLDataModule):
    """Trains only on the records of positive advantage."""

    def read_rows(self) -> list[RLRow]:
        return [row for row in super().read_rows() if row.fields["advantages"][-1] > 0]


class EvenDistillation(DistillationDataModule):
    """Trains only on the records whose first token is even."""

    def read_rows(self) -> list[RLRow]:
        return [row for row in super().read_rows() if row.input_ids[0] % 2 == 0]


def test_an_rl_subclass_filtering_read_rows_trains_on_the_rows_it_keeps(tmp_path):
    records = rl_records(12)
    path = write(tmp_path / "rl.jsonl", records)
    options = {"paths": [path], "vocab_size": V, "seq_len": 8, "tokens_per_batch": 16, "seed": 3}
    kept = Counter(tuple(r["tokens"][:-1]) for r in records if r["advantage"] > 0)
    data = PositiveRL(**options)
    data.setup("fit")
    assert segments(data) == kept
    every = RLDataModule(**options)  # the filter is the subclass's: the module itself keeps every record
    every.setup("fit")
    assert segments(every) == Counter(tuple(r["tokens"][:-1]) for r in records)
    assert Counter(tuple(row.input_ids) for row in data.read_rows()) == kept  # callable, with no arguments


def test_a_distillation_subclass_filtering_read_rows_trains_on_the_rows_it_keeps(tmp_path):
    records = [
        {
            "tokens": [first, 3, 5],
            "teacher_topk_ids": [None, [3, 1], [5, 2]],
            "teacher_topk_logprobs": [None, [-0.25, -2.0], [-0.5, -1.5]],
        }
        for first in range(10)
    ]
    path = write(tmp_path / "topk.jsonl", records)
    data = EvenDistillation(paths=[path], vocab_size=V, seq_len=4, tokens_per_batch=8)
    data.setup("fit")
    assert segments(data) == Counter((first, 3) for first in range(0, 10, 2))
    assert set(data.batch_keys()) >= {"teacher_topk_ids", "teacher_topk_logprobs"}


def test_a_preference_subclass_filtering_read_records_trains_on_the_records_it_keeps(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from tests.data.chat_tokenizer import SHIPPED

    tok = AutoTokenizer.from_pretrained(str(SHIPPED))
    pairs = [
        {"prompt": f"Q{i}: what is {i} + {i}?", "chosen": f" {2 * i}.", "rejected": " No idea."}
        for i in range(9)
    ]
    path = write(tmp_path / "pairs.jsonl", pairs)

    class Odd(PreferenceDataModule):
        def read_records(self) -> list[Record]:
            return [r for r in super().read_records() if int(r.where.rpartition(":")[2]) % 2 == 1]

    data = Odd(paths=[path], tokenizer=str(SHIPPED), vocab_size=None, max_length=64, tokens_per_batch=256)
    assert sorted(int(r.where.rpartition(":")[2]) for r in data.read_records()) == [1, 3, 5, 7, 9]
    data.setup("fit")
    rows = Counter()
    for index in range(len(data.train_set)):
        batch = data.train_set[index]
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True):
            rows[tuple(ids[mask.bool()].tolist())] += 1
    reference = Counter()
    for p in pairs[::2]:  # lines 1, 3, 5, 7, 9
        for field in ("chosen", "rejected"):
            reference[tuple(tok(p["prompt"] + p[field] + tok.eos_token)["input_ids"])] += 1
    assert rows == reference
