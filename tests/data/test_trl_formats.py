"""TRL's data formats tokenize to TRL's token ids: the reference is TRL's own preprocessing.

On the same JSONL records and the same tokenizer, `PreferenceDataModule` and `HFTextDataModule` give the
rows (token ids, and the positions trained on) that TRL 1.16's trainers build: ``DPOTrainer`` and
``KTOTrainer`` (their ``_prepare_dataset``, run by the trainer's constructor, then the trainer's own
collator) and ``SFTTrainer`` (its prepared ``train_dataset``, labels aligned with ``input_ids``). Four
tokenizers: the shipped ChatML one (no BOS, a chat template with ``{% generation %}`` markers), the same
vocabulary with a BOS token (and, in a third, an EOS token) added to every text and no chat template, and
the ChatML one with a template that also renders a record's ``tools`` and ``chat_template_kwargs``.

Rows are compared as multisets (the data modules shuffle and group records by length): a row is its
tokens and its next-token labels (``-100`` where no target), TRL's completion mask ``m`` giving
``labels[t] = ids[t + 1]`` where ``m[t + 1]``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from datasets import Dataset
from tokenizers import processors
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, SFTConfig, SFTTrainer

from lit_losses import PreferenceDataModule
from lit_losses.data.hf_text import HFTextDataModule
from lit_losses.errors import ConfigError
from tests.data.chat_tokenizer import SHIPPED

CHATML = str(SHIPPED)
IGNORE = -100

Row = tuple[tuple[int, ...], tuple[int, ...]]


# ---- tokenizers, models, files -------------------------------------------------------------------
def plain_tokenizer(folder: Path, single: str) -> str:
    """The shipped vocabulary without a chat template, adding ``<|im_start|>`` (as BOS) and
    ``<|endoftext|>`` to every text as the post-processor template ``single`` says."""
    tok = AutoTokenizer.from_pretrained(CHATML)
    tok.chat_template = None
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[("<|im_start|>", 2), ("<|endoftext|>", 0)]
    )
    tok.bos_token = "<|im_start|>"
    tok.save_pretrained(folder)
    return str(folder)


TOOLS_PREAMBLE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif %}"
    "{%- if brief %}{{- '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, str]:
    """``chatml`` (shipped); ``bos``, ``bos+eos``: no chat template, BOS (and EOS) added to every text
    (`plain_tokenizer`: a tokenized prompt then ends with an EOS that prompt + completion moves to the
    end); ``tools``: the shipped one whose template also renders a record's ``tools`` and a ``brief``
    keyword argument."""
    tok = AutoTokenizer.from_pretrained(CHATML)
    tok.chat_template = TOOLS_PREAMBLE + tok.chat_template
    folder = tmp_path_factory.mktemp("tools-tokenizer")
    tok.save_pretrained(folder)
    return {
        "chatml": CHATML,
        "bos": plain_tokenizer(tmp_path_factory.mktemp("bos"), "<|im_start|> $A"),
        "bos+eos": plain_tokenizer(tmp_path_factory.mktemp("bos-eos"), "<|im_start|> $A <|endoftext|>"),
        "tools": str(folder),
    }


def tiny_llama(vocab_size: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


def write_jsonl(folder: Path, records: list[dict]) -> str:
    path = folder / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def trl_args(config_class, folder: Path, records: list[dict], **options):
    return config_class(
        output_dir=str(folder / "trl"),
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        per_device_train_batch_size=len(records),  # KTO's KL rotation: one chunk, the whole data set
        **options,
    )


def preference_trainer(trainer_class, config_class, tok, folder: Path, records: list[dict], **options):
    """TRL's ``trainer_class`` over ``records`` with a tiny policy and reference (different seeds)."""
    return trainer_class(
        model=tiny_llama(len(tok), seed=0),
        ref_model=tiny_llama(len(tok), seed=1),
        args=trl_args(config_class, folder, records, **options),
        train_dataset=Dataset.from_list(records),
        processing_class=tok,
    )


