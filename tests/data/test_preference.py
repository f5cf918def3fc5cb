"""`PreferenceDataModule`: TRL's preference formats from JSONL → micro-batches in the preference layout.

The reference of every layout test is the tokenizer called directly, as TRL's trainers call it:
``tokenizer(prompt)`` and ``tokenizer(prompt + completion + eos)`` (standard records),
``apply_chat_template(prompt, add_generation_prompt=True)`` and ``apply_chat_template(prompt +
completion)`` (conversational ones); the completion's tokens follow the prompt's length.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoTokenizer

from lit_losses import PreferenceDataModule
from lit_losses.aggregation.loader import GlobalStatsLoader
from lit_losses.data.preference_records import extract_prompt
from lit_losses.errors import ConfigError
from tests.data.chat_tokenizer import SHIPPED, build

REPO = Path(__file__).resolve().parents[2]
PAIRS = REPO / "data" / "preference" / "pairs.jsonl"
CONVERSATIONAL = REPO / "data" / "preference" / "conversational.jsonl"
UNPAIRED = REPO / "data" / "preference" / "unpaired.jsonl"
TOKENIZER = str(SHIPPED)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def records_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reference_rows(tok, record: dict, field: str) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of ``record``'s ``field``, with the tokenizer called directly."""
    prompt, completion = record["prompt"], record[field]
    if isinstance(prompt, str):
        prompt_ids = tok(prompt)["input_ids"]
        full = tok(prompt + completion + tok.eos_token)["input_ids"]
    else:
        prompt_ids = tok.apply_chat_template(
            prompt, tokenize=True, add_generation_prompt=True, return_dict=True
        )
        prompt_ids = prompt_ids["input_ids"]
        full = tok.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)["input_ids"]
    assert full[: len(prompt_ids)] == prompt_ids
    return prompt_ids, full[len(prompt_ids) :]


def rows_of(batch: dict, key: str = "input_ids", prefix: str = "") -> list[tuple[list[int], list[int]]]:
    """Each row's (tokens, labelled targets) with the padding removed."""
    rows = []
    for ids, mask, labels in zip(
        batch[f"{prefix}{key}"], batch[f"{prefix}attention_mask"], batch[f"{prefix}labels"]
    ):
        n = int(mask.sum())
        assert bool(mask[:n].all()) and not bool(mask[n:].any())  # right padding
        assert bool((labels[n - 1 :] == -100).all())  # no target at the last position or on padding
        targets = labels[:n][labels[:n] != -100]
        rows.append((ids[:n].tolist(), targets.tolist()))
    return rows


def data_module(path: Path, **options) -> PreferenceDataModule:
    options = {
        "tokenizer": TOKENIZER,
        "vocab_size": None,
        "max_length": 256,
        "tokens_per_batch": 1024,
    } | options
    data = PreferenceDataModule(paths=[str(path)], **options)
    data.setup("fit")
    return data


def all_batches(data: PreferenceDataModule) -> list[dict]:
    return [data.train_set[i] for i in range(len(data.train_set))]


@pytest.mark.parametrize("path", [PAIRS, CONVERSATIONAL], ids=["standard", "conversational"])
def test_pairs_are_chosen_rows_then_rejected_rows_with_the_prompt_masked(tok, path):
    data = data_module(path)
    expected = {}
    for record in records_of(path):
        (prompt, chosen), (_, rejected) = (reference_rows(tok, record, f) for f in ("chosen", "rejected"))
        expected[tuple(prompt)] = (prompt + chosen, chosen, prompt + rejected, rejected)
    seen, targets = [], 0
    for batch in all_batches(data):
        rows = rows_of(batch)
        pairs = len(rows) // 2
        assert len(rows) == 2 * pairs and batch["input_ids"].numel() <= 1024
        assert torch.equal(batch["chosen_mask"][:pairs], batch["labels"][:pairs] != -100)
        assert not batch["chosen_mask"][pairs:].any() and not batch["chosen_sequence_mask"][pairs:].any()
        for (c_ids, c_targets), (r_ids, r_targets) in zip(rows[:pairs], rows[pairs:]):
            prompt = next(p for p in expected if c_ids[: len(p)] == list(p) and r_ids[: len(p)] == list(p))
            assert (c_ids, c_targets, r_ids, r_targets) == tuple(list(x) for x in expected[prompt])
            seen.append(prompt)
            targets += len(c_targets) + len(r_targets)
    assert sorted(seen) == sorted(expected)  # every pair once, chosen and rejected in the same micro-batch
    assert targets == sum(len(v[1]) + len(v[3]) for v in expected.values())


