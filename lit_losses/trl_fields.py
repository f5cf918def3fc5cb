"""Fields of TRL's trainer configs (``DPOConfig``, ``KTOConfig``, ``CPOConfig``, ``ORPOConfig``,
``SFTConfig``, ``GKDConfig``, ``DistillationConfig``, ``GRPOConfig``, the ``TrainingArguments`` they extend,
and the ``ModelConfig`` and ``ScriptArguments`` of TRL's scripts) that are other options here, or have
none: where each goes (`TRL_OPTIONS`), and the hint that an unknown option of that name gets (`trl_hint`).

The loss fields of a TRL trainer keep their TRL names under ``model.dpo``, ``model.kto``, ``model.cpo``,
``model.orpo``, ``model.grpo`` and ``model.distillation``; the fields below belong to the data, the
optimizer, the model or the trainer instead. ``lit-losses from-trl`` writes a TRL config's values at these
options. The values of the trainers' ``loss_type`` fields are the ``Literal`` types here (`DPOLossType`,
`KTOLossType`, `CPOConfigLossType`, `TRLLossType`), which the losses' options and ``from-trl`` share
without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DPOLossType = Literal[
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
]
"""TRL's ``DPOConfig.loss_type`` values."""

KTOLossType = Literal["kto", "apo_zero_unpaired"]
"""TRL's ``KTOConfig.loss_type`` values."""

CPOConfigLossType = Literal["sigmoid", "hinge", "ipo", "simpo", "alphapo"]
"""TRL's ``CPOConfig.loss_type`` (``alphapo``: ``simpo`` with ``cpo_alpha = 0``)."""

TRLLossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
"""TRL's ``GRPOConfig.loss_type`` (also Liger-Kernel's ``LigerFusedLinearGRPOLoss``)."""

NO_GENERATION = "has no counterpart: nothing is generated during training"
"""The hint of TRL's generation fields."""
FROZEN_REFERENCE = "has no counterpart: the reference model stays frozen (no TR-DPO synchronization)"
"""The hint of TRL's reference-synchronization fields."""
TRUNCATION = (
    "has no counterpart: data.init_args.max_length bounds prompt + completion, "
    "data.init_args.truncation_mode says which end is cut"
)
"""The hint of the prompt and completion bounds that TRL's ``DPOConfig`` dropped."""


@dataclass(frozen=True)
class TRLField:
    """Where a field of a TRL config goes here.

    Attributes:
        option: the option that takes the field's value as it is, by its path in a ``lit-losses fit``
            config (``trainer.accumulate_grad_batches``); ``None``: none does (the value changes form, or
            has no counterpart).
        hint: what the field is here, when more than ``is <option> here`` says it (``has no counterpart:
            …``, ``is the first of …``).

    Example:
        >>> TRLField("trainer.gradient_clip_val").text
        'is trainer.gradient_clip_val here'
        >>> TRLField(hint="has no counterpart: the fused head computes no logits").text
        'has no counterpart: the fused head computes no logits'
    """

    option: str | None = None
    hint: str = ""

    @property
    def text(self) -> str:
        """The hint's text: ``hint``, else ``is <option> here``."""
        return self.hint or f"is {self.option} here"


LORA = "is model.init_args.lora here: peft.LoraConfig's arguments"