# ---- rows --------------------------------------------------------------------------------------
def masked_row(ids: torch.Tensor, completion_mask: torch.Tensor) -> Row:
    """A row of TRL's (tokens, completion mask) as tokens and next-token labels."""
    ids, mask = ids.tolist(), completion_mask.tolist()
    labels = [tok if m else IGNORE for tok, m in zip(ids[1:], mask[1:], strict=True)]
    return tuple(ids), (*labels, IGNORE)


def trl_rows(batch: dict, prefix: str = "") -> list[Row]:
    lengths = batch[f"{prefix}attention_mask"].sum(1).tolist()
    return [
        masked_row(ids[:n], mask[:n])
        for ids, mask, n in zip(batch[f"{prefix}input_ids"], batch[f"{prefix}completion_mask"], lengths)
    ]


def our_rows(batch: dict, prefix: str = "") -> list[Row]:
    lengths = batch[f"{prefix}attention_mask"].sum(1).tolist()
    return [
        (tuple(ids[:n].tolist()), tuple(labels[:n].tolist()))
        for ids, labels, n in zip(batch[f"{prefix}input_ids"], batch[f"{prefix}labels"], lengths)
    ]


def trl_collated(trainer) -> dict:
    """The whole prepared data set through the trainer's own collator (no shuffle)."""
    return trainer.data_collator(list(trainer.train_dataset))


def preference_module(path: str, tokenizer: str, **options) -> PreferenceDataModule:
    data = PreferenceDataModule(paths=[path], tokenizer=tokenizer, tokens_per_batch=1 << 16, **options)
    data.setup("fit")
    return data


def our_pairs(data: PreferenceDataModule) -> Counter:
    pairs = Counter()
    for batch in data.train_set:
        rows, n = our_rows(batch), batch["input_ids"].shape[0] // 2
        refs = [batch[k].tolist() for k in ("ref_chosen_logps", "ref_rejected_logps") if k in batch]
        for i in range(n):
            pairs[(rows[i], rows[n + i], *(round(r[i], 6) for r in refs))] += 1
    return pairs


def trl_pairs(trainer) -> Counter:
    batch = trl_collated(trainer)
    rows, n = trl_rows(batch), batch["input_ids"].shape[0] // 2
    refs = [batch[k].tolist() for k in ("ref_chosen_logps", "ref_rejected_logps") if k in batch]
    return Counter((rows[i], rows[n + i], *(round(r[i], 6) for r in refs)) for i in range(n))


# ---- records -------------------------------------------------------------------------------------
def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "Be brief."}


