"""`lit_losses.data.files`: every data module reads its JSONL files through one reader, so a bad line is
named by the same ``file:line`` (the line number counted here, by hand), whatever the module; lines end at
``\\n`` only; a records file that is not UTF-8 text is one `ConfigError` naming it."""

from __future__ import annotations

import json
import re

import pytest

from lit_losses.data import DistillationDataModule, PreferenceDataModule, RLDataModule, TextDataModule
from lit_losses.errors import ConfigError

RL = {"tokens": [1, 2, 3], "logprobs": [None, -0.5, -1.0], "advantage": 1.0}
DISTILL = {
    "tokens": [1, 2],
    "teacher_topk_ids": [None, [2, 3]],
    "teacher_topk_logprobs": [None, [-0.5, -2.0]],
}
PAIR = {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}
TEXT = {"text": "the quick brown fox"}

RECORDS = {"vocab_size": 8, "seq_len": 4, "tokens_per_batch": 8}
PREFERENCE = {"vocab_size": 300, "max_length": 16, "tokens_per_batch": 64}
# (module, a good record, its options, what the error of a bad line starts with before file:line)
MODULES = {
    "text": (TextDataModule, TEXT, {"vocab_size": 300, "seq_len": 8, "tokens_per_batch": 16}, "data.paths: "),
    "rl": (RLDataModule, RL, RECORDS, ""),
    "distillation": (DistillationDataModule, DISTILL, RECORDS, ""),
    "preference": (PreferenceDataModule, PAIR, PREFERENCE, ""),
}
CACHED = ("text", "preference")  # the modules that train a tokenizer (cached in cache_dir)


@pytest.mark.parametrize("name", MODULES)
def test_a_bad_line_is_named_by_its_file_and_line_in_every_data_module(tmp_path, name):
    module, good, options, prefix = MODULES[name]
    path = tmp_path / "data.jsonl"
    lines = [json.dumps(good), "", "   ", json.dumps(good), '{"tokens": oops}', json.dumps(good)]
    path.write_bytes("\r\n".join(lines).encode())  # CRLF line ends; blank lines still count
    cache = {"cache_dir": str(tmp_path)} if name in CACHED else {}
    data = module(paths=[str(path)], val_fraction=0.0, **options, **cache)
    with pytest.raises(ConfigError) as err:
        data.setup("fit")
    message = str(err.value)
    assert message.startswith(f"{prefix}{path}:5 is not valid JSON (Expecting value, column 12)"), message


def test_a_unicode_line_separator_inside_a_text_stays_in_its_document(tmp_path):
    texts = ["one\u2028line", "two\x85lines\u2029here", "three\x0bfour"]  # str.splitlines would cut each
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), "utf-8")
    assert "\u2028" in path.read_text("utf-8")  # written raw, not escaped
    data = TextDataModule(paths=[str(path)], vocab_size=300, val_fraction=0.0, cache_dir=str(tmp_path))
    assert sorted(data.read_items()) == sorted(texts)


@pytest.mark.parametrize("module", [RLDataModule, DistillationDataModule], ids=["rl", "distillation"])
@pytest.mark.parametrize(
    "content,expected",
    [(b'{"tokens": [1, 2]}\n\xe9\n', r"is not UTF-8 text \(byte 19"), (b"\x00\x01\x02", "is a binary file")],
    ids=["latin1", "binary"],
)
def test_a_records_file_that_is_not_text_is_one_config_error_naming_it(tmp_path, module, content, expected):
    path = tmp_path / "records.jsonl"
    path.write_bytes(content)
    data = module(paths=[str(path)], vocab_size=8, seq_len=4, tokens_per_batch=8)
    with pytest.raises(ConfigError, match=rf"^data\.paths: {re.escape(str(path))} {expected}"):
        data.setup("fit")
