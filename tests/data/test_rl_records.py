"""Offline RL records → next-token rows (`lit_losses.data.rl_records`): alignment written out by hand, the
Datum form equal to the flat form, and every bad record one error naming file:line and the field."""

from __future__ import annotations

import json
import math

import pytest

from lit_losses.data.rl_records import complete_fields, parse_record, read_jsonl, write_jsonl
from lit_losses.errors import ConfigError

N = -100


def test_flat_record_with_a_sequence_advantage_shifts_every_field_by_one():
    record = {
        "tokens": [7, 3, 9, 4, 5, 1],  # prompt 7 3 9, completion 4 5 1
        "logprobs": [None, None, None, -0.5, -1.25, -2.0],
        "ref_logprobs": [None, None, None, -0.75, -1.0, -3.0],
        "advantage": 0.5,
        "sample_weight": 2.0,
        "reward": 1.0,  # ignored
    }
    row = parse_record(record, "f.jsonl:1", vocab_size=10, seq_len=5)
    # input position t predicts tokens[t + 1]: prompt targets 3, 9 are not trained on
    assert row.input_ids == [7, 3, 9, 4, 5]
    assert row.labels == [N, N, 4, 5, 1]
    assert row.fields == {
        "sampling_logprobs": [0.0, 0.0, -0.5, -1.25, -2.0],
        "advantages": [0.0, 0.0, 0.5, 0.5, 0.5],
        "ref_logprobs": [0.0, 0.0, -0.75, -1.0, -3.0],
        "sample_weights": [0.0, 0.0, 2.0, 2.0, 2.0],
    }


def test_flat_record_with_per_token_advantages_weights_and_a_mask():
    record = {
        "tokens": [2, 8, 6, 3, 0],
        "logprobs": [None, -9.0, -0.5, -1.5, -0.25],  # a prompt logprob (vLLM's prompt_logprobs): ignored
        "completion_mask": [0, 0, 1, 1, 1],
        "weights": [0.0, 0.0, 1.0, 0.0, 0.5],  # weight 0: no target (neither trained on nor counted)
        "advantages": [None, None, 1.5, 2.5, -1.0],
    }
    row = parse_record(record, "records[0]", vocab_size=10)
    assert row.input_ids == [2, 8, 6, 3]
    assert row.labels == [N, 6, N, 0]
    assert row.fields == {
        "sampling_logprobs": [0.0, -0.5, 0.0, -0.25],
        "advantages": [0.0, 1.5, 0.0, -1.0],
        "loss_weights": [0.0, 1.0, 0.0, 0.5],
    }


def test_default_completion_tokens_are_the_ones_with_a_logprob():
    row = parse_record({"tokens": [1, 2, 3], "logprobs": [None, None, -1.0], "advantage": -2.0}, "r")
    assert (row.input_ids, row.labels, row.fields["advantages"]) == ([1, 2], [N, 3], [0.0, -2.0])


def to_datum(record: dict, tensor_data: bool = False, chunks: bool = False) -> dict:
    """Tinker's convention, written independently: model_input = tokens[:-1], every loss_fn_input is
    the flat list shifted by one, 0 where there is no target."""
    tokens, n = record["tokens"], len(record["tokens"])
    mask = record.get("completion_mask") or [int(lp is not None) for lp in record["logprobs"]]
    weights = record.get("weights") or [1.0] * n
    adv = record.get("advantages") or [record["advantage"]] * n
    on = [bool(mask[i]) and weights[i] != 0 for i in range(n)]

    def shifted(values):
        out = [float(values[i]) if on[i] else 0.0 for i in range(1, n)]
        return {"data": out, "dtype": "float32", "shape": [n - 1]} if tensor_data else out

    inputs = {
        "target_tokens": tokens[1:],
        "logprobs": shifted(record["logprobs"]),
        "advantages": shifted(adv),
    }
    inputs["weights"] = shifted(weights)
    model_input = {"chunks": [{"tokens": tokens[:2]}, {"tokens": tokens[2:-1]}]} if chunks else tokens[:-1]
    return {"model_input": model_input, "loss_fn_inputs": inputs}