def test_the_loader_counts_two_sequences_per_pair_and_their_completion_tokens(tok):
    data = data_module(PAIRS, tokens_per_batch=600)
    loader = data.train_dataloader()
    assert isinstance(loader, GlobalStatsLoader)
    keys = ["labels", "chosen_mask", "chosen_sequence_mask"]
    loader.configure(accumulate_grad_batches=2, mask_keys=keys, ignore_index=-100)
    batches = list(loader)
    stats = [b["global_stats"].get_local() for b in batches]
    assert [s.num_sequences for s in stats] == [b["input_ids"].shape[0] for b in batches]
    assert sum(s.num_sequences for s in stats) == 2 * len(records_of(PAIRS))
    chosen = [reference_rows(tok, r, "chosen") for r in records_of(PAIRS)]
    masks = [b["global_stats"].get_local("chosen_mask") for b in batches]
    assert sum(m.num_tokens for m in masks) == sum(len(c) for _, c in chosen)  # the chosen completions
    assert sum(m.num_sequences for m in masks) == len(chosen)
    sequences = [b["global_stats"].get_local("chosen_sequence_mask") for b in batches]
    assert sum(m.num_tokens for m in sequences) == sum(
        len(p) + len(c) - 1 for p, c in chosen
    )  # every next token
    completion_tokens = sum(
        len(reference_rows(tok, r, f)[1]) for r in records_of(PAIRS) for f in ("chosen", "rejected")
    )
    assert sum(s.num_tokens for s in stats) == completion_tokens


def test_kto_rows_and_kl_rows_pair_each_prompt_with_the_previous_records_completion(tok):
    records = records_of(UNPAIRED)
    data = data_module(UNPAIRED)
    split = {r["prompt"]: reference_rows(tok, r, "completion") for r in records}
    by_prompt = {}
    for batch in all_batches(data):
        assert batch["kto_label"].dtype == torch.bool
        assert batch["kl_input_ids"].shape == batch["input_ids"].shape
        for (ids, targets), (kl_ids, kl_targets), label in zip(
            rows_of(batch), rows_of(batch, prefix="kl_"), batch["kto_label"]
        ):
            prompt = next(p for p, (prompt_ids, _) in split.items() if ids[: len(prompt_ids)] == prompt_ids)
            by_prompt[prompt] = (ids, targets, kl_ids, kl_targets, bool(label))
    assert len(by_prompt) == len(records)
    for i, record in enumerate(records):
        prompt_ids, completion = split[record["prompt"]]
        partner = split[records[i - 1]["prompt"]][1]  # TRL's rotation by one, the first takes the last
        assert by_prompt[record["prompt"]] == (
            prompt_ids + completion,
            completion,
            prompt_ids + partner,
            partner,
            record["label"],
        )


def test_an_implicit_prompt_is_the_common_prefix_of_chosen_and_rejected(tmp_path, tok):
    path = tmp_path / "implicit.jsonl"
    record = {"chosen": "Is the sky blue? Yes, on a clear day.", "rejected": "Is the sky blue? No."}
    path.write_text(json.dumps(record) + "\n")
    assert extract_prompt(record["chosen"], record["rejected"]) == (
        "Is the sky blue?",
        " Yes, on a clear day.",
        " No.",
    )
    ((chosen, rejected),) = [rows_of(b) for b in all_batches(data_module(path))]
    explicit = {"prompt": "Is the sky blue?", "chosen": " Yes, on a clear day.", "rejected": " No."}
    assert chosen[1] == reference_rows(tok, explicit, "chosen")[1]
    assert rejected[1] == reference_rows(tok, explicit, "rejected")[1]