TRL_OPTIONS: dict[str, TRLField] = {
    # the data
    "max_length": TRLField(
        hint="is data.init_args.max_length here for preference data (PreferenceDataModule), "
        "data.init_args.seq_len for text data (TextDataModule and its subclasses)"
    ),
    "max_seq_length": TRLField("data.init_args.seq_len"),
    "eos_token": TRLField(
        hint="has no counterpart: the tokenizer's own eos_token ends each completion "
        "(data.init_args.append_eos); save the tokenizer with yours to end them with another"
    ),
    "max_prompt_length": TRLField(hint=TRUNCATION),
    "max_completion_length": TRLField(hint=TRUNCATION),
    "padding_free": TRLField(
        "data.init_args.packing", "is data.init_args.packing here (TextDataModule and its subclasses)"
    ),
    "packing": TRLField("data.init_args.packing"),
    "dataset_text_field": TRLField("data.init_args.text_field"),
    "completion_only_loss": TRLField("data.init_args.completion_only_loss"),
    "assistant_only_loss": TRLField("data.init_args.assistant_only_loss"),
    "truncation_mode": TRLField(
        "data.init_args.truncation_mode", "is data.init_args.truncation_mode here (PreferenceDataModule)"
    ),
    "per_device_train_batch_size": TRLField(
        hint="is data.init_args.tokens_per_batch here (a token budget per micro-batch)"
    ),
    "dataset_name": TRLField(
        hint="is data.init_args.paths here: local JSONL files (write a Hub data set out with "
        "datasets.load_dataset(...).to_json(...))"
    ),
    "pad_to_multiple_of": TRLField(
        hint="has no counterpart: a micro-batch is right-padded to its longest row"
    ),
    "use_logits_to_keep": TRLField(hint="has no counterpart: the fused head computes no logits"),
    # the losses
    "rpo_alpha": TRLField(
        hint="is model.dpo.loss_type: [sigmoid, sft] with model.dpo.loss_weights: [1.0, <rpo_alpha>] here"
    ),
    "lmbda": TRLField(
        hint="has no counterpart: nothing is generated during training; give a teacher model "
        "(model.distillation.teacher) or its top-k log-probabilities (lit_losses.data.DistillationDataModule)"
    ),
    "seq_kd": TRLField(
        hint="has no counterpart: nothing is generated during training; write the teacher's generations "
        "as records"
    ),
    "max_new_tokens": TRLField(hint=NO_GENERATION),
    "num_generations": TRLField(
        hint="has no counterpart: the records carry the sampled completions and their advantages"
    ),
    "teacher_model_name_or_path": TRLField("model.init_args.distillation.teacher"),
    "precompute_ref_batch_size": TRLField(
        hint="has no counterpart: with precompute_ref_log_probs the records carry the reference "
        "log-probabilities, computed beforehand"
    ),
    "sync_ref_model": TRLField(hint=FROZEN_REFERENCE),
    "ref_model_mixup_alpha": TRLField(hint=FROZEN_REFERENCE),
    "ref_model_sync_steps": TRLField(hint=FROZEN_REFERENCE),
    "top_entropy_quantile": TRLField(
        hint="has no counterpart: the loss keeps every completion token (a quantile of the whole batch's "
        "entropies is not known before its last micro-batch)"
    ),
    "use_adaptive_entropy": TRLField(
        hint="has no counterpart: model.grpo.entropy_coef is a fixed weight; a controller rule can change "
        "the entropy term's weight from its logged value"
    ),
    "mask_truncated_completions": TRLField(
        hint="has no counterpart: leave the truncated completions out of the records (or give them "
        "advantage 0)"
    ),
    "temperature": TRLField(
        hint="has no counterpart: the policy's log-probabilities are at temperature 1 here (TRL divides the "
        "logits by it); give sampling_logprobs and old_logprobs at temperature 1"
    ),
    # the model
    "model_name_or_path": TRLField("model.init_args.model_name_or_path"),
    "dtype": TRLField("model.init_args.dtype"),
    "torch_dtype": TRLField("model.init_args.dtype"),
    "attn_implementation": TRLField("model.init_args.attn_implementation"),
    "gradient_checkpointing": TRLField(
        "model.init_args.gradient_checkpointing",
        "is model.init_args.gradient_checkpointing here (false by default, TRL's: true)",
    ),
    "disable_dropout": TRLField(
        "model.init_args.disable_dropout",
        "is model.init_args.disable_dropout here (HFCausalLM; false by default, TRL's: true)",
    ),
    "use_liger_kernel": TRLField(
        "model.init_args.use_liger_kernel",
        "is model.init_args.use_liger_kernel here (HFCausalLM: Liger-Kernel's decoder kernels; the fused "
        "head computes the loss)",
    ),
    "liger_kernel_config": TRLField("model.init_args.liger_kernel_config"),
    "use_peft": TRLField(hint=LORA),
    "lora_r": TRLField(hint=LORA + " (r)"),
    "lora_alpha": TRLField(hint=LORA + " (lora_alpha)"),
    "lora_dropout": TRLField(hint=LORA + " (lora_dropout)"),
    "lora_target_modules": TRLField(hint=LORA + " (target_modules)"),
    "lora_target_parameters": TRLField(hint=LORA + " (target_parameters)"),
    "lora_modules_to_save": TRLField(hint=LORA + " (modules_to_save)"),
    "use_rslora": TRLField(hint=LORA + " (use_rslora)"),
    "use_dora": TRLField(hint=LORA + " (use_dora)"),
    # the optimizer
    "learning_rate": TRLField("model.init_args.optimizer.lr"),
    "weight_decay": TRLField("model.init_args.optimizer.weight_decay"),
    "adam_beta1": TRLField(hint="is the first of model.init_args.optimizer.betas here"),
    "adam_beta2": TRLField(
        hint="is the second of model.init_args.optimizer.betas here (default 0.95, transformers': 0.999)"
    ),
    "adam_epsilon": TRLField("model.init_args.optimizer.eps"),
    "warmup_steps": TRLField(
        "model.init_args.optimizer.warmup_steps",
        "is model.init_args.optimizer.warmup_steps here (with warmup_start_ratio: 0.0, the warmup starts at "
        "learning rate 0 as in transformers)",
    ),
    "warmup_ratio": TRLField("model.init_args.optimizer.warmup_ratio"),
    "lr_scheduler_type": TRLField(hint="is model.init_args.optimizer.schedule here"),
    "lr_scheduler_kwargs": TRLField(
        hint="has one counterpart: cosine_with_min_lr's min_lr_rate is "
        "model.init_args.optimizer.min_lr_ratio here"
    ),
    "optim": TRLField(
        hint="has one counterpart: AdamW (adamw_torch, adamw_torch_fused) is the optimizer here"
    ),
    # the trainer
    "gradient_accumulation_steps": TRLField("trainer.accumulate_grad_batches"),
    "num_train_epochs": TRLField("trainer.max_epochs"),
    "max_steps": TRLField("trainer.max_steps"),
    "max_grad_norm": TRLField("trainer.gradient_clip_val"),
    "logging_steps": TRLField("trainer.log_every_n_steps"),
    "eval_steps": TRLField(hint="is trainer.val_check_interval here (it counts micro-batches)"),
    "eval_strategy": TRLField(
        hint="is when validation runs here: trainer.val_check_interval (steps) or "
        "trainer.check_val_every_n_epoch (epoch), on a held-out share of the data "
        "(data.init_args.val_fraction)"
    ),
    "save_steps": TRLField(
        hint="is trainer.callbacks here: lightning.pytorch.callbacks.ModelCheckpoint with every_n_train_steps"
    ),
    "output_dir": TRLField("trainer.default_root_dir"),
    "report_to": TRLField(hint="is trainer.logger here: any Lightning logger"),
    "resume_from_checkpoint": TRLField(hint="is lit-losses fit's --ckpt_path here"),
    "bf16": TRLField(hint="is trainer.precision=bf16-mixed here"),
    "fp16": TRLField(hint="is trainer.precision=16-mixed here"),
    "seed": TRLField("seed_everything"),
    "num_processes": TRLField(hint="is trainer.devices (and trainer.num_nodes) here"),
    "num_machines": TRLField("trainer.num_nodes"),
    "accelerate_config": TRLField(
        hint="is trainer.strategy here (ddp, fsdp, lit_losses' ModelParallelStrategy)"
    ),
    "env": TRLField(hint="has no counterpart: set the environment variables before lit-losses fit"),
}
"""Fields of TRL's configs that are other options here, by name: the option that takes the value, or why
there is none."""

TRL_FIELDS = {name: field.text for name, field in TRL_OPTIONS.items()}
"""The hint of each field of `TRL_OPTIONS` (its `TRLField.text`), by name."""


def trl_hint(name: str) -> str:
    """``"; TRL's <name> …"`` for a field of a TRL trainer config that is another option here (empty for
    any other name).

    Example:
        >>> trl_hint("gradient_accumulation_steps")
        "; TRL's gradient_accumulation_steps is trainer.accumulate_grad_batches here"
        >>> trl_hint("beta")
        ''
    """
    return f"; TRL's {name} {TRL_FIELDS[name]}" if name in TRL_FIELDS else ""
