"""Offline distillation records → rows and micro-batches; each refusal names ``file:line`` and the field."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lit_losses import TinyLM
from lit_losses.data import DistillationDataModule
from lit_losses.data.distill_records import parse_distill_record
from lit_losses.errors import ConfigError
from tests.helpers import quiet_trainer

HALF = math.log(0.5)


def record(k=2, **changes):
    ids = [[5, 1, 2, 3][:k], [6, 2, 4, 0][:k]]
    logprobs = [[HALF, -2.0, -3.0, -4.0][:k], [-0.25, -2.5, -3.0, -5.0][:k]]
    fields = {"teacher_topk_ids": [None, *ids], "teacher_topk_logprobs": [None, *logprobs]}
    return {"tokens": [2, 5, 6], **fields, **changes}


def write(tmp_path, records):
    path = tmp_path / "topk.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_a_record_becomes_a_next_token_row_with_its_top_k_shifted():
    row = parse_distill_record(record(completion_mask=[0, 0, 1]), "records[0]", vocab_size=8)
    assert row.input_ids == [2, 5] and row.labels == [-100, 6]
    assert row.fields["teacher_topk_ids"] == [[0, 0], [6, 2]]
    assert row.fields["teacher_topk_logprobs"] == [[0.0, 0.0], [-0.25, -2.5]]


def test_the_data_module_packs_records_into_batches_of_k_wide_fields(tmp_path):
    path = write(tmp_path, [record(), record(tokens=[3, 1, 2])])
    data = DistillationDataModule(paths=[path], vocab_size=8, seq_len=4, tokens_per_batch=8)
    data.setup("fit")
    batch = data.train_set[0]
    assert batch["teacher_topk_ids"].dtype == torch.int64 and batch["teacher_topk_ids"].shape[-1] == 2
    assert batch["teacher_topk_logprobs"].dtype == torch.float32
    valid = batch["labels"] != -100
    assert int(valid.sum()) == 4
    first = batch["teacher_topk_logprobs"][valid][:, 0].exp().sum()
    torch.testing.assert_close(first, torch.tensor(2 * (0.5 + math.exp(-0.25))))
    assert {"teacher_topk_ids", "teacher_topk_logprobs"} <= set(data.batch_keys())


def test_an_offline_student_trains_on_them(tmp_path):
    path = write(tmp_path, [record(), record(tokens=[3, 1, 2])] * 4)
    data = DistillationDataModule(paths=[path], vocab_size=8, seq_len=4, tokens_per_batch=8)
    model = TinyLM(
        vocab_size=8, d_model=16, n_layers=1, n_heads=2, distillation={"teacher": None, "loss": "jsd"}
    )
    trainer = quiet_trainer(max_steps=3, enable_checkpointing=False)
    trainer.fit(model, data)
    metrics = model.telemetry["metrics"]
    assert metrics["distillation/divergence"] > 0 and 0 <= metrics["distillation/top1_agreement"] <= 1


def test_a_model_reading_top_k_refuses_data_without_them(tmp_path):
    from lit_losses import TextDataModule

    corpus = tmp_path / "c.txt"
    corpus.write_text("some text " * 200)
    model = TinyLM(vocab_size=300, d_model=16, n_layers=1, n_heads=2, distillation={"teacher": None})
    trainer = quiet_trainer(max_steps=1, enable_checkpointing=False)
    data = TextDataModule(
        paths=[str(corpus)], vocab_size=300, seq_len=16, tokens_per_batch=64, val_fraction=0.0
    )
    with pytest.raises(ConfigError, match=r"model.distillation reads batch key 'teacher_topk_ids'"):
        trainer.fit(model, data)


NULL_AT_COMPLETION = {"completion_mask": [0, 1, 1], "teacher_topk_ids": [None, None, [6, 2]]}
WIDER_LATER = {
    "teacher_topk_ids": [None, [5, 1], [6, 2, 3]],
    "teacher_topk_logprobs": [None, [-1, -2], [-1, -2, -3]],
}
BAD_RECORDS = [
    ({"teacher_topk_logprobs": [None, [0.5, -2.0], [-0.25, -2.5]]}, r"position 1: .* holds 0.5 > 0"),
    ({"teacher_topk_logprobs": [None, [-0.1, -0.2], [-0.25, -2.5]]}, r"position 1: .* Σ exp = 1.7236 > 1"),
    ({"teacher_topk_ids": [None, [5, 5], [6, 2]]}, r"position 1: teacher_topk_ids=\[5, 5\] repeats an id"),
    ({"teacher_topk_ids": [None, [5, 9], [6, 2]]}, r"position 1: .* not a token id in \[0, 8\)"),
    ({"teacher_topk_ids": [None, [5, 1], [6, 2, 3]]}, r"two lists of the same k"),
    (WIDER_LATER, r"teacher_topk_ids\[2\] has k=3 entries, the record's first 2"),
    ({"teacher_topk_ids": [None, [5, 1]]}, r"field 'teacher_topk_ids' must be a list of 3 entries"),
    (NULL_AT_COMPLETION, r"teacher_topk_ids\[1\] is null"),
    ({"teacher_topk_logprobs": [None, [float("nan"), -2.0], [-0.25, -2.5]]}, "not a finite number"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_RECORDS)
def test_bad_records_are_refused_naming_file_and_line(tmp_path, bad, message):
    path = write(tmp_path, [record(), record(**bad)])
    data = DistillationDataModule(paths=[path], vocab_size=8, seq_len=4, tokens_per_batch=8)
    with pytest.raises(ConfigError, match=rf"topk.jsonl:2.*{message}"):
        data.setup("fit")


def test_records_with_another_k_are_refused_naming_both(tmp_path):
    path = write(tmp_path, [record(k=2), record(k=3)])
    data = DistillationDataModule(paths=[path], vocab_size=8, seq_len=4, tokens_per_batch=8)
    with pytest.raises(ConfigError, match=r"topk.jsonl:2: teacher_topk_ids has k=3 .*topk.jsonl:1 has 2"):
        data.setup("fit")
