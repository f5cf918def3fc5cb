"""TRL's own ``KTOTrainer``, ``CPOTrainer`` and ``ORPOTrainer`` on a tiny float64 Llama, their collated
batches in this package's preference layout, and the gradients of both sides by parameter.

The peer's code path is the reference: a trainer built offline on CPU (``ref_model`` a perturbed copy of
the policy, so that policy ≠ reference), one batch of its own dataloader, ``trainer.compute_loss`` and
its logged metrics. Our side gets the same token ids through `collate_records` (the collation of
`lit_losses.PreferenceDataModule`) and the same weights in an `HFCausalLM`.
"""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from datasets import Dataset, disable_progress_bars
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from lit_losses import HFCausalLM
from lit_losses.data.preference_batches import RecordRows, collate_records

TOKENIZER = Path(__file__).resolve().parents[2] / "data" / "tokenizers" / "chatml-bpe"
IGNORE = -100

UNPAIRED = [
    {"prompt": "Hello there", "completion": " good answer", "label": True},
    {"prompt": "What is 2+2?", "completion": " 4", "label": True},
    {"prompt": "Name a colour", "completion": " a dog barks loudly at night", "label": False},
    {"prompt": "Hi", "completion": " go away", "label": False},
    {"prompt": "Say something kind", "completion": " you did well today", "label": True},
]
"""Unpaired records (KTO): desirable and undesirable, completions of different lengths."""

PAIRED = [
    {"prompt": "Hello there", "chosen": " good answer", "rejected": " bad"},
    {"prompt": "What is 2+2?", "chosen": " 4", "rejected": " five or so, I guess"},
    {"prompt": "Name a colour", "chosen": " blue", "rejected": " a dog barks"},
]
"""Paired records (CPO, ORPO): completions of different lengths."""


def tokenizer() -> Any:
    """The shipped ChatML BPE tokenizer (no chat template needed: the records are plain text)."""
    return AutoTokenizer.from_pretrained(str(TOKENIZER))


def tiny_llama(
    vocab_size: int, pad_token_id: int | None = None, seed: int = 0, **fields: Any
) -> LlamaForCausalLM:
    """A float64 two-layer Llama with random weights (no dropout); ``fields``: more `LlamaConfig` fields."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=pad_token_id,
        **fields,
    )
    return LlamaForCausalLM(config).double()


def perturbed(model: LlamaForCausalLM, seed: int, scale: float) -> LlamaForCausalLM:
    """A copy of ``model`` with every weight moved by ``scale`` times a seeded normal draw."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return other


def trl_trainer(
    trainer_cls: type,
    config_cls: type,
    *,
    records: list[dict],
    model: LlamaForCausalLM,
    out_dir: Path,
    ref_model: LlamaForCausalLM | None = None,
    peft_config: Any = None,
    **fields: Any,
) -> Any:
    """A TRL trainer on CPU over ``records`` (one batch of all of them), with the config ``fields``
    (``ref_model`` for the trainers with a reference; ``peft_config`` a ``peft.LoraConfig``)."""
    disable_progress_bars()
    args = config_cls(
        output_dir=str(out_dir),
        per_device_train_batch_size=len(records),
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        bf16=False,
        gradient_checkpointing=False,
        remove_unused_columns=False,
        **fields,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer_cls(
            model=model,
            args=args,
            train_dataset=Dataset.from_list(records),
            processing_class=tokenizer(),
            **({} if ref_model is None else {"ref_model": ref_model}),
            **({} if peft_config is None else {"peft_config": peft_config}),
        )


def first_batch(trainer) -> dict[str, Any]:
    """The first batch of the trainer's own training dataloader (collated by its own collator)."""
    return next(iter(trainer.get_train_dataloader()))


def trl_loss(trainer, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor], dict[str, float]]:
    """TRL's ``compute_loss`` on ``batch`` in train mode: the loss, each parameter's gradient (by name of
    the Hugging Face model) and the metrics it logged (its last value of each)."""
    model = trainer.model
    model.train()
    model.zero_grad(set_to_none=True)
    metrics = getattr(trainer, "_metrics", None) or trainer._stored_metrics
    metrics["train"].clear()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    logged = {name: float(values[-1]) for name, values in metrics["train"].items()}
    return loss.detach(), grads, logged


