"""`HFTextDataModule` (a local Hugging Face tokenizer, local text/JSONL files, packed micro-batches) and
`NextTokenCollator` (Hugging Face collators with next-token labels)."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

from lit_losses.data.hf_text import HFTextDataModule, NextTokenCollator
from lit_losses.errors import ConfigError

TEXTS = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int\n    y: int\n", "print('hello')\n"]


def save_tokenizer(folder, eos=True):
    """A byte-level BPE trained here, saved as a `PreTrainedTokenizerFast` directory."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>", "<pad>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(TEXTS * 5, trainer)
    special = {"eos_token": "<eos>", "pad_token": "<pad>"} if eos else {"pad_token": "<pad>"}
    PreTrainedTokenizerFast(tokenizer_object=bpe, **special).save_pretrained(folder)
    return str(folder)


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "a.txt").write_text(TEXTS[0])
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXTS[1:]) + "\n")
    return tmp_path


def test_documents_are_tokenized_packed_and_labelled_with_the_next_token(corpus):
    tok_dir = save_tokenizer(corpus / "tok")
    data = HFTextDataModule(
        tok_dir,
        paths=[str(corpus / "*.txt"), str(corpus / "*.jsonl")],
        seq_len=64,
        tokens_per_batch=64,
        val_fraction=0.0,
    )
    data.setup("fit")
    tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    batches = [data.train_set[i] for i in range(len(data.train_set))]
    seen = []
    for b in batches:
        for row, segs, labels, pos in zip(b["input_ids"], b["segment_ids"], b["labels"], b["position_ids"]):
            for s in segs.unique().tolist():
                if s == 0:
                    continue  # padding
                ids = row[segs == s]
                assert torch.equal(pos[segs == s], torch.arange(len(ids)))
                assert torch.equal(labels[segs == s][:-1], ids[1:]) and labels[segs == s][-1] == -100
                assert ids[-1] == tok.eos_token_id
                seen.append(tok.decode(ids[:-1]))
    assert sorted(seen) == sorted(TEXTS)
    assert data.vocab_size == data.hf_tokenizer.vocab_size == len(tok) > 256  # the tokenizer's size


def test_bad_settings_are_config_errors(corpus):
    with pytest.raises(ConfigError, match="'/no/such/tokenizer' is not a local directory"):
        HFTextDataModule("/no/such/tokenizer")
    tok_dir = save_tokenizer(corpus / "tok")
    with pytest.raises(ConfigError, match=r"data\.vocab_size=100 is smaller than the tokenizer's \d+ tokens"):
        HFTextDataModule(tok_dir, paths=[str(corpus / "*.txt")], vocab_size=100)
    no_eos = save_tokenizer(corpus / "no_eos", eos=False)
    data = HFTextDataModule(no_eos, paths=[str(corpus / "*.txt")], seq_len=32, tokens_per_batch=32)
    with pytest.raises(ConfigError, match=r"no eos_token; set data\.append_eos: false"):
        data.setup("fit")


def test_next_token_collator_shifts_a_hugging_face_collators_labels(corpus):
    tok = PreTrainedTokenizerFast.from_pretrained(save_tokenizer(corpus / "tok"))
    features = [{"input_ids": tok(t)["input_ids"]} for t in TEXTS]
    batch = NextTokenCollator(DataCollatorForLanguageModeling(tok, mlm=False))(features)
    ids, labels, attention = batch["input_ids"], batch["labels"], batch["attention_mask"]
    valid = labels != -100
    assert torch.equal(labels[:, :-1][valid[:, :-1]], ids[:, 1:][valid[:, :-1]])
    assert int(valid.sum()) == int(attention.sum()) - len(TEXTS)  # every token but each document's first
