"""TRL's own ``DPOTrainer`` (1.16) and ``HFCausalLM`` with ``model.dpo`` on the same weights and token ids.

`trl_step` runs ``DPOTrainer.compute_loss`` on one micro-batch from TRL's own data pipeline (tokenizer,
``DataCollatorForPreference``: the chosen rows, then the rejected rows, right-padded, with
``completion_mask``) and returns its loss, every trainable parameter's gradient and the metrics it
logged. `lit_batch` writes that micro-batch in this package's preference layout (next-token ``labels`` on
the completion tokens, ``chosen_mask``), and `lit_step` runs ``HFCausalLM.compute_loss`` on it with the
``model.dpo`` fields a TRL user would write. Both models are the same tiny Llama in float64 (TRL's fused
head accumulates its softmax statistics in float32, so its values are float32-exact).
"""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from datasets import Dataset, disable_progress_bars
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from trl import DPOConfig, DPOTrainer

from lit_losses import HFCausalLM
from lit_losses.data.preference_batches import chosen_masks

disable_progress_bars()

TOKENIZER = Path(__file__).resolve().parents[2] / "data" / "tokenizers" / "chatml-bpe"
RECORDS = [  # completions of different lengths, so that length-normalized and LD-DPO values differ
    {"prompt": "What is 2 plus 3?", "chosen": " It is 5.", "rejected": " 6"},
    {"prompt": "Name a colour.", "chosen": " Red", "rejected": " I do not know any colours, sorry."},
    {"prompt": "Say hi", "chosen": " Hello there, friend!", "rejected": " Bye."},
    {"prompt": "Count to three.", "chosen": " One, two, three.", "rejected": " One, three, two, four."},
]
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def tokenizer():
    return AutoTokenizer.from_pretrained(str(TOKENIZER))


def base_weights() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], LlamaConfig]:
    """The policy's and the reference's state dicts (float64; the reference perturbed) and the config."""
    tok = tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    policy = LlamaForCausalLM(config).double()
    reference = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(2)  # 3 of the 4 pairs with a positive margin
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return policy.state_dict(), reference.state_dict(), config


class Weights:
    """The two models' weights, built once; `model` gives a fresh float64 Llama holding either."""

    def __init__(self) -> None:
        self.policy, self.reference, self.config = base_weights()
        self.tokenizer = tokenizer()
        self._dir = tempfile.TemporaryDirectory(prefix="trl_dpo_ref_")
        self.reference_dir = self._dir.name
        self.model("reference").save_pretrained(self.reference_dir)

    def model(self, which: str = "policy", dtype: torch.dtype = torch.float64) -> LlamaForCausalLM:
        model = LlamaForCausalLM(self.config).to(dtype)
        model.load_state_dict(self.policy if which == "policy" else self.reference)
        return model.train()


def trl_trainer(
    weights: Weights, lora: bool = False, dtype: torch.dtype = torch.float64, **fields: Any
) -> DPOTrainer:
    """TRL's ``DPOTrainer`` on `RECORDS` with ``DPOConfig(**fields)`` (one micro-batch of all the pairs):
    full fine-tuning against the perturbed reference, or LoRA against the policy with its adapters
    disabled (TRL's reference for a PEFT model)."""
    args = DPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_dpo_"),
        per_device_train_batch_size=len(RECORDS),
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        save_strategy="no",
        **fields,
    )
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(**LORA, lora_dropout=0.0)
    return DPOTrainer(
        model=weights.model("policy", dtype),
        ref_model=None if lora else weights.model("reference", dtype),
        args=args,
        train_dataset=Dataset.from_list(RECORDS),
        processing_class=weights.tokenizer,
        peft_config=peft_config,
    )


def trl_batch(trainer: DPOTrainer) -> dict[str, torch.Tensor]:
    """The one micro-batch of `RECORDS` from the trainer's own data loader."""
    return next(iter(trainer.get_train_dataloader()))


def trl_step(trainer: DPOTrainer, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict, dict]:
    """``DPOTrainer.compute_loss`` on ``batch``: the loss, the gradient of every trainable parameter (by
    name) and the metrics it logged."""
    trainer._metrics["train"].clear()
    model = trainer.model.train()
    model.zero_grad()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return loss.detach(), grads, metrics


def lit_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """TRL's micro-batch in this package's preference layout: next-token ``labels`` (``input_ids[t + 1]``
    where ``completion_mask[t + 1]``), ``attention_mask``, ``chosen_mask``; the precomputed reference
    values, when TRL's batch has them."""
    ids, completion = batch["input_ids"], batch["completion_mask"].bool()
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:].masked_fill(~completion[:, 1:], -100)
    out = {"input_ids": ids, "attention_mask": batch["attention_mask"], "labels": labels}
    out |= chosen_masks(labels, batch["attention_mask"], pairs=ids.shape[0] // 2)
    refs = [key for key in ("ref_chosen_logps", "ref_rejected_logps") if key in batch]
    return out | {key: batch[key].double() for key in refs}


def lit_model(
    weights: Weights, dpo: dict[str, Any], lora: bool = False, dtype: torch.dtype = torch.float64
) -> HFCausalLM:
    """``HFCausalLM`` with ``model.dpo: <dpo>`` on the policy's weights: the reference model from its
    directory (full fine-tuning), or the policy with its adapters disabled (LoRA); none with
    ``reference_free`` or ``precompute_ref_log_probs``."""
    reads_model = not (dpo.get("reference_free") or dpo.get("precompute_ref_log_probs"))
    ref_model = None
    if reads_model:
        ref_model = "disabled_adapters" if lora else weights.reference_dir
    return HFCausalLM(
        model=weights.model("policy", dtype),
        lora={**LORA, "lora_dropout": 0.0} if lora else None,
        dpo=dpo,
        ref_model=ref_model,
    )


def lit_step(model: HFCausalLM, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict, dict]:
    """``HFCausalLM.compute_loss`` on ``batch``: the loss, the gradient of every trainable parameter of
    the wrapped model (by its name there) and the metrics."""
    model.train()
    model.zero_grad()
    out = model.compute_loss(batch)
    out.total.backward()
    prefix = "model."
    grads = {
        name.removeprefix(prefix): p.grad.clone() for name, p in model.named_parameters() if p.requires_grad
    }
    metrics = {name: float(value) for name, value in out.metrics.items()}
    return out.total.detach(), grads, metrics


def same_lora_weights(trainer: DPOTrainer, model: HFCausalLM, seed: int = 2) -> None:
    """The same random LoRA ``A`` and ``B`` in TRL's policy and ours (``B`` starts at 0: the policy would
    be its reference)."""
    theirs = dict(trainer.model.named_parameters())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.model.named_parameters():
            if "lora_" in name:
                value = 0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64)
                p.copy_(value)
                theirs[name].copy_(value)
