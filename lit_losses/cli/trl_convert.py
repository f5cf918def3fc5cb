"""`convert`: a checked TRL config (`lit_losses.cli.trl_config.TRLConfig`) as a ``lit-losses fit`` config
that trains as TRL's trainer would.

Every field that has a counterpart is written at its option (`lit_losses.trl_fields.TRL_OPTIONS`, or
under ``model.<trainer>`` for a loss field), its line commented with the TRL field. Where TRL's default
differs from this package's, TRL's is written out and marked so: transformers' AdamW (β₂ 0.999, no
weight decay), its linear decay to 0 without warmup, the trainer's learning rate, gradient clipping at
1.0, bf16, ``disable_dropout``, gradient checkpointing, the 1024-token ``max_length``, three epochs,
seed 42, TRL's logging interval. A field without counterpart (left at a value other than TRL's default)
becomes a note, with the hint of `lit_losses.trl_fields`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lit_losses.cli.config_tree import ConfigTree
from lit_losses.cli.trl_config import TRLConfig
from lit_losses.errors import ConfigError
from lit_losses.trl_fields import NO_GENERATION, TRL_OPTIONS

PRESETS: dict[str, tuple[str, ...]] = {
    "dpo": (
        "loss_type",
        "beta",
        "label_smoothing",
        "loss_weights",
        "precompute_ref_log_probs",
        "use_weighting",
        "ld_alpha",
        "discopop_tau",
        "f_divergence_type",
        "f_alpha_divergence_coef",
    ),
    "kto": ("loss_type", "beta", "desirable_weight", "undesirable_weight", "precompute_ref_log_probs"),
    "cpo": ("loss_type", "beta", "label_smoothing", "cpo_alpha", "simpo_gamma", "alpha"),
    "orpo": ("beta",),
    "grpo": (
        "loss_type",
        "epsilon",
        "epsilon_high",
        "delta",
        "beta",
        "use_bias_correction_kl",
        "importance_sampling_level",
        "sapo_temperature_pos",
        "sapo_temperature_neg",
        "vespo_k_pos",
        "vespo_lambda_pos",
        "vespo_k_neg",
        "vespo_lambda_neg",
        "entropy_coef",
    ),
}
"""The loss fields of each trainer's config that ``model.<trainer>`` takes under their names."""
VLLM_CORRECTION = (
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_cap",
    "off_policy_mask_threshold",
)
"""``GRPOConfig``'s rollout corrections, which TRL applies with ``use_vllm`` only; ``model.grpo`` takes them
under their names."""
DATA_MODULES = {
    "sft": "lit_losses.data.hf_text.HFTextDataModule",
    "gkd": "lit_losses.data.hf_text.HFTextDataModule",
    "distillation": "lit_losses.data.hf_text.HFTextDataModule",
    "dpo": "lit_losses.PreferenceDataModule",
    "kto": "lit_losses.PreferenceDataModule",
    "cpo": "lit_losses.PreferenceDataModule",
    "orpo": "lit_losses.PreferenceDataModule",
    "grpo": "lit_losses.data.RLDataModule",
}
"""The data module of each trainer's records."""
SCHEDULES = {
    "linear": "linear",
    "cosine": "cosine",
    "constant_with_warmup": "constant",
    "constant": "constant",
}
"""transformers' ``lr_scheduler_type`` values that are a schedule here (``cosine_with_min_lr`` too)."""
ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf")
"""transformers' ``optim`` values that are ``torch.optim.AdamW``, the optimizer here."""
LORA_FIELDS = {
    "lora_r": "r",
    "lora_alpha": "lora_alpha",
    "lora_dropout": "lora_dropout",
    "lora_target_modules": "target_modules",
    "lora_target_parameters": "target_parameters",
    "lora_modules_to_save": "modules_to_save",
    "use_rslora": "use_rslora",
    "use_dora": "use_dora",
}
"""``ModelConfig``'s LoRA fields and the ``peft.LoraConfig`` argument each is (TRL's ``get_peft_config``)."""
LIGER_LOSS_PATCHES = ("cross_entropy", "fused_linear_cross_entropy")
"""The options of ``liger_kernel_config`` that patch the loss (`lit_losses.models.liger_decoder`'s
``LOSS_PATCHES``, written again here because ``from-trl`` runs without torch)."""
TEXT_SEQ_LEN = 1024
"""The rows' length when TRL's config bounds none (``DistillationConfig``, ``GRPOConfig``, ``max_length:
null``): TRL's ``max_length`` default."""


