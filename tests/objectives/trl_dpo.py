"""TRL's own ``DPOTrainer`` (1.16) and ``HFCausalLM`` with ``model.dpo`` on the same weights and token ids.

`trl_trainer` builds TRL's trainer on `RECORDS` (`peer_trainers`: offline, on CPU, one micro-batch of
all the pairs from TRL's own tokenization and ``DataCollatorForPreference``: the chosen rows, then the
rejected rows, right-padded, with ``completion_mask``); `trl_step` runs its ``compute_loss`` and returns
the loss, every trainable parameter's gradient and the metrics it logged. `lit_batch` writes that
micro-batch through `collate_records` (the collation of `lit_losses.PreferenceDataModule`), and
`lit_step` runs ``HFCausalLM.compute_loss`` on it with the ``model.dpo`` fields a TRL user would write.
Both models are the same tiny Llama, float64 unless told (TRL's fused head accumulates its softmax
statistics in float32, so its values are float32-exact).
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from transformers import LlamaForCausalLM
from trl import DPOConfig, DPOTrainer

from lit_losses import HFCausalLM
from lit_losses.data.preference_batches import RecordRows, collate_records
from tests.objectives import peer_trainers as peers

RECORDS = [  # completions of different lengths, so that length-normalized and LD-DPO values differ
    {"prompt": "What is 2 plus 3?", "chosen": " It is 5.", "rejected": " 6"},
    {"prompt": "Name a colour.", "chosen": " Red", "rejected": " I do not know any colours, sorry."},
    {"prompt": "Say hi", "chosen": " Hello there, friend!", "rejected": " Bye."},
    {"prompt": "Count to three.", "chosen": " One, two, three.", "rejected": " One, three, two, four."},
]
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"], "lora_dropout": 0.0}
REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


class Weights:
    """The policy's and the reference's weights (3 of the 4 pairs get a positive reward margin), built
    once; `model` gives a fresh Llama holding either, and the reference is saved as a Hugging Face
    directory (``model.ref_model``)."""

    def __init__(self) -> None:
        self.tokenizer = peers.tokenizer()
        policy = peers.tiny_llama(len(self.tokenizer), self.tokenizer.pad_token_id)
        reference = peers.perturbed(policy, seed=2, scale=0.1)
        self.config = policy.config
        self.policy, self.reference = policy.state_dict(), reference.state_dict()
        self._dir = tempfile.TemporaryDirectory(prefix="trl_dpo_ref_")
        self.reference_dir = self._dir.name
        reference.save_pretrained(self.reference_dir)

    def model(self, which: str = "policy", dtype: torch.dtype = torch.float64) -> LlamaForCausalLM:
        model = LlamaForCausalLM(self.config).to(dtype)
        model.load_state_dict(self.policy if which == "policy" else self.reference)
        return model.train()


def trl_trainer(
    weights: Weights, lora: bool = False, dtype: torch.dtype = torch.float64, **fields: Any
) -> DPOTrainer:
    """TRL's ``DPOTrainer`` on `RECORDS` with ``DPOConfig(**fields)``: full fine-tuning against the
    perturbed reference, or LoRA against the policy with its adapters disabled (TRL's reference for a
    PEFT model)."""
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(**LORA)
    return peers.trl_trainer(
        DPOTrainer,
        DPOConfig,
        records=RECORDS,
        model=weights.model("policy", dtype),
        out_dir=tempfile.mkdtemp(prefix="trl_dpo_"),
        ref_model=None if lora else weights.model("reference", dtype),
        peft_config=peft_config,
        **fields,
    )


trl_batch = peers.first_batch
trl_step = peers.trl_loss
lit_step = peers.our_loss


def lit_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """TRL's micro-batch through `collate_records`: each pair's chosen and rejected sequence with
    next-token labels on its completion tokens (TRL's ``completion_mask``), and its precomputed reference
    values when TRL's batch has them."""
    keep = batch["attention_mask"]
    rows = [
        peers.next_token_row(ids, [bool(m) for m in mask])
        for ids, mask in zip(
            peers.unpadded(batch["input_ids"], keep),
            peers.unpadded(batch["completion_mask"], keep),
            strict=True,
        )
    ]
    pairs = len(rows) // 2
    items = [
        RecordRows(
            f"trl:{i}",
            rows[i],
            rows[pairs + i],
            ref={key: float(batch[key][i]) for key in REF_KEYS if key in batch},
        )
        for i in range(pairs)
    ]
    return collate_records(items, pad_id=0)  # right padding: never attended to


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
        model=weights.model("policy", dtype), lora=LORA if lora else None, dpo=dpo, ref_model=ref_model
    )


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