@pytest.mark.parametrize("tensor_data,chunks", [(False, False), (True, False), (False, True)])
def test_tinker_datum_form_gives_the_row_of_the_flat_form(tensor_data, chunks):
    flat = {
        "tokens": [4, 4, 2, 7, 9, 1],
        "logprobs": [None, None, -0.5, -1.5, -0.125, -3.0],
        "weights": [0, 0, 1.0, 0.25, 1.0, 0.0],
        "advantages": [None, None, 2.0, -1.0, 0.5, 7.0],
    }
    flat_row = parse_record(flat, "flat", vocab_size=10)
    datum_row = parse_record(to_datum(flat, tensor_data, chunks), "datum", vocab_size=10)
    assert datum_row == flat_row
    assert flat_row.labels == [N, 2, 7, 9, N]


def test_datum_with_a_mask_and_no_weights_has_no_loss_weights():
    datum = {
        "model_input": [3, 4, 5],
        "loss_fn_inputs": {
            "target_tokens": [4, 5, 6],
            "logprobs": [0, -1.0, -2.0],
            "advantages": [0, 1.0, 1.0],
            "mask": [0, 1, 1],
        },
        "sample_weight": 0.5,
    }
    row = parse_record(datum, "d")
    assert row.labels == [N, 5, 6]
    assert row.fields == {
        "sampling_logprobs": [0.0, -1.0, -2.0],
        "advantages": [0.0, 1.0, 1.0],
        "sample_weights": [0.0, 0.5, 0.5],
    }


def test_complete_fields_gives_every_row_the_same_keys_with_ones_at_targets():
    a = parse_record({"tokens": [1, 2, 3], "logprobs": [None, -1.0, -1.0], "advantage": 1.0}, "a")
    b = {
        "tokens": [1, 2],
        "logprobs": [None, -1.0],
        "advantage": 1.0,
        "weights": [0, 3.0],
        "sample_weight": 2,
    }
    b = parse_record(b, "b")
    rows = complete_fields([(a, "a"), (b, "b")])
    assert [list(r.fields) for r in rows] == [
        ["sampling_logprobs", "advantages", "loss_weights", "sample_weights"]
    ] * 2
    assert rows[0].fields["loss_weights"] == [1.0, 1.0] and rows[0].fields["sample_weights"] == [1.0, 1.0]
    assert rows[1].fields["loss_weights"] == [3.0] and rows[1].fields["sample_weights"] == [2.0]


def test_write_jsonl_then_read_jsonl_round_trips_and_names_lines(tmp_path):
    records = [{"tokens": [1, 2, 3], "logprobs": [None, -0.5, -1.5], "advantage": 0.25}] * 2
    path = tmp_path / "r.jsonl"
    write_jsonl(records, path)
    path.write_text(path.read_text().replace("\n", "\n\n", 1))  # a blank line is skipped, lines still count
    rows = read_jsonl(str(path), vocab_size=4)
    assert [w for _, w in rows] == [f"{path}:1", f"{path}:3"]
    assert rows[0][0].labels == [2, 3]


GOOD = {"tokens": [1, 2, 3, 4], "logprobs": [None, None, -1.0, -2.0], "advantage": 1.0}
DATUM = to_datum(GOOD)