@dataclass
class Conversion:
    """The ``lit-losses fit`` config of a TRL config, and what did not carry over.

    Attributes:
        config: the options, each commented with its TRL field.
        notes: one line per field without counterpart, and per placeholder to replace.
        handled: the TRL fields taken into account.
    """

    trl: TRLConfig
    config: ConfigTree = field(default_factory=ConfigTree)
    notes: list[str] = field(default_factory=list)
    handled: set[str] = field(default_factory=set)

    def put(self, path: str, value: Any, *names: str) -> None:
        """Set option ``path`` from TRL fields ``names``; the comment names them, ``(TRL's default)`` when
        none was given."""
        given = [name for name in names if name in self.trl.given]
        comment = ", ".join(names)
        if names and not given:
            comment += " (TRL's default)"
        self.config.put(path, value, comment)
        self.handled.update(names)

    def note(self, message: str) -> None:
        """Add a line for the user."""
        self.notes.append(message)

    def unconverted(self, name: str, why: str = "") -> None:
        """Note field ``name`` as not carried over (when given at a value other than TRL's default)."""
        self.handled.add(name)
        if not self.trl.is_default(name):
            hint = why or (TRL_OPTIONS[name].text if name in TRL_OPTIONS else "has no counterpart here")
            self.note(f"{name}={self.trl.given[name]!r} not converted: TRL's {name} {hint}")


def convert(trl: TRLConfig) -> Conversion:
    """The ``lit-losses fit`` config of TRL config ``trl``: `seed_everything`, ``trainer``, ``model``
    (``HFCausalLM`` with the trainer's preset) and ``data`` (the trainer's data module).

    Example:
        >>> from lit_losses.cli.trl_schema import trainer_fields
        >>> defaults = {name: spec[1] for name, spec in trainer_fields("dpo").items()}
        >>> trl = TRLConfig("dpo", given={"beta": 0.05}, values={**defaults, "beta": 0.05}, source="dpo.yaml")
        >>> ours = convert(trl).config
        >>> ours.get("model.init_args.dpo.beta"), ours.get("model.init_args.optimizer.lr")
        (0.05, 1e-06)
        >>> ours.get("model.init_args.optimizer.betas"), ours.get("trainer.gradient_clip_val")
        ([0.9, 0.999], 1.0)
    """
    out = Conversion(trl)
    out.put("seed_everything", trl.values["seed"], "seed")
    trainer_options(out)
    model_options(out)
    loss_options(out)
    optimizer_options(out)
    data_options(out)
    for name in trl.given:
        if name not in out.handled:
            out.unconverted(name)
    return out


