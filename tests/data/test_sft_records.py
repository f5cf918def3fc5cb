"""SFT on TRL's prompt-completion and conversational records through `TextDataModule` and
`HFTextDataModule`: ``completion_only_loss`` trains on the completion tokens only, ``assistant_only_loss``
on the assistant's turns only; bad records and options are one `ConfigError` line.

References: the tokenizer called directly (``encode(prompt)``, ``encode(prompt + completion + EOS)``;
an assistant message's content encoded alone, followed by ``<|im_end|>``).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from transformers import AutoTokenizer

from lit_losses import TextDataModule
from lit_losses.data.hf_text import HFTextDataModule
from lit_losses.errors import ConfigError
from tests.data.chat_tokenizer import PLAIN_CHATML, SHIPPED, build

REPO = Path(__file__).resolve().parents[2]
PROMPT_COMPLETION = REPO / "data" / "sft" / "prompt_completion.jsonl"
CONVERSATIONAL = REPO / "data" / "sft" / "conversational.jsonl"
EOS = "<|endoftext|>"


def records_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def segments(data: TextDataModule) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(tokens, labelled targets) of every packed sequence of every training micro-batch."""
    out = []
    for i in range(len(data.train_set)):
        batch = data.train_set[i]
        for ids, labels, segs in zip(batch["input_ids"], batch["labels"], batch["segment_ids"]):
            for s in segs.unique().tolist():
                if s:
                    seg_labels = labels[segs == s]
                    assert seg_labels[-1] == -100  # the next token belongs to another sequence
                    out.append(
                        (tuple(ids[segs == s].tolist()), tuple(seg_labels[seg_labels != -100].tolist()))
                    )
    return out


@pytest.mark.parametrize("completion_only_loss", [None, True, False])
def test_prompt_completion_records_train_on_their_completion_only(tmp_path, completion_only_loss):
    data = TextDataModule(
        paths=[str(PROMPT_COMPLETION)],
        vocab_size=400,
        seq_len=128,
        tokens_per_batch=256,
        val_fraction=0.0,
        cache_dir=str(tmp_path),
        completion_only_loss=completion_only_loss,
    )
    data.setup("fit")
    bpe, expected = data.tokenizer, Counter()
    for record in records_of(PROMPT_COMPLETION):
        prompt = bpe.encode(record["prompt"]).ids
        full = bpe.encode(record["prompt"] + record["completion"] + EOS).ids
        targets = full[len(prompt) :] if completion_only_loss is not False else full[1:]
        expected[(tuple(full), tuple(targets))] += 1
    seen = Counter(segments(data))
    assert seen == expected
    loader = data.train_dataloader()
    loader.configure(accumulate_grad_batches=1, mask_keys=["labels"], ignore_index=-100)
    counted = sum(b["global_stats"].get_local().num_tokens for b in loader)
    assert counted == sum(len(t) * n for (_, t), n in expected.items())


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(SHIPPED))


def test_assistant_only_loss_trains_on_the_assistant_turns_only(tok):
    data = HFTextDataModule(
        str(SHIPPED),
        paths=[str(CONVERSATIONAL)],
        seq_len=160,
        tokens_per_batch=320,
        val_fraction=0.0,
        assistant_only_loss=True,
    )
    data.setup("fit")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    expected = Counter()
    for record in records_of(CONVERSATIONAL):
        full = tok.apply_chat_template(record["messages"], tokenize=True, return_dict=True)["input_ids"]
        turns = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        targets = [t for content in turns for t in [*tok(content)["input_ids"], im_end]]
        expected[(tuple(full), tuple(targets))] += 1
    assert Counter(segments(data)) == expected