STANDARD = [
    {"prompt": "Hello there", "chosen": " good answer", "rejected": " bad"},
    {"prompt": "Sky is ", "chosen": "blue", "rejected": "green"},  # " blue" merges across the boundary
    {"prompt": "What is 2+", "chosen": "2? 4", "rejected": "2? 5<|endoftext|>"},  # EOS already there
    {
        "prompt": "A much longer question about the weather today,",
        "chosen": " sunny and warm.",
        "rejected": " it will rain all day long, cold and grey.",
    },
]
REFS = [{"ref_chosen_logps": -1.5 - i, "ref_rejected_logps": -2.25 - i} for i in range(len(STANDARD))]
IMPLICIT = [
    {"chosen": "Sky? It is blue.", "rejected": "Sky? It is green."},
    {"chosen": "Two plus two is four", "rejected": "Two plus two is five, surely"},
    {"chosen": "Same start", "rejected": "Same start, longer"},  # one is a prefix of the other
]
CONVERSATIONAL = [
    {"prompt": [user("What is 2 + 2?")], "chosen": [assistant("4.")], "rejected": [assistant("5.")]},
    {
        "prompt": [SYSTEM, user("Sky?")],
        "chosen": [assistant("Blue.")],
        "rejected": [assistant("Green, I think, or maybe grey.")],
    },
]
IMPLICIT_CONVERSATIONAL = [
    {"chosen": [user("Hi"), assistant("Hello!")], "rejected": [user("Hi"), assistant("Go away.")]},
    {
        "chosen": [user("Sky?"), assistant("Blue."), user("Sure?"), assistant("Yes.")],
        "rejected": [user("Sky?"), assistant("Blue."), user("Sure?"), assistant("No, green.")],
    },
]
TOOLS = json.dumps([{"type": "function", "function": {"name": "add", "parameters": {}}}])
WITH_TOOLS = [  # TRL's ``tools`` (JSON text) and ``chat_template_kwargs``, in every record as Arrow needs
    CONVERSATIONAL[0] | {"tools": TOOLS, "chat_template_kwargs": {"brief": True}},
    CONVERSATIONAL[1] | {"tools": "[]", "chat_template_kwargs": {"brief": False}},
    {
        "prompt": [user("Add 2 and 3.")],
        "chosen": [assistant("5")],
        "rejected": [assistant("6")],
        "tools": TOOLS,
        "chat_template_kwargs": {"brief": False},
    },
]
UNPAIRED = [
    {"prompt": "Hello there", "completion": " good answer", "label": True},
    {"prompt": "Sky is ", "completion": "blue", "label": True},
    {"prompt": "What is 2+", "completion": "2? 5<|endoftext|>", "label": False},
    {"prompt": "A much longer question about the weather,", "completion": " rain.", "label": False},
]
UNPAIRED_CONVERSATIONAL = [
    {"prompt": [user("2 + 2?")], "completion": [assistant("4.")], "label": True},
    {"prompt": [user("Sky?")], "completion": [assistant("Green.")], "label": False},
    {"prompt": [user("Hi")], "completion": [assistant("Hello, how can I help?")], "label": True},
]


# ---- DPO ---------------------------------------------------------------------------------------
DPO_CASES = {
    "standard": (STANDARD, "chatml", {}),
    "standard, BOS, no chat template": (STANDARD, "bos", {}),
    "standard, BOS and EOS added": (STANDARD, "bos+eos", {}),
    "precomputed reference": ([r | ref for r, ref in zip(STANDARD, REFS)], "chatml", {}),
    "implicit prompt": (IMPLICIT, "chatml", {}),
    "implicit prompt, BOS": (IMPLICIT, "bos", {}),
    "conversational": (CONVERSATIONAL, "chatml", {}),
    "implicit conversational": (IMPLICIT_CONVERSATIONAL, "chatml", {}),
    "conversational, tools": (WITH_TOOLS, "tools", {}),
    "keep_start": (STANDARD, "chatml", {"max_length": 20, "truncation_mode": "keep_start"}),
    "keep_end": (STANDARD, "chatml", {"max_length": 7, "truncation_mode": "keep_end"}),
    "keep_end, conversational": (CONVERSATIONAL, "chatml", {"max_length": 9, "truncation_mode": "keep_end"}),
}


@pytest.mark.parametrize("case", list(DPO_CASES))
def test_preference_pairs_tokenize_as_trl_dpo_trainer(case, tmp_path, tokenizers):
    """DPOTrainer's ``_prepare_dataset`` (prompt extraction, EOS, tokenization, the prompt where the two
    tokenizations diverge) and ``DataCollatorForPreference`` (truncation) give our pairs' rows."""
    records, which, options = DPO_CASES[case]
    tokenizer = tokenizers[which]
    tok = AutoTokenizer.from_pretrained(tokenizer)
    options = {"max_length": None} | options
    trainer = preference_trainer(DPOTrainer, DPOConfig, tok, tmp_path, records, **options)
    data = preference_module(write_jsonl(tmp_path, records), tokenizer, **options)
    expected = trl_pairs(trainer)
    assert sum(expected.values()) == len(records)  # TRL dropped no record
    assert our_pairs(data) == expected