def test_precomputed_reference_sums_travel_with_their_pairs_in_float64(tmp_path, tok):
    path = tmp_path / "ref.jsonl"
    records = records_of(PAIRS)[:6]
    for i, r in enumerate(records):
        r |= {"ref_chosen_logps": -10.0 - i - 1 / 3, "ref_rejected_logps": -20.0 - i}
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    seen = []
    for batch in all_batches(data_module(path)):
        assert batch["ref_chosen_logps"].dtype == batch["ref_rejected_logps"].dtype == torch.float64
        rows = rows_of(batch)
        for p, (ids, _) in enumerate(rows[: len(rows) // 2]):
            record = next(
                r
                for r in records
                if ids[: len(tok(r["prompt"])["input_ids"])] == tok(r["prompt"])["input_ids"]
            )
            assert batch["ref_chosen_logps"][p].item() == record["ref_chosen_logps"]
            assert batch["ref_rejected_logps"][p].item() == record["ref_rejected_logps"]
            seen.append(record["prompt"])
    assert sorted(seen) == sorted(r["prompt"] for r in records)


def test_truncation_keeps_the_start_or_the_end_of_each_sequence(tmp_path, tok):
    record = records_of(PAIRS)[4]  # a long chosen completion, a short rejected one
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(record) + "\n")
    prompt, chosen = reference_rows(tok, record, "chosen")
    limit = len(prompt) + 5
    full = prompt + chosen
    for mode, kept in (("keep_start", full[:limit]), ("keep_end", full[-limit:])):
        data = data_module(path, max_length=limit, truncation_mode=mode, tokens_per_batch=2 * limit)
        (((ids, targets), _),) = [rows_of(b) for b in all_batches(data)]
        assert ids == kept
        assert targets == kept[-(len(kept) - 1 if mode == "keep_end" else 5) :]


def test_the_built_in_tokenizer_trains_on_the_records(tmp_path):
    data = PreferenceDataModule(
        paths=[str(PAIRS)], vocab_size=400, max_length=128, tokens_per_batch=1024, cache_dir=str(tmp_path)
    )
    data.setup("fit")
    bpe, eos = data.tokenizer, "<|endoftext|>"
    rows = [row for b in all_batches(data) for row in rows_of(b)]
    for record in records_of(PAIRS):
        prompt = bpe.encode(record["prompt"]).ids
        for field in ("chosen", "rejected"):
            completion = bpe.encode(record["prompt"] + record[field] + eos).ids[len(prompt) :]
            assert (prompt + completion, completion) in rows


# ---- bad input: one ConfigError line naming the record ------------------------------------------
def write(tmp_path, *records, raw: str = "") -> str:
    path = tmp_path / "bad.jsonl"
    path.write_text(raw or "".join(json.dumps(r) + "\n" for r in records))
    return str(path)


GOOD = {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}
CHAT = {
    "prompt": [{"role": "user", "content": "2 + 2?"}],
    "chosen": [{"role": "assistant", "content": "4"}],
    "rejected": [{"role": "assistant", "content": "5"}],
}
BAD_RECORDS = [
    (
        "missing_rejected",
        [GOOD, {"prompt": "3 + 3 =", "chosen": " 6"}],
        r"bad\.jsonl:2: missing field 'rejected' \(a paired",
    ),
    ("missing_chosen", [{"prompt": "a", "rejected": " b"}], r"bad\.jsonl:1: missing field 'chosen'"),
    (
        "missing_prompt_unpaired",
        [{"completion": " 4", "label": True}],
        r"bad\.jsonl:1: missing field 'prompt' \(an unpaired",
    ),
    ("missing_label", [{"prompt": "a", "completion": " b"}], r"bad\.jsonl:1: missing field 'label'"),
    (
        "non_string",
        [GOOD, GOOD | {"chosen": 4}],
        r"bad\.jsonl:2: field 'chosen' is a int, not a string or a list of messages",
    ),
    (
        "label_not_bool",
        [{"prompt": "a", "completion": " b", "label": "yes"}],
        r"bad\.jsonl:1: field 'label' is a str, not a boolean",
    ),
    (
        "mixed_forms_in_record",
        [GOOD | {"chosen": CHAT["chosen"]}],
        r"bad\.jsonl:1: field 'prompt' is a string but 'chosen' is a list",
    ),
    (
        "bad_role",
        [CHAT | {"prompt": [{"role": "robot", "content": "hi"}]}],
        r"bad\.jsonl:1: prompt\[0\] has role 'robot'",
    ),
    ("message_not_object", [CHAT | {"chosen": ["4"]}], r"bad\.jsonl:1: chosen\[0\] is a str, not a message"),
    (
        "paired_and_unpaired",
        [GOOD | {"label": True}],
        r"bad\.jsonl:1: a record has 'chosen' and 'rejected' \(paired\) or",
    ),
    ("not_preference", [{"text": "hello"}], r"bad\.jsonl:1: not a preference record"),
    (
        "misspelt_ref",
        [GOOD | {"ref_chosen_logp": -3.0}],
        r"bad\.jsonl:1: unknown field 'ref_chosen_logp'; did you mean 'ref_chosen_logps'\?",
    ),
    (
        "positive_ref",
        [GOOD | {"ref_chosen_logps": 0.5, "ref_rejected_logps": -1.0}],
        r"bad\.jsonl:1: field 'ref_chosen_logps'=0.5 is > 0",
    ),
    (
        "ref_in_some_records",
        [GOOD | {"ref_chosen_logps": -1.0, "ref_rejected_logps": -2.0}, GOOD],
        r"bad\.jsonl:2: missing field 'ref_chosen_logps', which .*bad\.jsonl:1 has; give the precomputed "
        r"reference log-probabilities in every record or in none",
    ),
    (
        "kinds_mixed",
        [GOOD, {"prompt": "a", "completion": " b", "label": True}],
        r"bad\.jsonl:2 is an unpaired \(KTO\) record but .*bad\.jsonl:1 is a paired record; one kind",
    ),
    (
        "forms_mixed",
        [GOOD, CHAT],
        r"bad\.jsonl:2 is conversational \(message lists\) but .*bad\.jsonl:1 is standard",
    ),
    (
        "one_unpaired",
        [{"prompt": "a", "completion": " b", "label": True}],
        r"bad\.jsonl:1 is the only unpaired record",
    ),
]


@pytest.mark.parametrize(
    ("records", "message"), [c[1:] for c in BAD_RECORDS], ids=[c[0] for c in BAD_RECORDS]
)
def test_bad_records_are_one_line_naming_the_file_and_line(tmp_path, records, message):
    data = PreferenceDataModule(paths=[write(tmp_path, *records)], tokenizer=TOKENIZER, vocab_size=None)
    with pytest.raises(ConfigError, match=message) as info:
        data.setup("fit")
    assert "\n" not in str(info.value)


def test_invalid_json_names_the_line(tmp_path):
    data = PreferenceDataModule(paths=[write(tmp_path, raw=json.dumps(GOOD) + "\n{oops\n")], vocab_size=300)
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2 is not valid JSON"):
        data.setup("fit")


def test_a_completion_left_empty_by_truncation_is_refused(tmp_path, tok):
    long_prompt = GOOD | {"prompt": "Please answer this question about arithmetic: what is two plus two?"}
    path = write(tmp_path, GOOD, long_prompt)
    data = PreferenceDataModule(
        paths=[path], tokenizer=TOKENIZER, vocab_size=None, max_length=6, tokens_per_batch=12
    )
    with pytest.raises(
        ConfigError,
        match=r"bad\.jsonl:2: the chosen completion has no token left to train on after truncation to "
        r"data\.max_length=6",
    ):
        data.setup("fit")


def test_conversational_records_need_a_chat_template(tmp_path):
    path = write(tmp_path, CHAT, CHAT)
    builtin = PreferenceDataModule(paths=[path], vocab_size=300, cache_dir=str(tmp_path))
    with pytest.raises(
        ConfigError,
        match=r"bad\.jsonl:\d: a conversational record .* the built-in BPE tokenizer has none; give "
        r"data\.tokenizer",
    ):
        builtin.setup("fit")
    plain = build(tmp_path / "plain", chat_template=None)
    data = PreferenceDataModule(paths=[path], tokenizer=plain, vocab_size=None)
    with pytest.raises(
        ConfigError, match=r"bad\.jsonl:\d: a conversational record .* data\.tokenizer '.*plain' has none"
    ):
        data.setup("fit")


def test_a_pair_whose_chosen_equals_its_rejected_warns_naming_it_and_trains(tmp_path):
    path = write(tmp_path, GOOD, GOOD | {"rejected": " 4"})
    data = PreferenceDataModule(paths=[path], tokenizer=TOKENIZER, vocab_size=None)
    with pytest.warns(
        UserWarning, match=r"bad\.jsonl:2: chosen and rejected are the same completion; the pair trains"
    ):
        data.setup("fit")
    assert sum(b["input_ids"].shape[0] for b in all_batches(data)) == 4


def test_bad_options_are_config_errors(tmp_path):
    path = write(tmp_path, GOOD)
    with pytest.raises(
        ConfigError,
        match=r"data\.truncation_mode 'keep_begin' is not one of \('keep_start', 'keep_end'\); did you mean "
        r"'keep_end'\?",
    ):
        PreferenceDataModule(paths=[path], truncation_mode="keep_begin")
    with pytest.raises(
        ConfigError, match=r"data\.tokens_per_batch=100 is smaller than one pair \(2 × data\.max_length=64\)"
    ):
        PreferenceDataModule(paths=[path], max_length=64, tokens_per_batch=100)
    with pytest.raises(ConfigError, match=r"data\.paths: give the JSONL files"):
        PreferenceDataModule()
    with pytest.raises(ConfigError, match=r"data\.vocab_size=100 is smaller than the tokenizer's 700 tokens"):
        PreferenceDataModule(paths=[path], tokenizer=TOKENIZER, vocab_size=100)
