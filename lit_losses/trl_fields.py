"""Fields of TRL's trainer configs (``DPOConfig``, ``KTOConfig``, ``CPOConfig``, ``ORPOConfig``,
``SFTConfig``, ``GKDConfig``, ``GRPOConfig``, and the ``TrainingArguments`` they extend) that are other
options here, or have none: the hint that an unknown option of that name gets (`trl_hint`).

The loss fields of a TRL trainer keep their TRL names under ``model.dpo``, ``model.kto``, ``model.cpo``,
``model.orpo``, ``model.grpo`` and ``model.distillation``; the fields below belong to the data, the
optimizer or the trainer instead.
"""

from __future__ import annotations

TRL_FIELDS = {
    "max_length": "is data.init_args.max_length here for preference data (PreferenceDataModule), "
    "data.init_args.seq_len for text data (TextDataModule and its subclasses)",
    "max_seq_length": "is data.init_args.seq_len here",
    "max_prompt_length": "has no counterpart: data.init_args.max_length bounds prompt + completion, "
    "data.init_args.truncation_mode says which end is cut",
    "max_completion_length": "has no counterpart: data.init_args.max_length bounds prompt + completion, "
    "data.init_args.truncation_mode says which end is cut",
    "padding_free": "is data.init_args.packing here (TextDataModule and its subclasses)",
    "dataset_text_field": "has no counterpart: TextDataModule reads the records' 'text' field",
    "rpo_alpha": "is model.dpo.loss_type: [sigmoid, sft] with model.dpo.loss_weights: [1.0, <rpo_alpha>] "
    "here",
    "truncation_mode": "is data.init_args.truncation_mode here (PreferenceDataModule)",
    "pad_to_multiple_of": "has no counterpart: a micro-batch is right-padded to its longest row",
    "use_logits_to_keep": "has no counterpart: the fused head computes no logits",
    "lmbda": "has no counterpart: nothing is generated during training; give a teacher model "
    "(model.distillation.teacher) or its top-k log-probabilities (lit_losses.data.DistillationDataModule)",
    "seq_kd": "has no counterpart: nothing is generated during training; write the teacher's generations "
    "as records",
    "max_new_tokens": "has no counterpart: nothing is generated during training",
    "num_generations": "has no counterpart: the records carry the sampled completions and their advantages",
    "teacher_model_name_or_path": "is model.distillation.teacher here",
    "disable_dropout": "is model.init_args.disable_dropout here (HFCausalLM; false by default, TRL's: true)",
    "precompute_ref_batch_size": "has no counterpart: with precompute_ref_log_probs the records carry the "
    "reference log-probabilities, computed beforehand",
    "sync_ref_model": "has no counterpart: the reference model stays frozen (no TR-DPO synchronization)",
    "ref_model_mixup_alpha": "has no counterpart: the reference model stays frozen (no TR-DPO "
    "synchronization)",
    "ref_model_sync_steps": "has no counterpart: the reference model stays frozen (no TR-DPO "
    "synchronization)",
    "top_entropy_quantile": "has no counterpart: the loss keeps every completion token (a quantile of the "
    "whole batch's entropies is not known before its last micro-batch)",
    "use_adaptive_entropy": "has no counterpart: model.grpo.entropy_coef is a fixed weight; a controller "
    "rule can change the entropy term's weight from its logged value",
    "mask_truncated_completions": "has no counterpart: leave the truncated completions out of the records "
    "(or give them advantage 0)",
    "temperature": "has no counterpart: the policy's log-probabilities are at temperature 1 here (TRL "
    "divides the logits by it); give sampling_logprobs and old_logprobs at temperature 1",
    "learning_rate": "is model.init_args.optimizer.lr here",
    "weight_decay": "is model.init_args.optimizer.weight_decay here",
    "warmup_steps": "is model.init_args.optimizer.warmup_steps here (with warmup_start_ratio: 0.0, the "
    "warmup starts at learning rate 0 as in transformers)",
    "adam_beta1": "is the first of model.init_args.optimizer.betas here",
    "adam_beta2": "is the second of model.init_args.optimizer.betas here (default 0.95, transformers': "
    "0.999)",
    "adam_epsilon": "is model.init_args.optimizer.eps here",
    "lr_scheduler_kwargs": "has one counterpart: cosine_with_min_lr's min_lr_rate is "
    "model.init_args.optimizer.min_lr_ratio here",
    "warmup_ratio": "is model.init_args.optimizer.warmup_ratio here",
    "lr_scheduler_type": "is model.init_args.optimizer.schedule here",
    "per_device_train_batch_size": "is data.init_args.tokens_per_batch here (a token budget per micro-batch)",
    "gradient_accumulation_steps": "is trainer.accumulate_grad_batches here",
    "num_train_epochs": "is trainer.max_epochs here",
    "max_grad_norm": "is trainer.gradient_clip_val here",
    "logging_steps": "is trainer.log_every_n_steps here",
    "eval_steps": "is trainer.val_check_interval here",
    "output_dir": "is trainer.default_root_dir here",
    "bf16": "is trainer.precision=bf16-mixed here",
    "fp16": "is trainer.precision=16-mixed here",
    "seed": "is seed_everything here",
}
"""Fields of TRL's trainer configs that are other options here, by name: where to set each (or why
there is none)."""


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