def our_loss(
    module: HFCausalLM, batch: dict[str, Tensor]
) -> tuple[Tensor, dict[str, Tensor], dict[str, float]]:
    """Our ``compute_loss`` on ``batch``: the loss, each trainable parameter's gradient (by name of the
    wrapped Hugging Face model) and the telemetry ``metrics``."""
    module.train()
    module.zero_grad(set_to_none=True)
    out = module.compute_loss(batch)
    out.total.backward()
    grads = {
        name: p.grad.detach().clone() for name, p in module.model.named_parameters() if p.grad is not None
    }
    return out.total.detach(), grads, {name: float(v) for name, v in out.metrics.items()}


def assert_same_grads(ours: dict[str, Tensor], theirs: dict[str, Tensor], rtol: float, atol: float) -> None:
    """Every trainable parameter has a gradient on both sides, and the same one."""
    assert sorted(ours) == sorted(theirs) and ours, (sorted(ours), sorted(theirs))
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def next_token_row(ids: list[int], targets: list[bool]) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` with next-token labels: position ``t`` targets ``ids[t + 1]`` where that
    token is trained (``targets[t + 1]``), else ``-100``."""
    labels = [ids[t + 1] if targets[t + 1] else IGNORE for t in range(len(ids) - 1)] + [IGNORE]
    return ids, labels


def unpadded(ids: Tensor, keep: Tensor) -> list[list[int]]:
    """The rows of ``ids`` where ``keep`` (right padding removed)."""
    return [row[mask.bool()].tolist() for row, mask in zip(ids, keep, strict=True)]


def unpaired_batch(trl: dict[str, Any], ref: bool = False) -> dict[str, Tensor]:
    """Our unpaired micro-batch of KTOTrainer's collated batch: each row its sequence with next-token
    labels on its completion tokens (TRL's ``completion_mask``), its KL row likewise from TRL's ``KL_*``
    keys, ``kto_label`` from ``label``; ``ref``: TRL's ``ref_logps``/``ref_KL_logps`` too."""
    with_kl = "KL_input_ids" in trl
    prefixes = ("", "KL_") if with_kl else ("", "")
    rows = [
        [
            next_token_row(ids, [bool(m) for m in mask])
            for ids, mask in zip(
                unpadded(trl[f"{p}input_ids"], trl[f"{p}attention_mask"]),
                unpadded(trl[f"{p}completion_mask"], trl[f"{p}attention_mask"]),
                strict=True,
            )
        ]
        for p in prefixes
    ]
    items = []
    for i, label in enumerate(trl["label"].tolist()):
        values = {name: float(trl[name][i]) for name in ("ref_logps", "ref_KL_logps") if ref and name in trl}
        items.append(RecordRows(f"trl:{i}", rows[0][i], rows[1][i], ref=values, label=bool(label)))
    batch = collate_records(items, pad_id=1)
    if not with_kl:  # apo_zero_unpaired: TRL builds no KL rows, and the loss reads none
        batch = {key: value for key, value in batch.items() if not key.startswith("kl_")}
    return batch


def paired_batch(trl: dict[str, Any]) -> dict[str, Tensor]:
    """Our paired micro-batch of CPO/ORPO's collated batch: each chosen and rejected sequence with
    next-token labels where TRL's (input-aligned) ``*_labels`` train a token."""
    items = []
    sides = {}
    for side in ("chosen", "rejected"):
        mask = trl[f"{side}_attention_mask"]
        sides[side] = zip(
            unpadded(trl[f"{side}_input_ids"], mask), unpadded(trl[f"{side}_labels"], mask), strict=True
        )
    for i, ((c_ids, c_labels), (r_ids, r_labels)) in enumerate(
        zip(sides["chosen"], sides["rejected"], strict=True)
    ):
        chosen = next_token_row(c_ids, [label != IGNORE for label in c_labels])
        rejected = next_token_row(r_ids, [label != IGNORE for label in r_labels])
        items.append(RecordRows(f"trl:{i}", chosen, rejected, ref={}))
    return collate_records(items, pad_id=1)


def our_module(model: LlamaForCausalLM, **options: Any) -> HFCausalLM:
    """An `HFCausalLM` around a copy of ``model`` with the options of a TRL user (``kto={...}``, ...)."""
    return HFCausalLM(model=copy.deepcopy(model), **options)