def test_a_prompt_that_merges_into_its_completion_keeps_the_completion_tokens(tmp_path):
    """``"Sky is "`` + ``"blue"``: the space joins ``" blue"``; the chosen row is the tokenized
    prompt + completion, trained from where it leaves the tokenized prompt."""
    tok = AutoTokenizer.from_pretrained(CHATML)
    record = {"prompt": "Sky is ", "chosen": "blue", "rejected": "green"}
    with pytest.warns(UserWarning, match="left out of the sequence"):
        data = preference_module(write_jsonl(tmp_path, [record]), CHATML, max_length=None)
    ((chosen, rejected),) = [pair[:2] for pair in our_pairs(data)]
    for (ids, labels), completion in ((chosen, "blue"), (rejected, "green")):
        assert list(ids) == tok("Sky is " + completion + tok.eos_token)["input_ids"]
        targets = [t for t in labels if t != IGNORE]
        assert tok.decode(targets) == " " + completion + tok.eos_token  # the merged space with it


# ---- KTO ---------------------------------------------------------------------------------------
UNPAIRED_TOOLS = [
    {"prompt": r["prompt"], "completion": r[key], "label": key == "chosen"}
    | {k: r[k] for k in ("tools", "chat_template_kwargs")}
    for r in WITH_TOOLS
    for key in ("chosen", "rejected")
]
KTO_CASES = {
    "standard": (UNPAIRED, "chatml", {"max_length": None}),
    "standard, BOS, no chat template": (UNPAIRED, "bos", {"max_length": None}),
    "standard, BOS and EOS added": (UNPAIRED, "bos+eos", {"max_length": None}),
    "conversational": (UNPAIRED_CONVERSATIONAL, "chatml", {"max_length": None}),
    "conversational, tools": (UNPAIRED_TOOLS, "tools", {"max_length": None}),
    "max_length": (UNPAIRED, "chatml", {"max_length": 16}),
}


def our_unpaired(data: PreferenceDataModule) -> Counter:
    out = Counter()
    for batch in data.train_set:
        rows, kl_rows = our_rows(batch), our_rows(batch, prefix="kl_")
        out.update(zip(rows, kl_rows, batch["kto_label"].tolist(), strict=True))
    return out


def trl_unpaired(trainer) -> Counter:
    batch = trl_collated(trainer)
    rows, kl_rows = trl_rows(batch), trl_rows(batch, prefix="KL_")
    return Counter(zip(rows, kl_rows, batch["label"].tolist(), strict=True))


@pytest.mark.parametrize("case", list(KTO_CASES))
def test_unpaired_records_tokenize_as_trl_kto_trainer(case, tmp_path, tokenizers):
    """KTOTrainer's rows and KL rows (the completions rotated by one over a chunk that holds the whole
    data set, as ours over the file) and labels."""
    records, which, options = KTO_CASES[case]
    tokenizer = tokenizers[which]
    tok = AutoTokenizer.from_pretrained(tokenizer)
    trainer = preference_trainer(KTOTrainer, KTOConfig, tok, tmp_path, records, **options)
    data = preference_module(write_jsonl(tmp_path, records), tokenizer, **options)
    expected = trl_unpaired(trainer)
    assert sum(expected.values()) == len(records)
    assert our_unpaired(data) == expected


