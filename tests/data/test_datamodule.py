"""`FileDataModule`, the base of the data modules: the split and the seeded shuffle against the documented
rule written out here, each module's hyperparameters (what a checkpoint saves and a resume compares) against
its constructor's signature, and the built-in tokenizer's cache told apart by the records it is trained on."""

from __future__ import annotations

import inspect
import json
import random
from pathlib import Path

import pytest
import torch

from lit_losses.data import (
    DistillationDataModule,
    FileDataModule,
    PreferenceDataModule,
    RLDataModule,
    TextDataModule,
)
from lit_losses.data.preference import record_texts
from lit_losses.data.tokenizer import train_tokenizer
from lit_losses.errors import ConfigError


class Numbers(FileDataModule):
    """One JSON number per line; a micro-batch per item."""

    paths_hint = "give the files of numbers"

    def __init__(self, paths, max_records=None, val_fraction=0.0, seed=0) -> None:
        super().__init__(paths, val_fraction=val_fraction, seed=seed, num_workers=0)
        self.max_records = max_records

    def read_items(self) -> list[int]:
        values = self.read_sources(lambda src: [int(word) for word in Path(src).read_text().split()])
        return self.shuffled(values, limit=self.max_records)

    def build_dataset(self, items: list[int]) -> list[dict]:
        return [{"input_ids": torch.tensor([[item]]), "labels": torch.tensor([[item]])} for item in items]


@pytest.mark.parametrize("n,fraction,limit,seed", [(10, 0.25, None, 0), (10, 0.01, 7, 3), (1, 0.0, None, 1)])
def test_items_are_shuffled_cut_and_split_by_the_documented_rule(tmp_path, n, fraction, limit, seed):
    path = tmp_path / "n.txt"
    path.write_text("\n".join(str(i) for i in range(n)))
    data = Numbers(paths=[str(path)], max_records=limit, val_fraction=fraction, seed=seed)
    data.setup("fit")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    order = order[:limit] if limit else order
    n_val = max(1, round(len(order) * fraction)) if len(order) > 1 else 0
    assert [int(b["input_ids"]) for b in data.train_set] == order[n_val:]
    assert [int(b["input_ids"]) for b in data.val_set or []] == order[:n_val]
    loader = data.train_dataloader()
    loader.configure(accumulate_grad_batches=2, mask_keys=["labels"], ignore_index=-100)
    served = sorted(int(batch["input_ids"]) for batch in loader)
    assert served == sorted(order[n_val:])  # the training loader serves each micro-batch once per epoch


def test_a_module_without_files_names_the_option_with_its_hint(tmp_path):
    with pytest.raises(ConfigError, match=r"^data\.paths: give the files of numbers$"):
        Numbers(paths=[])


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_each_modules_hyperparameters_are_its_constructor_arguments(tmp_path):
    rl = _write(tmp_path / "rl.jsonl", [{"tokens": [1, 2], "logprobs": [None, -1.0], "advantage": 1.0}])
    pairs = _write(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": " b", "rejected": " c"}])
    text = _write(tmp_path / "t.jsonl", [{"text": "a b c"}])
    cases = [
        (
            TextDataModule,
            {"paths": [text], "vocab_size": 300, "seq_len": 8, "tokens_per_batch": 16, "seed": 4},
        ),
        (RLDataModule, {"paths": [rl], "vocab_size": 9, "pad_id": 1, "max_records": 3, "packing": False}),
        (DistillationDataModule, {"paths": [rl], "vocab_size": 9, "seq_len": 6, "val_fraction": 0.5}),
        (
            PreferenceDataModule,
            {"paths": [pairs], "vocab_size": 300, "max_length": 8, "tokens_per_batch": 64},
        ),
    ]
    for module, options in cases:
        expected = inspect.signature(module).bind(**options)
        expected.apply_defaults()
        assert dict(module(**options).hparams) == expected.arguments, module.__name__


def test_the_cached_preference_tokenizer_is_the_one_of_the_records_it_trains_on(tmp_path):
    words = [
        "apple",
        "banana",
        "cherry",
        "damson",
        "elder",
        "fig",
        "grape",
        "hazel",
        "kiwi",
        "lemon",
        "mango",
    ]
    pairs = [
        {"prompt": f"Which fruit is {w}{i}?", "chosen": f" The {w} tree.", "rejected": f" A {w[::-1]} stone."}
        for i, w in enumerate(words)
    ]
    path = _write(tmp_path / "pairs.jsonl", pairs)
    options = {"paths": [path], "vocab_size": 300, "max_length": 64, "tokens_per_batch": 256}
    few = PreferenceDataModule(**options, max_records=2, cache_dir=str(tmp_path))
    few.setup("fit")
    every = PreferenceDataModule(**options, cache_dir=str(tmp_path))  # same files, seed and cache folder
    every.setup("fit")
    train, _ = every.split(every.read_items())
    reference = train_tokenizer([t for record in train for t in record_texts(record)], vocab_size=300)
    assert every.tokenizer.get_vocab() == reference.get_vocab()
    assert few.tokenizer.get_vocab() != reference.get_vocab()
