"""Hugging Face collators' batches (labels aligned with ``input_ids``) through `GlobalStatsLoader` and a
Lightning fit with ``accumulate_grad_batches=2``: the loader counts the targets after the model's shift, so
the first step's loss is the model's own ``labels=`` loss over the step's documents."""

import lightning as L
import pytest
import torch

pytest.importorskip("transformers")

from tokenizers import Tokenizer, models
from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening, PreTrainedTokenizerFast

from lit_losses import GlobalStatsLoader, HFCausalLM

V = 64
CONFIG = {
    "model_type": "llama",
    "vocab_size": V,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}


def documents() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(2, V, (n,), generator=g).tolist()} for n in (5, 9, 3, 7, 2)]


def padding_collator() -> DataCollatorForLanguageModeling:
    vocab = {f"w{i}": i for i in range(V)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w1")), pad_token="w0"
    )
    return DataCollatorForLanguageModeling(tokenizer, mlm=False)


def first_step_loss(collate, loss_agg: str = "token-mean") -> tuple[float, HFCausalLM]:
    """``train/loss_total`` of the first optimizer step over micro-batches of 2 and 3 documents."""
    torch.manual_seed(0)
    model = HFCausalLM(config=CONFIG, label_format="input_aligned", loss_agg=loss_agg)
    docs = documents()
    loader = GlobalStatsLoader([docs[:2], docs[2:]], batch_size=None, collate_fn=lambda f: dict(collate(f)))
    reference = HFCausalLM(model=model.model.__class__(model.model.config), label_format="input_aligned")
    reference.model.load_state_dict(model.model.state_dict())
    L.Trainer(
        max_steps=1,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    ).fit(model, loader)
    return model.telemetry["loss_total"], reference


def test_padded_batches_give_the_models_own_loss_over_the_step():
    """``DataCollatorForLanguageModeling(mlm=False)``: labels are the inputs, padding ignored; each
    micro-batch loses one target per document to the shift, which the counts must see."""
    collate = padding_collator()
    loss, reference = first_step_loss(collate)
    union = dict(collate(documents()))  # the step's 5 documents in one batch
    with torch.no_grad():
        expected = reference.model(**union).loss
    assert loss == pytest.approx(float(expected), rel=1e-5)


def test_flattened_batches_give_the_models_own_loss_over_the_documents():
    """``DataCollatorWithFlattening``: one packed row per micro-batch (``position_ids`` restart per
    document). The reference is the model's own loss on the same documents as padded rows: its sdpa
    attention does not separate documents of a flattened row, lit_losses' block-diagonal mask does."""
    loss, reference = first_step_loss(DataCollatorWithFlattening())
    union = dict(padding_collator()(documents()))
    with torch.no_grad():
        expected = reference.model(**union).loss
    assert loss == pytest.approx(float(expected), rel=1e-5)


def test_counting_before_the_shift_would_be_off():
    """The same step with the loader left to count the collator's labels as they are: another value."""
    collate = padding_collator()
    docs = documents()
    loader = GlobalStatsLoader(
        [docs[:2], docs[2:]],
        batch_size=None,
        collate_fn=lambda f: dict(collate(f)),
        accumulate_grad_batches=2,
        label_format="next_token",
    )
    counted = next(iter(loader))["global_stats"].get().num_tokens
    targets = sum(len(d["input_ids"]) - 1 for d in docs)  # the shift drops one target per document
    assert counted == targets + len(docs)
    loader.label_format = "input_aligned"
    assert next(iter(loader))["global_stats"].get().num_tokens == targets
