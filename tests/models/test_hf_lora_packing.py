"""`HFCausalLM` with LoRA (only adapters train, the frozen output weight costs nothing) and with packed rows
(Hugging Face's ``DataCollatorWithFlattening`` and lit_losses' ``segment_ids``) against the same
documents in separate rows."""

import pytest
import torch

pytest.importorskip("peft")

from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DataCollatorWithFlattening

from lit_losses import GlobalStatsLoader, HFCausalLM
from lit_losses.data.hf_text import NextTokenCollator
from lit_losses.errors import ConfigError
from tests.models.hf_models import V, hf_config

LORA = {
    "r": 4,
    "lora_alpha": 8,
    "target_modules": ["q_proj", "v_proj"],
    "lora_dropout": 0.0,
    "init_lora_weights": False,  # random B: every adapter weight gets a gradient
}


class Shapes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple(t.shape))
        return out


def test_lora_gradients_equal_the_peft_models_own_and_the_frozen_head_costs_nothing():
    torch.manual_seed(0)
    model = HFCausalLM(config=hf_config("llama"), lora=LORA, label_format="input_aligned")
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(3, V, (2, 10), generator=g)}
    batch["labels"] = batch["input_ids"].clone()
    ref = model.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss  # the PeftModel's own loss
    ref.backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    ref_grads = {n: p.grad.clone() for n, p in trainable.items()}
    model.zero_grad()
    with Shapes() as log:
        loss = model.compute_loss(batch).total
        loss.backward()
    weight = model.output_projection()[0]
    assert trainable and all("lora_" in n for n in trainable)
    assert not weight.requires_grad and weight.grad is None
    assert tuple(weight.shape) not in log.shapes  # no V x D gradient buffer
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=0)
    for name, p in trainable.items():
        scale = ref_grads[name].abs().max()
        assert scale > 0
        torch.testing.assert_close(p.grad / scale, ref_grads[name] / scale, rtol=0, atol=1e-5, msg=name)
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)


def test_lora_on_the_output_layer_is_refused():
    with pytest.raises(ConfigError, match=r"not a plain nn\.Linear"):
        HFCausalLM(config=hf_config("llama"), lora={**LORA, "target_modules": ["q_proj", "lm_head"]})


DOCS = [[5, 9, 14, 20, 33], [40, 41, 42, 43, 44, 45, 46], [60, 61, 62, 63]]


def separate_rows():
    """The documents as padded rows, Hugging Face labels (aligned, -100 on padding)."""
    T = max(map(len, DOCS))
    input_ids = torch.full((len(DOCS), T), 2)
    attention = torch.zeros(len(DOCS), T, dtype=torch.long)
    for i, d in enumerate(DOCS):
        input_ids[i, : len(d)], attention[i, : len(d)] = torch.tensor(d), 1
    labels = input_ids.masked_fill(attention == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def loss_and_grads(model, batch):
    model.zero_grad()
    loss = model.compute_loss(batch).total
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_flattened_documents_give_the_loss_and_gradients_of_separate_rows(model_type):
    torch.manual_seed(0)
    model = HFCausalLM(
        config=hf_config(model_type), label_format="input_aligned", loss_agg="seq-mean-token-mean"
    )
    flat = DataCollatorWithFlattening()([{"input_ids": d} for d in DOCS])
    assert set(flat) == {"input_ids", "labels", "position_ids"} and flat["input_ids"].shape[0] == 1
    loss, grads = loss_and_grads(model, flat)
    ref, ref_grads = loss_and_grads(model, separate_rows())
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    for name, r in ref_grads.items():
        torch.testing.assert_close(grads[name], r, rtol=1e-5, atol=1e-6, msg=name)
    # the per-document mean really differs from the per-row mean of the packed row
    per_row = HFCausalLM(model=model.model, label_format="input_aligned", loss_agg="seq-mean-token-mean")
    flat_no_positions = {k: v for k, v in flat.items() if k != "position_ids"}
    per_row._packing_problem = ""
    assert not torch.isclose(per_row.compute_loss(flat_no_positions).total, ref)


def test_global_stats_loader_counts_flattened_documents_as_sequences():
    torch.manual_seed(0)
    model = HFCausalLM(config=hf_config("llama"), loss_agg="seq-mean-token-mean")
    collate = NextTokenCollator(DataCollatorWithFlattening())
    features = [{"input_ids": d} for d in DOCS]
    loader = GlobalStatsLoader(
        [features[:2], features[2:]], batch_size=None, collate_fn=collate, accumulate_grad_batches=2
    )
    micro = list(loader)
    assert micro[0]["global_stats"].get().num_sequences == 3
    total = sum(model.compute_loss(b).total for b in micro)
    ref = HFCausalLM(model=model.model, label_format="input_aligned", loss_agg="seq-mean-token-mean")
    torch.testing.assert_close(total, ref.compute_loss(separate_rows()).total, rtol=1e-6, atol=0)


def test_aligned_labels_counted_before_the_shift_are_refused():
    model = HFCausalLM(config=hf_config("llama"), label_format="input_aligned")
    rows = separate_rows()  # first label of each row valid: the shift drops it
    loader = GlobalStatsLoader([rows], batch_size=None, accumulate_grad_batches=1)
    with pytest.raises(ConfigError, match=r"counted 16 labelled tokens .* 13 after it.*NextTokenCollator"):
        model.compute_loss(next(iter(loader)))


def test_packed_rows_of_an_attention_that_cannot_separate_documents_are_refused(monkeypatch):
    """FlashAttention is given restarting position_ids alone; OPT (positions from the attention mask) given
    them alone lets documents attend to each other: the probe says so instead of training on it."""
    torch.manual_seed(0)
    opt = dict(
        model_type="opt",
        vocab_size=V,
        hidden_size=32,
        ffn_dim=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        word_embed_proj_dim=32,
        dropout=0.0,
    )
    model = HFCausalLM(config=opt, attn_implementation="sdpa", label_format="input_aligned")
    flat = DataCollatorWithFlattening()([{"input_ids": d} for d in DOCS])
    model.compute_loss(flat)  # sdpa with lit_losses' block mask: fine
    model._packing_problem = None
    monkeypatch.setattr(HFCausalLM, "attn_implementation", property(lambda self: "flash_attention_2"))
    with pytest.raises(ConfigError, match=r"'flash_attention_2', packed documents .* attend to each other"):
        model.compute_loss(flat)
