"""The first error of a data module's constructor when several options are wrong: an empty ``data.paths``
first (where the module needs files), then the module's own options, ``val_fraction`` before the item bound,
the file globs after the options, and the Hugging Face tokenizer loaded only once every cheap check passed.
The expected messages are the ones these constructors gave before they shared `FileDataModule`."""

from __future__ import annotations

import json

import pytest

import lit_losses.data.preference as preference
from lit_losses.data import DistillationDataModule, PreferenceDataModule, RLDataModule, TextDataModule
from lit_losses.errors import ConfigError

RL_PATHS = (
    "data.paths: give the JSONL files of RL records (e.g. data/rollouts.jsonl, written by python -m "
    "lit_losses.data.rollouts)"
)
DISTILLATION_PATHS = (
    "data.paths: give the JSONL files of distillation records (tokens, teacher_topk_ids, "
    "teacher_topk_logprobs)"
)
PREFERENCE_PATHS = "data.paths: give the JSONL files of preference records"
NOWHERE = "/nowhere/*.jsonl"


@pytest.mark.parametrize(
    "module,options,message",
    [
        (RLDataModule, {"paths": None, "seq_len": 0}, RL_PATHS),
        (RLDataModule, {"paths": [], "max_records": 0, "val_fraction": 2.0, "num_workers": -1}, RL_PATHS),
        (RLDataModule, {"paths": [NOWHERE], "seq_len": 1}, "data.seq_len=1 must be >= 2 (an integer)"),
        (
            RLDataModule,
            {"paths": [NOWHERE], "max_records": 0, "val_fraction": 2.0},
            "data.max_records=0 must be >= 1",
        ),
        (DistillationDataModule, {"paths": None, "tokens_per_batch": 1}, DISTILLATION_PATHS),
        (DistillationDataModule, {"paths": None, "pad_id": -1, "num_workers": -1}, DISTILLATION_PATHS),
        (
            TextDataModule,
            {"max_documents": 0, "val_fraction": 1.5},
            "data.val_fraction=1.5 must be in [0, 1)",
        ),
        (
            TextDataModule,
            {"seq_len": 1, "val_fraction": 1.5},
            "data.seq_len=1 must be >= 2 (a label needs a next token)",
        ),
        (TextDataModule, {"paths": [NOWHERE], "max_documents": 0}, "data.max_documents=0 must be >= 1"),
        (
            TextDataModule,
            {"max_documents": 0, "num_workers": -1},
            "data.max_documents=0 must be >= 1",
        ),
        (PreferenceDataModule, {"paths": None, "truncation_mode": "keep_middle"}, PREFERENCE_PATHS),
        (PreferenceDataModule, {"paths": None, "max_length": 1, "vocab_size": None}, PREFERENCE_PATHS),
    ],
)
def test_the_first_error_is_the_one_these_constructors_always_gave(module, options, message):
    with pytest.raises(ConfigError) as err:
        module(**options)
    assert str(err.value) == message


@pytest.fixture
def tokenizer_loads(monkeypatch) -> list[str]:
    """The tokenizer paths `PreferenceDataModule` loads (a stand-in of 300 tokens)."""
    loads: list[str] = []

    class Loaded:
        def __len__(self) -> int:
            return 300

    def load(path: str) -> Loaded:
        loads.append(path)
        return Loaded()

    monkeypatch.setattr(preference, "load_tokenizer", load)
    return loads


def test_preference_data_loads_its_tokenizer_after_every_cheap_check(tmp_path, tokenizer_loads):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "a", "chosen": " b", "rejected": " c"}) + "\n")
    cases = [
        ({"paths": None}, PREFERENCE_PATHS),
        ({"paths": [str(pairs)], "max_records": 0}, "data.max_records=0 must be >= 1"),
        ({"paths": [str(pairs)], "val_fraction": 1.5}, "data.val_fraction=1.5 must be in [0, 1)"),
        (
            {"paths": [str(pairs)], "num_workers": -1},
            "data.num_workers=-1 must be >= 0 (0: load in the main process)",
        ),
        ({"paths": [NOWHERE]}, f"data.paths entry {NOWHERE!r} matches no file"),
    ]
    for options, message in cases:
        with pytest.raises(ConfigError) as err:
            PreferenceDataModule(tokenizer="/some/tokenizer", vocab_size=None, **options)
        assert str(err.value) == message, options
    assert tokenizer_loads == []
    with pytest.raises(ConfigError) as err:
        PreferenceDataModule(paths=[str(pairs)], tokenizer="/some/tokenizer", vocab_size=100)
    assert (
        str(err.value) == "data.vocab_size=100 is smaller than the tokenizer's 300 tokens ('/some/tokenizer')"
    )
    data = PreferenceDataModule(paths=[str(pairs)], tokenizer="/some/tokenizer", vocab_size=None)
    assert tokenizer_loads == ["/some/tokenizer", "/some/tokenizer"]
    assert len(data.hf_tokenizer) == 300 and data.sources == [str(pairs)]