# ---- SFT ---------------------------------------------------------------------------------------
TEXT = [
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"text": "Ends with its own end of text.<|endoftext|>"},
    {"text": "Short."},
]
PROMPT_COMPLETION = [
    {"prompt": "Translate to French: cat", "completion": " chat"},
    {"prompt": "Sky is ", "completion": "blue"},  # merges across the boundary
    {"prompt": "2 + 2 =", "completion": " 4<|endoftext|>"},
    {"prompt": "A longer prompt, so that truncation cuts", "completion": " into the completion here."},
]
CONVERSATIONAL_PC = [
    {"prompt": [user("2 + 2?")], "completion": [assistant("4.")]},
    {"prompt": [SYSTEM, user("Sky?")], "completion": [assistant("Blue.")]},
]
MESSAGES = [
    {"messages": [user("Hi"), assistant("Hello!")]},
    {"messages": [SYSTEM, user("Sky?"), assistant("Blue."), user("Sure?"), assistant("Yes, quite.")]},
]
MESSAGES_TOOLS = [
    {
        "messages": r["prompt"] + r["chosen"],
        "tools": r["tools"],
        "chat_template_kwargs": r["chat_template_kwargs"],
    }
    for r in WITH_TOOLS
]
ASSISTANT_ONLY = {"assistant_only_loss": True}
SFT_CASES = {
    "text": (TEXT, "chatml", {}),
    "text, BOS": (TEXT, "bos", {}),
    "prompt-completion": (PROMPT_COMPLETION, "chatml", {}),
    "prompt-completion, BOS": (PROMPT_COMPLETION, "bos", {}),
    "prompt-completion, BOS and EOS added": (PROMPT_COMPLETION, "bos+eos", {}),
    "prompt-completion, every token": (PROMPT_COMPLETION, "chatml", {"completion_only_loss": False}),
    "prompt-completion, max_length": (PROMPT_COMPLETION, "chatml", {"max_length": 24}),
    "conversational prompt-completion": (CONVERSATIONAL_PC, "chatml", {}),
    "conversational prompt-completion, assistant only": (CONVERSATIONAL_PC, "chatml", ASSISTANT_ONLY),
    "messages": (MESSAGES, "chatml", {}),
    "messages, assistant only": (MESSAGES, "chatml", ASSISTANT_ONLY),
    "messages, assistant only, max_length": (MESSAGES, "chatml", ASSISTANT_ONLY | {"max_length": 44}),
    "messages, tools": (MESSAGES_TOOLS, "tools", ASSISTANT_ONLY | {"max_length": 256}),
}


def trl_sft_rows(trainer) -> Counter:
    """SFTTrainer's prepared rows; its labels are aligned with ``input_ids`` (the model shifts them)."""
    rows = Counter()
    for example in trainer.train_dataset:
        ids, labels = example["input_ids"], example["labels"]
        rows[(tuple(ids), (*labels[1:], IGNORE))] += 1
    return rows


def our_sft_rows(data: HFTextDataModule) -> Counter:
    rows = Counter()
    for batch in data.train_set:
        lengths = (batch["segment_ids"] != 0).sum(1).tolist()
        rows.update(
            (tuple(ids[:n].tolist()), tuple(labels[:n].tolist()))
            for ids, labels, n in zip(batch["input_ids"], batch["labels"], lengths)
        )
    return rows


@pytest.mark.parametrize("case", list(SFT_CASES))
def test_sft_records_tokenize_as_trl_sft_trainer(case, tmp_path, tokenizers):
    """SFTTrainer without packing (``completion_only_loss`` left to its default unless given,
    ``assistant_only_loss``, ``max_length`` as ``seq_len``) and `HFTextDataModule` without packing."""
    records, which, options = SFT_CASES[case]
    tokenizer = tokenizers[which]
    tok = AutoTokenizer.from_pretrained(tokenizer)
    max_length = options.pop("max_length", 64)
    trainer = SFTTrainer(
        model=tiny_llama(len(tok), seed=0),
        args=trl_args(SFTConfig, tmp_path, records, packing=False, max_length=max_length, **options),
        train_dataset=Dataset.from_list(records),
        processing_class=tok,
    )
    data = HFTextDataModule(
        tokenizer,
        paths=[write_jsonl(tmp_path, records)],
        seq_len=max_length,
        tokens_per_batch=1 << 16,
        packing=False,
        val_fraction=0.0,
        **options,
    )
    data.setup("fit")
    expected = trl_sft_rows(trainer)
    assert sum(expected.values()) == len(records)
    assert our_sft_rows(data) == expected