def test_conversational_prompt_completion_trains_on_the_rendered_completion(tmp_path, tok):
    path = tmp_path / "chat_pc.jsonl"
    records = [
        {"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in records_of(CONVERSATIONAL)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = HFTextDataModule(
        str(SHIPPED), paths=[str(path)], seq_len=160, tokens_per_batch=320, val_fraction=0.0
    )
    data.setup("fit")
    expected = Counter()
    for record in records:
        prompt = tok.apply_chat_template(
            record["prompt"], tokenize=True, add_generation_prompt=True, return_dict=True
        )
        full = tok.apply_chat_template(
            record["prompt"] + record["completion"], tokenize=True, return_dict=True
        )
        full = full["input_ids"]
        completion = full[len(prompt["input_ids"]) :]
        assert (
            tok.decode(completion, skip_special_tokens=False)
            == record["completion"][0]["content"] + "<|im_end|>\n"
        )
        expected[(tuple(full), tuple(completion))] += 1
    assert Counter(segments(data)) == expected


def test_the_shipped_chat_tokenizer_is_rebuilt_from_the_shipped_data(tmp_path, tok):
    fresh = AutoTokenizer.from_pretrained(build(tmp_path / "fresh"))
    assert fresh.get_vocab() == tok.get_vocab() and fresh.chat_template == tok.chat_template


# ---- bad records and options --------------------------------------------------------------------
def write(tmp_path, *records) -> str:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


PC = {"prompt": "Q: 2 + 2?\nA:", "completion": " 4"}
CHAT = {"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]}
BAD = [
    (
        "missing_completion",
        [PC, {"prompt": "Q: 3 + 3?"}],
        {},
        r"sft\.jsonl:2: missing field 'completion' \(a prompt-completion record",
    ),
    (
        "non_string",
        [PC | {"completion": 4}],
        {},
        r"sft\.jsonl:1: field 'completion' is a int, not a string or a list of messages",
    ),
    (
        "messages_and_prompt",
        [CHAT | {"prompt": "x"}],
        {},
        r"sft\.jsonl:1: a record has 'messages' \(a conversation\) or 'prompt' and 'completion', not both",
    ),
    (
        "messages_string",
        [{"messages": "hi"}],
        {},
        r"sft\.jsonl:1: field 'messages' is a string, not a list of messages",
    ),
    (
        "formats_mixed",
        [PC, PC, CHAT],
        {},
        r"sft\.jsonl:3 is a conversational \(messages\) record but .*sft\.jsonl:1 is prompt-completion; one "
        r"format per corpus",
    ),
    (
        "text_and_records",
        [PC, {"text": "plain text"}],
        {},
        r"sft\.jsonl:1 is a prompt-completion record, but the corpus also holds text documents",
    ),
    (
        "completion_only_on_messages",
        [CHAT],
        {"completion_only_loss": True},
        r"data\.completion_only_loss=true needs prompt-completion records .*sft\.jsonl:1 is a conversation",
    ),
    (
        "completion_only_on_text",
        [{"text": "plain"}],
        {"completion_only_loss": True},
        r"data\.completion_only_loss=true needs prompt-completion or conversational JSONL records",
    ),
    (
        "assistant_only_on_standard",
        [PC],
        {"assistant_only_loss": True},
        r"data\.assistant_only_loss=true needs conversational records .*sft\.jsonl:1 is standard text",
    ),
    (
        "messages_with_builtin_bpe",
        [CHAT, CHAT],
        {},
        r"sft\.jsonl:\d: a conversational record .* the built-in BPE tokenizer has none",
    ),
    (
        "prompt_fills_seq_len",
        [PC | {"prompt": "Q: " + "very " * 40 + "long?"}],
        {"seq_len": 8, "tokens_per_batch": 8},
        r"sft\.jsonl:1: the completion has no token left to train on after truncation to data\.seq_len=8",
    ),
]


@pytest.mark.parametrize(("records", "options", "message"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_records_and_options_are_one_line_naming_the_record(tmp_path, records, options, message):
    options = {"vocab_size": 300, "seq_len": 64, "tokens_per_batch": 128, "val_fraction": 0.0} | options
    data = TextDataModule(paths=[write(tmp_path, *records)], cache_dir=str(tmp_path), **options)
    with pytest.raises(ConfigError, match=message) as info:
        data.setup("fit")
    assert "\n" not in str(info.value)


def test_assistant_only_loss_needs_generation_markers(tmp_path):
    plain = build(tmp_path / "plain", chat_template=PLAIN_CHATML)
    data = HFTextDataModule(
        plain,
        paths=[write(tmp_path, CHAT)],
        seq_len=64,
        tokens_per_batch=64,
        val_fraction=0.0,
        assistant_only_loss=True,
    )
    with pytest.raises(
        ConfigError,
        match=r"data\.assistant_only_loss=true: the chat template of data\.tokenizer '.*plain' has no "
        r"\{% generation %\} markers",
    ):
        data.setup("fit")
