"""``old_logprobs`` in offline RL records (π_old beside the engine's ``logprobs``): aligned like
``logprobs`` in the flat form, like Tinker's ``loss_fn_inputs`` in the Datum form, served as the batch key
``old_logprobs``; in some records only, of another length or > 0: one error naming ``file:line``."""

from __future__ import annotations

import json

import pytest

from lit_losses.data import rl_dataset
from lit_losses.data.rl_records import complete_fields, parse_record, read_jsonl
from lit_losses.errors import ConfigError

N = -100
FLAT_WITHOUT_OLD = {
    "tokens": [7, 3, 9, 4, 5, 1],
    "logprobs": [None, None, None, -0.5, -1.25, -2.0],
    "advantage": 0.5,
}
FLAT = {
    "tokens": [7, 3, 9, 4, 5, 1],
    "logprobs": [None, None, None, -0.5, -1.25, -2.0],
    "old_logprobs": [None, None, None, -0.625, -1.0, -2.5],
    "advantage": 0.5,
}


def test_flat_old_logprobs_are_shifted_like_logprobs():
    row = parse_record(FLAT, "f.jsonl:1", vocab_size=10)
    assert row.labels == [N, N, 4, 5, 1]
    assert row.fields["sampling_logprobs"] == [0.0, 0.0, -0.5, -1.25, -2.0]
    assert row.fields["old_logprobs"] == [0.0, 0.0, -0.625, -1.0, -2.5]


def test_datum_old_logprobs_are_target_aligned_and_give_the_flat_row():
    datum = {
        "model_input": [7, 3, 9, 4, 5],
        "loss_fn_inputs": {
            "target_tokens": [3, 9, 4, 5, 1],
            "logprobs": [0, 0, -0.5, -1.25, -2.0],
            "old_logprobs": {"data": [0, 0, -0.625, -1.0, -2.5]},
            "advantages": [0, 0, 0.5, 0.5, 0.5],
            "mask": [0, 0, 1, 1, 1],
        },
    }
    assert parse_record(datum, "d") == parse_record(FLAT, "f")


def test_the_batch_carries_old_logprobs_where_the_records_have_them():
    other = {
        "tokens": [2, 6, 8],
        "logprobs": [None, -0.75, -0.5],
        "old_logprobs": [None, -1.0, -0.25],
        "advantage": -1.0,
    }
    batch = rl_dataset([FLAT, other], seq_len=8, tokens_per_batch=16, vocab_size=10)[0]
    assert batch["labels"].tolist() == [[N, N, 4, 5, 1, 6, 8]]
    assert batch["old_logprobs"].tolist() == [[0.0, 0.0, -0.625, -1.0, -2.5, -1.0, -0.25]]
    without = rl_dataset(
        [{k: v for k, v in FLAT.items() if k != "old_logprobs"}], seq_len=8, tokens_per_batch=8
    )
    assert "old_logprobs" not in without[0]


BAD = [
    (
        "other_length",
        {**FLAT, "old_logprobs": [None, None, -0.5, -1.0, -2.5]},
        "field 'old_logprobs' has 5 entries but 'logprobs' has 6: old_logprobs is aligned like logprobs",
    ),
    (
        "positive",
        {**FLAT, "old_logprobs": [None, None, None, -0.5, 0.25, -2.0]},
        "old_logprobs[4]=0.25 is > 0, not a log-probability",
    ),
    (
        "null_at_a_completion_token",
        {**FLAT, "old_logprobs": [None, None, None, -0.5, None, -2.0]},
        "old_logprobs[4] is null at a completion token",
    ),
    (
        "misspelt",
        {**FLAT_WITHOUT_OLD, "old_logprob": FLAT["old_logprobs"]},
        "unknown field 'old_logprob'; did you mean 'old_logprobs'?",
    ),
    (
        "datum_other_length",
        {
            "model_input": [7, 3],
            "loss_fn_inputs": {
                "target_tokens": [3, 9],
                "logprobs": [0, -1.0],
                "old_logprobs": [-1.0],
                "advantages": [0, 1.0],
                "mask": [0, 1],
            },
        },
        "loss_fn_inputs: field 'old_logprobs' has 1 entries but 'logprobs' has 2",
    ),
]


@pytest.mark.parametrize(("record", "expected"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_a_bad_old_logprobs_is_one_error_naming_file_and_line(tmp_path, record, expected):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(FLAT) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ConfigError) as err:
        complete_fields(read_jsonl(str(path), vocab_size=10))
    message = str(err.value)
    assert message.startswith(f"{path}:2") and "\n" not in message, message
    assert expected in message, message


def test_old_logprobs_in_some_records_only_names_both_records(tmp_path):
    path = tmp_path / "r.jsonl"
    without = {k: v for k, v in FLAT.items() if k != "old_logprobs"}
    path.write_text("\n".join(json.dumps(r) for r in (without, FLAT, without)) + "\n")
    with pytest.raises(ConfigError, match=rf"^{path}:1: missing field 'old_logprobs', which {path}:2 has"):
        complete_fields(read_jsonl(str(path)))
