"""`HFCausalLM`: any Hugging Face ``transformers`` causal LM (Llama, Qwen2, Mistral, GPT-2, ...) as a
`RegularizedLM`, optionally with LoRA (``peft``). Needs the ``[hf]`` extra.

The base model gives the hidden states; the output projection is the model's
``get_output_embeddings()`` (tied or not, with or without bias), handed to the fused head: no ``[N, V]``
logits are computed in training. A model whose logits are not a plain linear function of those hidden
states (logit soft-capping, logit scaling) or whose output layer is not a plain ``nn.Linear`` (LoRA on
``lm_head``) is refused at construction, because the fused head would silently compute another loss.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from lit_losses.aggregation import GLOBAL_STATS_KEY, LABELS_KEY, GlobalStats, count_masks
from lit_losses.aggregation.stats import batch_segment_ids
from lit_losses.choices import check_choice
from lit_losses.errors import ConfigError
from lit_losses.loss.context import LossOutput, Stage
from lit_losses.models.frozen import DISABLED_ADAPTERS, CausalLMRunner
from lit_losses.models.hf_batch import (
    LabelFormat,
    body_inputs,
    check_label_format,
    packing_leak,
    packing_tolerance,
    shift_labels,
)
from lit_losses.models.hf_load import causal_lm_of, check_plain_head, import_transformers, refused_as
from lit_losses.models.liger_decoder import apply_liger_decoder, check_liger_device
from lit_losses.models.pretrained import local_pretrained
from lit_losses.module import RegularizedLM
from lit_losses.optim import check_trainable_dtypes
from lit_losses.parallel import ParallelConfig
from lit_losses.registry import closest

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DType = Literal["auto", "float32", "float64", "bfloat16", "float16"]


def build_causal_lm(
    model_name_or_path: str | None,
    config: dict[str, Any] | None,
    vocab_size: int | None,
    attn_implementation: str | None,
    dtype: DType | None,
) -> PreTrainedModel:
    """A ``transformers`` causal LM from a local checkpoint directory, a Hub id in the local Hugging Face
    cache (`lit_losses.models.pretrained.local_pretrained`) or a config dict (random weights); nothing is
    downloaded. Errors name the option (``model.init_args.<name>``)."""
    transformers = import_transformers("HFCausalLM")
    options: dict[str, Any] = {}
    if attn_implementation is not None:
        options["attn_implementation"] = attn_implementation
    if dtype is not None:
        options["dtype"] = dtype if dtype == "auto" else getattr(torch, dtype)
    if (model_name_or_path is None) == (config is None):
        raise ConfigError(
            "HFCausalLM: give exactly one of model.init_args.model_name_or_path (a local checkpoint "
            "directory or a cached Hub id) and model.init_args.config (a config dict with model_type), or a "
            f"built model (Python); got model_name_or_path={model_name_or_path!r}, config={config!r}"
        )
    if model_name_or_path is not None:
        where = "model.init_args.model_name_or_path"
        directory = local_pretrained(model_name_or_path, where, saved_with="save_pretrained")
        with refused_as(where, options):
            return transformers.AutoModelForCausalLM.from_pretrained(
                directory, local_files_only=True, **options
            )
    config = dict(config)
    model_type = config.pop("model_type", None)
    known = sorted(transformers.CONFIG_MAPPING.keys())
    if model_type not in known:
        raise ConfigError(
            f"model.init_args.config.model_type {model_type!r} is not a transformers model type"
            f"{closest(str(model_type), known)}"
        )
    if vocab_size is not None:
        if config.get("vocab_size", vocab_size) != vocab_size:
            raise ConfigError(
                f"model.init_args.config.vocab_size={config['vocab_size']} differs from "
                f"model.init_args.vocab_size={vocab_size} (linked to data.vocab_size)"
            )
        config["vocab_size"] = vocab_size
    if "dtype" in options and options["dtype"] == "auto":
        options.pop("dtype")
    with refused_as("model.init_args.config", options):
        hf_config = transformers.AutoConfig.for_model(model_type, **config)
        return transformers.AutoModelForCausalLM.from_config(hf_config, **options)


def add_lora(model: PreTrainedModel, lora: dict[str, Any]) -> nn.Module:
    """``peft.get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))``."""
    try:
        import peft
    except ImportError as err:  # pragma: no cover - depends on the optional extra
        raise ConfigError("model.init_args.lora needs peft: pip install 'lit_losses[hf]'") from err
    with refused_as("model.init_args.lora", {}):
        config = peft.LoraConfig(task_type="CAUSAL_LM", **lora)
        return peft.get_peft_model(model, config)


def check_liger_options(use_liger_kernel: Any, liger_kernel_config: Any) -> None:
    """Refuse a ``use_liger_kernel`` that is not a bool, and a ``liger_kernel_config`` without it (before the
    model is built)."""
    if not isinstance(use_liger_kernel, bool):
        raise ConfigError(f"model.init_args.use_liger_kernel={use_liger_kernel!r}: expected true or false")
    if liger_kernel_config is not None and not use_liger_kernel:
        raise ConfigError(
            f"model.init_args.liger_kernel_config={liger_kernel_config!r} is given but "
            "model.init_args.use_liger_kernel is false: set it to true, or remove liger_kernel_config"
        )


def zero_dropout(model: nn.Module) -> None:
    """Set the probability of every ``torch.nn.Dropout`` module of ``model`` to 0 (what TRL's
    ``disable_dropout`` does; attention kernels that read a dropout rate from the config are untouched).

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))
        >>> zero_dropout(net)
        >>> net[1].p
        0.0
    """
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def check_context_length(
    config: Any, seq_len: int, where: str = "model.init_args.config", option: str = "data.seq_len"
) -> None:
    """Refuse a model whose positions end before the data's rows do: ``max_position_embeddings`` (GPT-2's
    ``n_positions``, through the config's attribute map) smaller than ``seq_len``, the data module's
    ``option`` (``data.seq_len``; preference data: ``data.max_length``). Learned position embeddings fail
    with an index error at the first long row; rotary ones train silently on positions the model was never
    given.

    Raises:
        ConfigError: naming the config field, both lengths and the ways out.

    Example:
        >>> from types import SimpleNamespace
        >>> check_context_length(SimpleNamespace(max_position_embeddings=512), seq_len=256)
        >>> check_context_length(SimpleNamespace(max_position_embeddings=128), seq_len=256)
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.init_args.config.max_position_embeddings=128 is smaller than ...
    """
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and not isinstance(limit, bool) and limit < seq_len:
        raise ConfigError(
            f"{where}.max_position_embeddings={limit} is smaller than {option}={seq_len}: the model has "
            f"no position beyond {limit - 1}; lower {option} to at most {limit}, or use a model with a "
            "longer context"
        )


class HFCausalLM(RegularizedLM):
    """A Hugging Face causal LM trained through the fused head (`RegularizedLM`).

    Build it from a local checkpoint directory (``model_name_or_path``), from a config (``config:
    {model_type: llama, hidden_size: ..., ...}``, random weights, offline), or from Python with an already
    built ``model`` (a ``PreTrainedModel`` or a ``peft`` LoRA model). ``lora`` wraps it with
    ``peft.get_peft_model``: only the adapter parameters train, and the frozen output weight costs the
    head no gradient. ``forward_logits`` and ``generate`` (the wrapped model's) keep working.

    **Labels** (``label_format``): ``next_token`` (default; `TextDataModule`, `HFTextDataModule`):
    ``labels[t]`` is the target of position ``t``. ``input_aligned`` (Hugging Face collators): labels
    aligned with ``input_ids``, shifted here (`shift_labels`), as the model's own ``labels=`` loss does.
    A batch that evidently follows the other convention is a `ConfigError`.

    **Packed rows** (``segment_ids``, or ``position_ids`` restarting at 0 as from
    ``DataCollatorWithFlattening``) get a block-diagonal causal mask (`body_inputs`); the first packed batch
    checks on a probe that the model's attention implementation keeps documents apart, and stops with a
    `ConfigError` if not. The sequence-level aggregation modes count those documents as sequences.

    Args:
        model_name_or_path: local checkpoint directory (``save_pretrained``), or a Hub id (``org/name``)
            already in the local Hugging Face cache (``hf download org/name``); nothing is downloaded.
        config: a ``transformers`` config as a dict with ``model_type`` (random initial weights).
        model: an already built model (Python API; not saved in the hyper-parameters).
        vocab_size: vocabulary of the data (linked to ``data.vocab_size`` by the CLI): the config's
            vocabulary when building from ``config``, at most the model's otherwise.
        label_format: ``next_token`` or ``input_aligned`` (see above).
        attn_implementation: ``sdpa``, ``eager``, ``flash_attention_2``, ... (default: transformers').
        dtype: dtype to load or build the weights in (default: transformers' default, fp32; float64 for
            exactness checks, where runs on different layouts agree to rounding).
        lora: ``peft.LoraConfig`` arguments, e.g. ``{r: 8, lora_alpha: 16, target_modules: [q_proj]}``.
        gradient_checkpointing: recompute the body's activations in backward.
        disable_dropout: set the probability of every ``torch.nn.Dropout`` module to 0 (TRL's
            ``disable_dropout``, whose default is true; here the model's config decides by default).
        use_liger_kernel: patch the model with Liger-Kernel's decoder kernels (RoPE, RMSNorm, SwiGLU, ...;
            CUDA, the ``[liger]`` extra): Hugging Face's and TRL's option, except that the fused head keeps
            computing the loss and that only this model is patched (`apply_liger_decoder`; docs:
            ``tutorials/hugging-face.md``). On one H100 this made the step of a 1B Llama
            1.25× faster and 19 % leaner (``benchmarks/train_step.py``).
        liger_kernel_config: the options of Liger's ``apply_liger_kernel_to_<model>`` (Hugging Face's
            ``liger_kernel_config``), e.g. ``{swiglu: false}``; with ``use_liger_kernel`` only.
        parallel: how ``configure_model`` shards the model under ``ModelParallelStrategy``
            (`ParallelConfig`; by default FSDP2 units are the decoder layers, `fsdp_modules`).
        **kwargs: the `RegularizedLM` options (head, loss aggregation, optimizer, regularizers).

    Example:
        >>> import torch
        >>> model = HFCausalLM(config={"model_type": "llama", "vocab_size": 64, "hidden_size": 16,
        ...     "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2})
        >>> batch = {"input_ids": torch.randint(0, 64, (2, 8))}
        >>> batch["labels"] = torch.cat([batch["input_ids"][:, 1:], torch.full((2, 1), -100)], 1)
        >>> loss = model.compute_loss(batch).total
        >>> ref = model.model(batch["input_ids"], labels=batch["input_ids"]).loss  # the model's own loss
        >>> bool(torch.isclose(loss, ref)), model.forward_logits(batch).shape
        (True, torch.Size([2, 8, 64]))
    """

    #: Not the architecture (a resumed run's values apply): how it is sharded, where the weights were first
    #: loaded from (the checkpoint's replace them), attention kernel and activation recomputation.
    resume_changeable_options = (
        "parallel",
        "model_name_or_path",
        "attn_implementation",
        "gradient_checkpointing",
        "use_liger_kernel",
        "liger_kernel_config",
    )
    #: A built ``model`` (Python) is not saved in the hyper-parameters.
    resume_unsaved_options = ("model",)
    #: Options newer than some checkpoints, at the value those checkpoints trained with.
    resume_added_options: ClassVar[dict[str, Any]] = {
        "disable_dropout": False,
        "use_liger_kernel": False,
        "liger_kernel_config": None,
    }

    def __init__(
        self,
        model_name_or_path: str | None = None,
        config: dict[str, Any] | None = None,
        model: Any = None,
        vocab_size: int | None = None,
        label_format: LabelFormat = "next_token",
        attn_implementation: str | None = None,
        dtype: DType | None = None,
        lora: dict[str, Any] | None = None,
        gradient_checkpointing: bool = False,
        disable_dropout: bool = False,
        use_liger_kernel: bool = False,
        liger_kernel_config: dict[str, Any] | None = None,
        parallel: ParallelConfig | None = None,
        **kwargs: Any,
    ) -> None:
        with warnings.catch_warnings():  # the base class records every init argument; `model` is dropped next
            warnings.filterwarnings("ignore", message="Attribute 'model' is an instance of `nn.Module`")
            super().__init__(**kwargs)
        self.save_hyperparameters(ignore=["model"])
        self.label_format = check_choice(label_format, LabelFormat, "model.label_format")
        if dtype is not None:
            check_choice(dtype, DType, "model.dtype")
        check_liger_options(use_liger_kernel, liger_kernel_config)
        if model is None:
            model = build_causal_lm(
                model_name_or_path, config, vocab_size, attn_implementation=attn_implementation, dtype=dtype
            )
        elif model_name_or_path is not None or config is not None:
            raise ConfigError("HFCausalLM: give model, or model_name_or_path, or config; not several")
        if lora is not None:
            model = add_lora(model, lora)
        if disable_dropout:
            zero_dropout(model)
        if gradient_checkpointing:
            causal_lm_of(model).gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.model = model
        cause = f"model.init_args.dtype={dtype}" if dtype is not None else ""
        check_trainable_dtypes(self.named_parameters(), self.optimizer_config, cause=cause)
        check_plain_head(model)
        rows = self.output_projection()[0].shape[0]
        if vocab_size is not None and vocab_size > rows:
            raise ConfigError(
                f"model.init_args.vocab_size={vocab_size} (the data's vocabulary) exceeds the model's "
                f"output rows V={rows}: use the model's own tokenizer"
            )
        if use_liger_kernel:  # after the probe forward of check_plain_head: Liger's kernels run on CUDA only
            apply_liger_decoder(model, liger_kernel_config)
        self._labels_checked = False
        self._packing_problem: str | None = None  # None: not probed yet; "": packed rows are safe
        self.parallel_config = ParallelConfig.coerce(parallel)

    @property
    def fsdp_modules(self) -> list[str]:
        """The FSDP2 units besides the root (`ParallelConfig.fsdp_modules`): the modules whose class the
        model lists in ``_no_split_modules`` (its decoder layers, with their LoRA adapters), by name.
        The embeddings, the final norm and ``lm_head`` (tied or not) stay in the root unit, whose
        parameters the fused head reads.

        Raises:
            ConfigError: the model lists no such class (set ``model.init_args.parallel.fsdp_modules``).
        """
        lm = causal_lm_of(self.model)
        classes = set(getattr(lm, "_no_split_modules", None) or ())
        names = [name for name, module in self.named_modules() if type(module).__name__ in classes]
        if not names:
            raise ConfigError(
                f"HFCausalLM: {type(lm).__name__} names no decoder layer class (_no_split_modules="
                f"{sorted(classes)}) to shard with FSDP2: set model.init_args.parallel.fsdp_modules"
            )
        return names

    @property
    def tensor_parallel_plan(self) -> dict[str, str]:
        """The default tensor-parallel plan (`ParallelConfig.tensor_parallel_plan`): the output projection
        sharded along the vocabulary (``colwise``; tied: the input embedding's rows, ``embedding``), read
        by the vocabulary-parallel head; the decoder layers are replicated over the tensor-parallel group."""
        lm = causal_lm_of(self.model)
        weight = lm.get_output_embeddings().weight
        tied = weight is lm.get_input_embeddings().weight
        target = lm.get_input_embeddings() if tied else lm.get_output_embeddings()
        name = next(n for n, m in self.named_modules() if m is target)
        return {name: "embedding" if tied else "colwise"}

    @property
    def body(self) -> nn.Module:
        """The base model (embeddings and blocks, no output layer) that gives the hidden states."""
        return causal_lm_of(self.model).base_model

    @property
    def attn_implementation(self) -> str:
        """The attention implementation the model runs (``sdpa``, ``eager``, ``flash_attention_2``, ...)."""
        return str(getattr(causal_lm_of(self.model).config, "_attn_implementation", None) or "eager")

    def forward_hidden(self, batch: dict[str, Tensor]) -> Tensor:
        if self.hparams.get("use_liger_kernel"):  # a trainer refuses it at setup; plain Python calls here
            check_liger_device(batch["input_ids"].device)
        if batch_segment_ids(batch) is not None:
            if self._packing_problem is None:
                self._packing_problem = self.probe_packing()
            if self._packing_problem:
                raise ConfigError(self._packing_problem)
        dtype = next(self.body.parameters()).dtype
        return self.body(**body_inputs(batch, self.attn_implementation, dtype)).last_hidden_state

    def output_projection(self) -> tuple[Tensor, Tensor | None]:
        head = causal_lm_of(self.model).get_output_embeddings()
        return head.weight, head.bias

    def probe_packing(self) -> str:
        """Why packed rows are unsafe with this model ("" if they are safe): whether packed documents attend
        to each other, measured by `packing_leak` on a probe (run once: at the first packed batch, or when
        training starts, on every rank at once)."""
        body = self.body
        dtype = next(body.parameters()).dtype
        leak = packing_leak(body, self.output_projection()[0].shape[0], self.attn_implementation, dtype=dtype)
        if leak <= packing_tolerance(body):
            return ""
        return (
            f"HFCausalLM: with attn_implementation={self.attn_implementation!r}, packed documents of this "
            f"{type(causal_lm_of(self.model)).__name__} attend to each other (relative difference {leak:.1e} "
            "between a packed row and the same documents alone, on a probe); use "
            "model.init_args.attn_implementation: sdpa (or eager), or unpacked rows (data.packing: false)"
        )

    def prepare_batch(self, batch: dict[str, Any], stage: Stage = "train") -> dict[str, Any]:
        """``batch`` with next-token ``labels`` (shifted for ``input_aligned``) and, for packed rows in
        Hugging Face's format, the ``segment_ids`` that the aggregation counts sequences by."""
        batch = dict(batch)
        if not self._labels_checked:
            self._labels_checked = check_label_format(batch, self.label_format, self.ignore_index)
        segments = batch_segment_ids(batch)
        if segments is not None and batch.get("segment_ids") is None:
            batch["segment_ids"] = segments
        if self.label_format == "input_aligned":
            batch["labels"] = shift_labels(batch["labels"], segments, self.ignore_index)
            stats = batch.get(GLOBAL_STATS_KEY)
            if stage == "train" and isinstance(stats, GlobalStats):
                self._check_counted_after_shift(batch, stats)
        return batch

    def _check_counted_after_shift(self, batch: dict[str, Any], stats: GlobalStats) -> None:
        counted = stats.get_local(LABELS_KEY)
        shifted = count_masks(batch, (LABELS_KEY,), self.ignore_index)[LABELS_KEY]
        if counted != shifted:
            raise ConfigError(
                f"GlobalStatsLoader counted {counted.num_tokens} labelled tokens in this micro-batch before "
                f"the shift of label_format='input_aligned', {shifted.num_tokens} after it: the global "
                "denominators would be wrong. Let the loader count after the shift "
                "(GlobalStatsLoader(label_format='input_aligned'); a Trainer's fit sets it from the model), "
                "or shift the labels in the collate_fn (lit_losses.data.NextTokenCollator) and use "
                "label_format: next_token"
            )

    def compute_loss(self, batch: dict[str, Any], stage: Stage = "train") -> LossOutput:
        return super().compute_loss(self.prepare_batch(batch, stage), stage)

    def predict_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        """Per-token log-probabilities of the next-token labels (after the shift of ``input_aligned``)."""
        return super().predict_step(self.prepare_batch(batch, "predict"), batch_idx, dataloader_idx)

    def setup(self, stage: str) -> None:
        """`RegularizedLM.setup`'s checks, the model's context length against the data module's
        ``seq_len`` (`check_context_length`), and a CUDA device for ``use_liger_kernel``, before any batch."""
        if self.hparams.get("use_liger_kernel") and self._trainer is not None:
            check_liger_device(self._trainer.strategy.root_device)
        super().setup(stage)
        data = getattr(self._trainer, "datamodule", None)
        seq_len = getattr(data, "seq_len", None)
        if isinstance(seq_len, int):
            where = "model.init_args.config"
            if self.hparams.get("model_name_or_path"):
                where = (
                    f"the config of model.init_args.model_name_or_path={self.hparams['model_name_or_path']}"
                )
            option = "data.max_length" if "max_length" in getattr(data, "hparams", {}) else "data.seq_len"
            check_context_length(causal_lm_of(self.model).config, seq_len, where=where, option=option)

    def on_train_start(self) -> None:
        super().on_train_start()
        if self._packing_problem is None:  # every rank at once (a probe forward in a sharded model)
            self._packing_problem = self.probe_packing()

    def initial_copy(self) -> nn.Module:
        """A copy of the wrapped model (with its adapters, when it has some) as a frozen runner
        (`CausalLMRunner`), for a frozen ``initial_policy``."""
        return CausalLMRunner(copy.deepcopy(self.model), where="initial_policy", checked=True)

    def has_adapters(self) -> bool:
        """Whether the wrapped model has PEFT adapters (``lora``)."""
        return hasattr(self.model, "disable_adapter")

    def adapters_disabled(self, where: str) -> Callable[[], AbstractContextManager[Any]]:
        """``peft_model.disable_adapter``: the base model without a second copy in memory (a frozen
        ``disabled_adapters`` source; TRL's reference for a PEFT policy).

        Raises:
            ConfigError: naming ``where``: the model has no adapters (no ``lora``).
        """
        if not self.has_adapters():
            raise ConfigError(
                f"{where}={DISABLED_ADAPTERS!r}: the model has no PEFT adapters (set model.init_args.lora, "
                "or use 'initial_policy', a checkpoint or a Hugging Face checkpoint directory)"
            )
        return self.model.disable_adapter

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``generate`` (e.g. ``model.generate(input_ids, max_new_tokens=20)``)."""
        return self.model.generate(*args, **kwargs)