# (id, record (or a raw line), expected fragment after "file:line: ")
BAD_RECORDS = [
    ("not_json", "{'tokens': [1]}", "is not valid JSON (Expecting property name"),
    ("not_object", [1, 2], "a record must be a JSON object, got list"),
    (
        "neither_form",
        {"text": "hi"},
        "a record needs 'tokens' (flat form) or 'model_input' and 'loss_fn_inputs'",
    ),
    ("missing_logprobs", {"tokens": [1, 2], "advantage": 1.0}, "missing field 'logprobs'"),
    ("missing_advantage", {"tokens": [1, 2], "logprobs": [None, -1.0]}, "missing field 'advantage' (one per"),
    (
        "both_advantages",
        {**GOOD, "advantages": [0, 0, 1, 1]},
        "give 'advantage' (one per record) or 'advantages'",
    ),
    ("logprobs_length", {**GOOD, "logprobs": [None, -1.0]}, "field 'logprobs' has 2 entries, expected 4"),
    ("mask_length", {**GOOD, "completion_mask": [0, 1]}, "field 'completion_mask' has 2 entries, expected 4"),
    (
        "advantages_length",
        {**GOOD, "advantage": None, "advantages": [1.0]},
        "'advantages' has 1 entries, expected 4",
    ),
    (
        "token_beyond_vocab",
        {**GOOD, "tokens": [1, 2, 3, 12]},
        "tokens[3]=12 is outside the vocabulary: token ids must be [0, 10)",
    ),
    ("token_negative", {**GOOD, "tokens": [-1, 2, 3, 4]}, "tokens[0]=-1 is outside the vocabulary"),
    ("token_float", {**GOOD, "tokens": [1, 2.5, 3, 4]}, "tokens[1]=2.5 is not an integer token id"),
    ("tokens_not_list", {**GOOD, "tokens": "abcd"}, "field 'tokens' must be a list, got str"),
    ("one_token", {"tokens": [1], "logprobs": [None], "advantage": 1.0}, "field 'tokens' has 1 token(s)"),
    ("logprob_nan", {**GOOD, "logprobs": [None, None, math.nan, -1.0]}, "logprobs[2]=nan is not finite"),
    ("logprob_inf", {**GOOD, "logprobs": [None, None, -math.inf, -1.0]}, "logprobs[2]=-inf is not finite"),
    (
        "logprob_positive",
        {**GOOD, "logprobs": [None, None, 0.5, -1.0]},
        "logprobs[2]=0.5 is > 0, not a log-probability",
    ),
    ("logprob_text", {**GOOD, "logprobs": [None, None, "x", -1.0]}, "logprobs[2]='x' is not a number"),
    (
        "null_logprob_at_completion",
        {**GOOD, "completion_mask": [0, 1, 1, 1]},
        "logprobs[1] is null at a completion token",
    ),
    ("ref_positive", {**GOOD, "ref_logprobs": [None, None, -1.0, 2.0]}, "ref_logprobs[3]=2.0 is > 0"),
    ("advantage_nan", {**GOOD, "advantage": math.nan}, "field 'advantage'=nan must be a finite number"),
    (
        "advantages_inf",
        {**GOOD, "advantage": None, "advantages": [0, 0, math.inf, 1]},
        "advantages[2]=inf is not finite",
    ),
    ("first_token_completion", {**GOOD, "completion_mask": [1, 0, 1, 1]}, "tokens[0] has no preceding token"),
    ("mask_value", {**GOOD, "completion_mask": [0, 0, 2, 1]}, "completion_mask[2]=2 must be 0 or 1"),
    ("no_completion", {**GOOD, "completion_mask": [0, 0, 0, 0]}, "has no completion token"),
    ("all_weights_zero", {**GOOD, "weights": [0, 0, 0, 0]}, "has no completion token"),
    ("sample_weight_negative", {**GOOD, "sample_weight": -1.0}, "field 'sample_weight'=-1.0 must be >= 0.0"),
    (
        "sample_weight_text",
        {**GOOD, "sample_weight": "high"},
        "field 'sample_weight'='high' must be a finite number",
    ),
    (
        "misspelt_field",
        {**GOOD, "sample_weigth": 2.0},
        "unknown field 'sample_weigth'; did you mean 'sample_weight'?",
    ),
    (
        "flat_with_mask",
        {**GOOD, "mask": [0, 0, 1, 1]},
        "field 'mask' does not belong here: the flat form's mask is 'completion_mask'",
    ),
    (
        "flat_with_model_input",
        {**GOOD, "model_input": [1, 2, 3]},
        "field 'model_input' does not belong here",
    ),
    (
        "datum_with_completion_mask",
        {**DATUM, "loss_fn_inputs": {**DATUM["loss_fn_inputs"], "completion_mask": [0, 1, 1]}},
        "the Datum form's mask is 'mask'",
    ),
    (
        "datum_with_scalar_advantage",
        {**DATUM, "loss_fn_inputs": {**DATUM["loss_fn_inputs"], "advantage": 1.0}},
        "the Datum form takes per-token 'advantages'",
    ),
    (
        "datum_with_top_level_advantages",
        {**DATUM, "advantages": [0, 1, 1]},
        "field 'advantages' does not belong here: it belongs in 'loss_fn_inputs'",
    ),
    (
        "datum_inner_sample_weight",
        {**DATUM, "loss_fn_inputs": {**DATUM["loss_fn_inputs"], "sample_weight": 2.0}},
        "it belongs at the record's top level",
    ),
    (
        "too_long",
        {"tokens": list(range(10)), "logprobs": [None] + [-1.0] * 9, "advantage": 1.0},
        "9 input positions do not fit data.seq_len=8",
    ),
    (
        "datum_no_weights_or_mask",
        {
            "model_input": [1, 2],
            "loss_fn_inputs": {"target_tokens": [2, 3], "logprobs": [0, -1.0], "advantages": [0, 1.0]},
        },
        "loss_fn_inputs: needs 'weights' or 'mask'",
    ),
    (
        "datum_missing_advantages",
        {**DATUM, "loss_fn_inputs": {k: v for k, v in DATUM["loss_fn_inputs"].items() if k != "advantages"}},
        "loss_fn_inputs: missing field 'advantages'",
    ),
    (
        "datum_target_beyond_vocab",
        {**DATUM, "loss_fn_inputs": {**DATUM["loss_fn_inputs"], "target_tokens": [2, 3, 11]}},
        "target_tokens[2]=11 is outside the vocabulary",
    ),
    ("datum_length", {**DATUM, "model_input": [1, 2]}, "field 'target_tokens' has 3 entries, expected 2"),
    (
        "datum_inputs_not_object",
        {"model_input": [1], "loss_fn_inputs": [1]},
        "field 'loss_fn_inputs' must be an object, got list",
    ),
    (
        "datum_image_chunk",
        {**DATUM, "model_input": {"chunks": [{"data": "png"}]}},
        "model_input.chunks must be a list of {'tokens': [...]}",
    ),
    (
        "datum_null_weight",
        {**DATUM, "loss_fn_inputs": {**DATUM["loss_fn_inputs"], "weights": [0, None, 1]}},
        "weights[1] is null",
    ),
]


@pytest.mark.parametrize("record,expected", [c[1:] for c in BAD_RECORDS], ids=[c[0] for c in BAD_RECORDS])
def test_every_bad_record_is_one_error_naming_file_line_and_field(tmp_path, record, expected):
    path = tmp_path / "rollouts.jsonl"
    line = record if isinstance(record, str) else json.dumps(record)  # NaN as Python's json writes it
    path.write_text(json.dumps(GOOD) + "\n" + line + "\n")
    with pytest.raises(ConfigError) as err:
        complete_fields(read_jsonl(str(path), vocab_size=10, seq_len=8))
    message = str(err.value)
    assert message.startswith(f"{path}:2") and "\n" not in message, message
    assert expected in message, message


def test_ref_logprobs_in_some_records_only_names_both_records(tmp_path):
    path = tmp_path / "r.jsonl"
    with_ref = {**GOOD, "ref_logprobs": [None, None, -1.0, -1.0]}
    path.write_text("\n".join(json.dumps(r) for r in (with_ref, with_ref, GOOD)) + "\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: missing field 'ref_logprobs', which {path}:1 has"):
        complete_fields(read_jsonl(str(path)))