# ---- records TRL would train silently ----------------------------------------------------------
NOT_THE_ASSISTANT = [
    (
        "preference",
        {"prompt": [user("Hi")], "chosen": [assistant("Hello!")], "rejected": [assistant("Hm."), user("?")]},
        "'rejected'",
    ),
    (
        "preference",
        {"chosen": [user("Hi"), assistant("Hi!"), user("Bye")], "rejected": [user("Hi"), assistant("Hm.")]},
        "'chosen'",
    ),
    ("preference", {"prompt": [user("Hi")], "completion": [user("Hello!")], "label": True}, "'completion'"),
    ("sft", {"messages": [user("Hi"), assistant("Hello!"), user("And?")]}, "'messages'"),
    ("sft", {"prompt": [user("Hi")], "completion": [{"role": "system", "content": "x"}]}, "'completion'"),
]


@pytest.mark.parametrize(("kind", "record", "key"), NOT_THE_ASSISTANT)
def test_a_conversation_that_does_not_end_with_the_assistant_is_refused(kind, record, key, tmp_path):
    """TRL trains such a record as the template renders it (the completion then ends with another
    role's turn); we refuse it, naming ``file:line`` and the field."""
    good = {
        "preference": {"prompt": [user("Yo")], "chosen": [assistant("Yo!")], "rejected": [assistant("No.")]},
        "sft": {"messages": [user("Yo"), assistant("Yo!")]},
    }[kind]
    if "label" in record:
        good = {"prompt": [user("Yo")], "completion": [assistant("Yo!")], "label": False}
    if kind == "sft" and "prompt" in record:
        good = {"prompt": [user("Yo")], "completion": [assistant("Yo!")]}
    path = write_jsonl(tmp_path, [good, record])
    with pytest.raises(ConfigError) as err:
        if kind == "preference":
            preference_module(path, CHATML, max_length=None)
        else:
            data = HFTextDataModule(CHATML, paths=[path], seq_len=64, tokens_per_batch=256, val_fraction=0)
            data.setup("fit")
    message = str(err.value)
    assert f"{path}:2" in message and key in message and "assistant" in message, message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tools": 5}, "field 'tools' is a int, not a list of function schemas"),
        ({"tools": "[{"}, "field 'tools' is a string that is not JSON"),
        ({"chat_template_kwargs": ["brief"]}, "field 'chat_template_kwargs' is a list, not a mapping"),
        ({"chat_template_kwargs": {"tokenize": False}}, "the chat template of"),
    ],
)
def test_bad_chat_template_arguments_are_one_line_naming_the_record(extra, message, tmp_path):
    record = CONVERSATIONAL[0] | extra
    path = write_jsonl(tmp_path, [CONVERSATIONAL[1], record])
    with pytest.raises(ConfigError) as err:
        preference_module(path, CHATML, max_length=None)
    assert str(err.value).startswith(f"{path}:2: ") and message in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_a_tokenizer_without_eos_is_refused_for_standard_completions(tmp_path):
    """TRL appends the EOS token's text to every standard completion; without one there is none to
    append (TRL fails on ``str + None``)."""
    tok = AutoTokenizer.from_pretrained(CHATML)
    tok.eos_token = None
    tok.save_pretrained(tmp_path / "no-eos")
    with pytest.raises(ConfigError, match="has no eos_token, which ends every standard"):
        preference_module(write_jsonl(tmp_path, STANDARD), str(tmp_path / "no-eos"), max_length=None)
    data = preference_module(write_jsonl(tmp_path, CONVERSATIONAL), str(tmp_path / "no-eos"), max_length=None)
    assert len(our_pairs(data)) == len(CONVERSATIONAL)  # a conversation's template ends its turns