def mapping(trl: TRLConfig, name: str) -> dict[str, Any]:
    """The mapping that field ``name`` holds (TRL takes one as JSON text too); empty when ``None``.

    Raises:
        ConfigError: the text is not a JSON object.
    """
    value = trl.values.get(name) or {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as err:
            raise ConfigError(
                f"{trl.source}: {name}: expected a mapping (or its JSON text), got {value!r} ({err})"
            ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"{trl.source}: {name}: expected a mapping (or its JSON text), got {value!r}")
    return value


def trainer_options(out: Conversion) -> None:
    """``trainer``: steps or epochs, accumulation, precision, clipping, logging, output folder."""
    values = out.trl.values
    if values["max_steps"] > 0:
        out.put("trainer.max_steps", values["max_steps"], "max_steps")
        out.handled.add("num_train_epochs")
    else:
        epochs = values["num_train_epochs"]
        if epochs <= 0:
            raise ConfigError(
                f"{out.trl.source}: num_train_epochs={epochs} with max_steps={values['max_steps']} trains no "
                "step in TRL (and trainer.max_epochs=-1 trains without end here); give a positive "
                "num_train_epochs or max_steps"
            )
        out.put("trainer.max_epochs", math.ceil(epochs), "num_train_epochs")
        out.handled.add("max_steps")
        if epochs != math.ceil(epochs):
            out.note(
                f"num_train_epochs={epochs}: trainer.max_epochs counts whole epochs; the config trains "
                f"{math.ceil(epochs)} (give trainer.max_steps to stop within an epoch)"
            )
    if "gradient_accumulation_steps" in out.trl.given:
        out.put(
            "trainer.accumulate_grad_batches",
            values["gradient_accumulation_steps"],
            "gradient_accumulation_steps",
        )
    precision = (
        "16-mixed" if values["fp16"] else "bf16-mixed" if values["bf16"] in (True, None) else "32-true"
    )
    out.put("trainer.precision", precision, "bf16", "fp16")
    if values["max_grad_norm"]:
        out.put("trainer.gradient_clip_val", float(values["max_grad_norm"]), "max_grad_norm")
    else:
        out.handled.add("max_grad_norm")
    logging = values["logging_steps"]
    if logging >= 1:
        out.put("trainer.log_every_n_steps", int(logging), "logging_steps")
    else:
        out.unconverted("logging_steps", "is trainer.log_every_n_steps here, a number of steps (not a ratio)")
    if values["output_dir"] is not None:
        out.put("trainer.default_root_dir", values["output_dir"], "output_dir")


def model_options(out: Conversion) -> None:
    """``model``: ``HFCausalLM``, its weights, dtype, attention, checkpointing, dropout, the metrics TRL
    logs (``token_metrics``) and LoRA."""
    values, given = out.trl.values, out.trl.given
    out.config.put("model.class_path", "lit_losses.HFCausalLM")
    name = values["model_name_or_path"]
    if name is None:
        name = "my-model"
        out.note(
            "model_name_or_path is not given: the config names my-model (a local directory or cached Hub id)"
        )
    out.put("model.init_args.model_name_or_path", name, "model_name_or_path")
    init_kwargs = mapping(out.trl, "model_init_kwargs")
    dtype = given.get(
        "dtype", given.get("torch_dtype", init_kwargs.get("dtype", init_kwargs.get("torch_dtype")))
    )
    source = next((n for n in ("dtype", "torch_dtype", "model_init_kwargs") if n in given), "dtype")
    out.put("model.init_args.dtype", dtype or values["dtype"], source)
    attention = given.get("attn_implementation", init_kwargs.get("attn_implementation"))
    if attention is not None:
        out.put("model.init_args.attn_implementation", attention, "attn_implementation")
    others = sorted(set(init_kwargs) - {"dtype", "torch_dtype", "attn_implementation"})
    out.handled.add("model_init_kwargs")
    if others:
        kernels = ""
        if "use_kernels" in others:
            kernels = " (for use_kernels: model.init_args.use_liger_kernel applies Liger-Kernel's)"
        out.note(
            f"model_init_kwargs {others} not converted: HFCausalLM takes dtype and "
            f"attn_implementation{kernels}"
        )
    if values["gradient_checkpointing"]:
        out.put("model.init_args.gradient_checkpointing", True, "gradient_checkpointing")
    else:
        out.handled.add("gradient_checkpointing")
    if values.get("disable_dropout"):
        out.put("model.init_args.disable_dropout", True, "disable_dropout")
    else:
        out.handled.add("disable_dropout")
    out.config.put("model.init_args.token_metrics", True, "TRL's logged entropy, mean_token_accuracy, ...")
    liger_options(out)
    lora_options(out)


def liger_options(out: Conversion) -> None:
    """``model.init_args.use_liger_kernel`` and ``liger_kernel_config``, the latter without Liger's loss
    patches (the fused head computes the loss)."""
    out.handled.update(["use_liger_kernel", "liger_kernel_config"])
    if not out.trl.values["use_liger_kernel"]:
        if "liger_kernel_config" in out.trl.given:
            out.note("liger_kernel_config: not converted, as TRL ignores it without use_liger_kernel: true")
        return
    out.put("model.init_args.use_liger_kernel", True, "use_liger_kernel")
    config = mapping(out.trl, "liger_kernel_config")
    dropped = [name for name in LIGER_LOSS_PATCHES if name in config]
    if dropped:
        out.note(
            f"liger_kernel_config {dropped} not converted: the fused head computes the loss here "
            "(use_liger_kernel applies Liger-Kernel's decoder kernels only)"
        )
    kept = {name: value for name, value in config.items() if name not in LIGER_LOSS_PATCHES}
    if kept:
        out.put("model.init_args.liger_kernel_config", kept, "liger_kernel_config")


def lora_options(out: Conversion) -> None:
    """``model.init_args.lora`` from ``use_peft`` and ``ModelConfig``'s ``lora_*`` fields."""
    values = out.trl.values
    out.handled.update(["use_peft", "lora_task_type", *LORA_FIELDS])
    if not values["use_peft"]:
        ignored = [name for name in LORA_FIELDS if name in out.trl.given]
        if ignored:
            out.note(f"{', '.join(ignored)}: not converted, as TRL ignores them without use_peft: true")
        return
    out.config.comment("model.init_args.lora", "use_peft: peft.LoraConfig's arguments")
    for name, argument in LORA_FIELDS.items():
        if values[name] is not None and (values[name] is not False or name in out.trl.given):
            out.put(f"model.init_args.lora.{argument}", values[name], name)
    if values["lora_task_type"] != "CAUSAL_LM":
        out.note(f"lora_task_type={values['lora_task_type']!r} not converted: the adapters are CAUSAL_LM's")


def loss_options(out: Conversion) -> None:
    """``model.<trainer>``: the loss fields of the trainer's config, or ``model.distillation``."""
    trainer, values, given = out.trl.trainer, out.trl.values, out.trl.given
    if trainer in ("gkd", "distillation"):
        distillation_options(out)
        return
    if trainer == "sft":
        if values["loss_type"] != "nll":
            out.unconverted("loss_type", "has no counterpart but nll: the loss is the cross-entropy")
        out.handled.add("loss_type")
        return
    fields = PRESETS[trainer]
    where = f"model.init_args.{trainer}"
    out.config.comment(where, f"{out.trl.config_class}'s loss fields, under their names")
    for name in fields:
        if name in given or (name in ("loss_type", "beta") and name in values):
            value = values[name]
            if name == "loss_type" and isinstance(value, list) and len(value) == 1:
                value = value[0]
            out.put(f"{where}.{name}", value, name)
    if trainer == "grpo":
        grpo_options(out, where)


def grpo_options(out: Conversion, where: str) -> None:
    """``GRPOConfig``'s ``max_completion_length`` (``dr_grpo``'s constant) and rollout corrections."""
    values = out.trl.values
    if values["beta"]:
        out.note(
            f"beta={values['beta']}: the KL term reads each record's ref_logprobs, the reference model's "
            "log-probabilities of its tokens: write them beside logprobs (see the docs' Offline RL data)"
        )
    if values["loss_type"] == "dr_grpo":
        out.put(f"{where}.max_completion_length", values["max_completion_length"], "max_completion_length")
    out.handled.add("max_completion_length")
    if values["use_vllm"]:
        for name in VLLM_CORRECTION:
            if name in out.trl.given or name == "vllm_importance_sampling_correction":
                out.put(f"{where}.{name}", values[name], name)
        out.unconverted("use_vllm", "has no counterpart: your sampler (vLLM) writes the records' logprobs")
    else:
        out.handled.update(VLLM_CORRECTION)


def distillation_options(out: Conversion) -> None:
    """``model.distillation``: the teacher, the divergence that TRL's ``beta`` selects, the temperature."""
    values = out.trl.values
    where = "model.init_args.distillation"
    teacher = values["teacher_model_name_or_path"]
    if teacher is None:
        teacher = "my-teacher"
        out.note("teacher_model_name_or_path is not given: the config names my-teacher")
    out.put(f"{where}.teacher", teacher, "teacher_model_name_or_path")
    beta = values["beta"]
    loss = {0.0: "forward_kl", 1.0: "reverse_kl"}.get(float(beta), "jsd")
    out.put(f"{where}.loss", loss, "beta")
    if loss == "jsd":
        out.put(f"{where}.beta", beta, "beta")
    if out.trl.values.get("lmbda") == 0.0:
        out.handled.add("lmbda")  # no on-policy generation: distillation on the data's sequences, as here
    if out.trl.trainer == "distillation":
        out.put(f"{where}.temperature", values["temperature"], "temperature")
        out.unconverted("max_completion_length", NO_GENERATION)
    else:
        out.unconverted(
            "temperature", "has no counterpart: GKD samples at it; its loss is at temperature 1, as here"
        )


def optimizer_options(out: Conversion) -> None:
    """``model.init_args.optimizer``: transformers' AdamW and schedule."""
    values = out.trl.values
    where = "model.init_args.optimizer"
    out.config.comment(where, "transformers' AdamW and learning-rate schedule")
    out.put(f"{where}.lr", values["learning_rate"], "learning_rate")
    out.put(f"{where}.betas", [values["adam_beta1"], values["adam_beta2"]], "adam_beta1", "adam_beta2")
    out.put(f"{where}.eps", values["adam_epsilon"], "adam_epsilon")
    out.put(f"{where}.weight_decay", values["weight_decay"], "weight_decay")
    if values["optim"] not in ADAMW:
        out.unconverted("optim")
    out.handled.add("optim")
    schedule_options(out, where)


def schedule_options(out: Conversion, where: str) -> None:
    """``schedule``, ``min_lr_ratio`` and the warmup, from ``lr_scheduler_type`` and its arguments."""
    values = out.trl.values
    kind = values["lr_scheduler_type"]
    kwargs = mapping(out.trl, "lr_scheduler_kwargs")
    out.handled.update(["lr_scheduler_type", "lr_scheduler_kwargs"])
    floor = 0.0
    if kind == "cosine_with_min_lr" and "min_lr_rate" in kwargs:
        floor = float(kwargs["min_lr_rate"])
    elif kind == "cosine_with_min_lr" and "min_lr" in kwargs:
        floor = float(kwargs["min_lr"]) / values["learning_rate"]
    elif kind not in SCHEDULES:
        out.note(
            f"lr_scheduler_type={kind!r} not converted: the schedules here are linear, cosine, constant "
            "(and cosine_with_min_lr); the config keeps linear, TRL's default"
        )
    if kwargs and kind != "cosine_with_min_lr":
        out.note(f"lr_scheduler_kwargs={kwargs!r} not converted: {TRL_OPTIONS['lr_scheduler_kwargs'].text}")
    out.put(
        f"{where}.schedule",
        {"cosine_with_min_lr": "cosine"}.get(kind, SCHEDULES.get(kind, "linear")),
        "lr_scheduler_type",
    )
    out.put(f"{where}.min_lr_ratio", floor, "lr_scheduler_type")
    out.config.comment(
        f"{where}.min_lr_ratio",
        "lr_scheduler_kwargs (min_lr_rate)" if floor else "transformers' schedules decay to 0",
    )
    warmup_options(out, where, constant=kind == "constant")


def warmup_options(out: Conversion, where: str, constant: bool) -> None:
    """``warmup_steps`` (or transformers 4's ``warmup_ratio``), from learning rate 0 as in transformers."""
    values, given = out.trl.values, out.trl.given
    steps, ratio = values["warmup_steps"], given.get("warmup_ratio")
    out.handled.update(["warmup_steps", "warmup_ratio"])
    if constant and (steps or ratio):
        out.note("warmup_steps not converted: transformers' constant schedule has no warmup")
        steps, ratio = 0, None
    if ratio and not steps:
        out.put(f"{where}.warmup_ratio", ratio, "warmup_ratio")
    else:
        out.put(f"{where}.warmup_steps", int(steps) if float(steps).is_integer() else steps, "warmup_steps")
    if steps or ratio:
        out.config.put(f"{where}.warmup_start_ratio", 0.0, "transformers' warmup starts at learning rate 0")


def data_options(out: Conversion) -> None:
    """``data``: the trainer's data module, its files, tokenizer, lengths and token budget."""
    trainer = out.trl.trainer
    out.config.put("data.class_path", DATA_MODULES[trainer])
    where = "data.init_args"
    out.put(f"{where}.paths", [data_path(out)], "dataset_name")
    given = "dataset_name" in out.trl.given and out.trl.trainer != "grpo"
    out.config.comment(
        f"{where}.paths",
        "dataset_name, as JSONL" if given else "placeholder: your JSONL records",
    )
    out.handled.update(["dataset_name", "dataset_config", "dataset_train_split"])
    if trainer == "grpo":
        rollout_data(out, where)
    elif DATA_MODULES[trainer].endswith("PreferenceDataModule"):
        preference_data(out, where)
    else:
        text_data(out, where)


def data_path(out: Conversion) -> str:
    """The JSONL file the config reads (a placeholder), and a note that says how to write it."""
    values = out.trl.values
    name = values["dataset_name"]
    if out.trl.trainer == "grpo":
        out.note(
            "the records are sampled completions with their advantages (rollouts.jsonl): sample and score "
            f"the prompts of {name or 'your data set'} with your sampler, see the docs' GRPO section"
        )
        return "rollouts.jsonl"
    if name is None:
        out.note("dataset_name is not given: data.init_args.paths names train.jsonl, your records as JSONL")
        return "train.jsonl"
    if str(name).endswith((".jsonl", ".json")):  # a local file (TRL loads it with the json builder)
        if not Path(str(name)).is_file():
            out.note(f"dataset_name={name!r} is no file here yet: data.init_args.paths names it")
        return str(name)
    path = f"{Path(str(name)).name}.jsonl"
    config = f", {values['dataset_config']!r}" if values["dataset_config"] else ""
    split = values["dataset_train_split"]
    out.note(
        f"dataset_name={name!r} is a Hub data set; this package reads JSONL files: write it out with "
        f'python -c "import datasets; datasets.load_dataset({name!r}{config}, split={split!r})'
        f'.to_json({path!r})"'
    )
    return path


def batch_budget(out: Conversion, rows: int, length: int, where: str) -> None:
    """``tokens_per_batch`` = ``rows`` × ``per_device_train_batch_size`` × ``length``."""
    batch = out.trl.values["per_device_train_batch_size"]
    if batch < 1:
        raise ConfigError(f"{out.trl.source}: per_device_train_batch_size={batch} must be >= 1")
    out.put(f"{where}.tokens_per_batch", rows * batch * length, "per_device_train_batch_size")
    unit = {1: "rows", 2: "records × 2 rows"}[rows]
    out.config.comment(
        f"{where}.tokens_per_batch",
        f"per_device_train_batch_size: a token budget, {batch} {unit} × {length} tokens",
    )


def preference_data(out: Conversion, where: str) -> None:
    """``PreferenceDataModule``: tokenizer, ``max_length``, ``truncation_mode``, the budget of a micro-batch
    of pairs (or of KTO's records with their KL rows)."""
    values = out.trl.values
    out.put(f"{where}.tokenizer", out.config.get("model.init_args.model_name_or_path"), "model_name_or_path")
    length = values.get("max_length")
    out.put(f"{where}.max_length", length, "max_length")
    if "truncation_mode" in values:
        out.put(f"{where}.truncation_mode", values["truncation_mode"], "truncation_mode")
    batch_budget(out, rows=2, length=length or TEXT_SEQ_LEN, where=where)
    if length is None:
        out.note(
            f"max_length: null: the budget assumes rows of {TEXT_SEQ_LEN} tokens; raise it to your longest"
        )


def text_data(out: Conversion, where: str) -> None:
    """``HFTextDataModule``: tokenizer, ``seq_len``, packing, the loss's tokens, the budget."""
    values, given = out.trl.values, out.trl.given
    out.put(f"{where}.tokenizer", out.config.get("model.init_args.model_name_or_path"), "model_name_or_path")
    length = given.get("max_seq_length") or values.get("max_length")
    if length is None:
        length = TEXT_SEQ_LEN
        out.note(
            f"rows hold at most data.init_args.seq_len={TEXT_SEQ_LEN} tokens: raise it to your longest record"
        )
    out.put(f"{where}.seq_len", length, "max_seq_length" if "max_seq_length" in given else "max_length")
    out.handled.update(["max_length", "max_seq_length"])
    packing = bool(values.get("packing") or values.get("padding_free"))
    out.put(f"{where}.packing", packing, "packing", "padding_free")
    for name, option in (
        ("completion_only_loss", "completion_only_loss"),
        ("assistant_only_loss", "assistant_only_loss"),
    ):
        if name in given:
            out.put(f"{where}.{option}", values[name], name)
    if "dataset_text_field" in given:
        out.put(f"{where}.text_field", values["dataset_text_field"], "dataset_text_field")
    if values.get("truncation_mode", "keep_start") != "keep_start":
        out.unconverted(
            "truncation_mode", "has no counterpart: a record is truncated to its first seq_len tokens"
        )
    out.handled.add("truncation_mode")
    out.config.put(f"{where}.val_fraction", 0.0, "TRL trains on every record (an eval split is its own set)")
    batch_budget(out, rows=1, length=length, where=where)


def rollout_data(out: Conversion, where: str) -> None:
    """``RLDataModule``: the vocabulary (the model's), the rows' length, the budget."""
    model = str(out.config.get("model.init_args.model_name_or_path"))
    config = model_config(model)
    if isinstance(config.get("vocab_size"), int):
        out.config.put(
            f"{where}.vocab_size", config["vocab_size"], f"the vocabulary of {model}'s config.json"
        )
    else:
        out.note(f"give data.init_args.vocab_size: the size of {model}'s vocabulary (len(tokenizer))")
    length = rows_length(config)
    out.config.put(f"{where}.seq_len", length, "prompt + completion tokens: your records' longest")
    batch_budget(out, rows=1, length=length, where=where)


def rows_length(config: dict[str, Any]) -> int:
    """The rows' length when TRL's config bounds none: `TEXT_SEQ_LEN`, or less when the model's positions
    end before (``max_position_embeddings`` of its ``config.json``; a row holds ``seq_len + 1`` tokens)."""
    positions = config.get("max_position_embeddings")
    return min(TEXT_SEQ_LEN, positions - 1) if isinstance(positions, int) and positions > 1 else TEXT_SEQ_LEN


def model_config(model: str) -> dict[str, Any]:
    """The ``config.json`` of ``model`` (a directory, or a Hub id in the local cache); empty if none."""
    path = Path(model) / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return {}
        try:
            cached = try_to_load_from_cache(model, "config.json")
        except ValueError:  # not a Hub id
            return {}
        if not isinstance(cached, str):
            return {}
        path = Path(cached)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
