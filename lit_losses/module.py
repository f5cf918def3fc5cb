"""`RegularizedLM`: the LightningModule base that users subclass (the contract and the Lightning hooks)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import Tensor, nn

from lit_losses.aggregation import (
    GLOBAL_STATS_KEY,
    AggMode,
    GlobalStats,
    LabelFormat,
    accumulation_factor,
    check_window,
    configure_train_loaders,
)
from lit_losses.checkpoint.reshard import record_param_names
from lit_losses.checkpoint.resume import restore_checkpoint_state
from lit_losses.checkpoint.topology import record_topology
from lit_losses.choices import check_choice
from lit_losses.errors import ConfigError
from lit_losses.heads import Backend, FusedLMHead, MatmulPrecision, check_backend_runs, head_for
from lit_losses.hparams import plain_data
from lit_losses.loss.context import LossContext, LossOutput, Stage
from lit_losses.loss.custom import CustomLossMixin
from lit_losses.loss.objective import Objective, batch_tensor
from lit_losses.loss.telemetry import TOKENS_SEEN_KEY, StepTelemetry, ValidationTelemetry
from lit_losses.models.frozen import (
    DISABLED_ADAPTERS,
    INITIAL_POLICY,
    FrozenModel,
    FrozenSource,
    check_frozen_source,
    load_frozen,
)
from lit_losses.non_finite import check_hidden_states, check_optimizer_step, non_finite_steps_handled
from lit_losses.objectives import (
    BaseLossName,
    CPOPreset,
    DPOPreset,
    GRPOPreset,
    KTOPreset,
    ORPOPreset,
    select_preset,
)
from lit_losses.objectives.distillation import DistillationConfig
from lit_losses.objectives.inputs import OLD_LOGPROBS, check_provided
from lit_losses.optim import OptimizerConfig, optimizer_and_schedule
from lit_losses.parallel import ModelParallelMixin
from lit_losses.regularizers import RegularizerSpec, TermResult
from lit_losses.validation import checked_hidden, checked_projection, chunk_size_option

LOCAL_NORMALIZATION_WARNING = (
    "training batches carry no global statistics: each micro-batch is normalized by its own counts, which "
    "biases the gradient when accumulate_grad_batches × world_size > 1 and the counts differ; use "
    "lit_losses.GlobalStatsLoader for the train dataloader"
)

_WARNINGS = WarningCache()


class RegularizedLM(CustomLossMixin, ModelParallelMixin, L.LightningModule):
    """Base LightningModule for language models trained with custom losses.

    **Subclass contract.** Implement ``forward_hidden(batch) -> Tensor [B, T, D]`` (the body's hidden
    states) and ``output_projection() -> (weight [V, D], bias [V] | None)`` (an ``nn.Linear``'s
    parameters or the tied embedding; gradients accumulate into it).

    **The loss** of a micro-batch is ``(w_base · base + Σ_i w_i r_i) × loss_scale`` (`Objective`), ``base``
    the per-token ``base_loss`` (``−log p(label)``, or RL's ``ppo``, …) aggregated with ``loss_agg`` over
    the *global* counts of the step (`GlobalStatsLoader`); ``loss_scale = A × D`` cancels Lightning's ``÷A``
    and DDP's ``÷D``. Logged values are exact global values (`StepTelemetry`). Plug points:
    `global_stats`, `mask_keys`, `head_outputs_needed`, `regularize`.

    Args:
        head_backend: output-head backend.
        head_chunk_size: tokens per chunk of the fused head (default: from a memory budget).
        head_matmul_precision: the fused head's matmul operands and logits (`lit_losses.heads.precision`):
            ``auto`` (bf16 operands with fp32 logits on CUDA when bf16 is in play, the compute dtype
            elsewhere), ``full``, ``low``, or ``low_logits`` (the logits rounded to bf16 as a bf16
            ``nn.Linear`` writes them for Hugging Face's own loss: half the head's bytes per logit).
        loss_agg: aggregation mode of the base loss.
        optimizer: AdamW and learning-rate schedule settings.
        ignore_index: label value of positions without a target.
        check_finite: refuse non-finite hidden states before the head and non-finite optimizer steps (with
            a training controller: skip the step and let its rules act; `lit_losses.non_finite`);
            ``False``: apply them as they are.
        regularizers: loss terms (`RegularizerSpec`; from YAML a list of dicts with its fields).
        regularizer_grad_norm: log each term's gradient norm w.r.t. the per-token log-probabilities.
        base_loss_weight: weight of the base loss (0: the regularizers are the whole loss).
        base_loss: the base loss by name (`lit_losses.objectives`: cross_entropy, ppo, cispo, …).
        base_loss_args: its parameters (Tinker's ``loss_fn_config``, e.g. ``clip_high_threshold``).
        loss_agg_norm: the constant ``C`` of ``loss_agg: seq-mean-token-sum-norm`` (required by it).
        grpo: TRL's GRPO loss by ``GRPOConfig``'s fields (`GRPOPreset`), setting the 4 options above.
        dpo: TRL's DPO loss by ``DPOConfig``'s fields (`DPOPreset`): the base loss becomes the mean over the
            step's pairs of each pair's loss (`lit_losses.loss.preference`; paired data,
            `lit_losses.PreferenceDataModule`).
        kto: TRL's KTO loss by ``KTOConfig``'s fields (`KTOPreset`): the mean over the step's sequences of
            each one's loss (`lit_losses.loss.preference_unpaired`; unpaired data).
        cpo: TRL's CPO loss by ``CPOConfig``'s fields (`CPOPreset`; SimPO, AlphaPO).
        orpo: TRL's ORPO loss by ``ORPOConfig``'s fields (`ORPOPreset`).
        ref_model: the frozen reference policy of ``dpo``/``kto`` when its log-probabilities do not come
            with the data (`lit_losses.models.frozen`): a Hugging Face checkpoint directory, a
            `RegularizedLM` checkpoint file, a ``transformers`` config dict, ``initial_policy`` or
            ``disabled_adapters``; default (TRL's): ``disabled_adapters`` for a model with PEFT adapters,
            else ``initial_policy``. Only this option is saved, never the reference's weights.
        distillation: logit distillation from a teacher as the base loss (`DistillationConfig`: a frozen
            ``teacher`` model, or offline top-k log-probabilities in the batches; ``loss``, ``beta``,
            ``temperature``, ``weight``, ``ce_weight``), aggregated with ``loss_agg`` over the step's global
            counts (`lit_losses.loss.distillation`). Only the teacher's source is saved, never its weights.
        token_metrics: also log TRL's per-token metrics of the loss's trainer, exact over the step
            (`lit_losses.loss.token_metrics`): ``train/entropy``, ``train/mean_token_accuracy``,
            ``train/num_tokens`` (SFT, DPO), ``train/logits/chosen`` and ``train/logits/rejected``
            (DPO, KTO, CPO, ORPO), and in validation the means as ``val/<name>``; costs one more
            no-grad forward matmul of the head over the valid tokens.

    Example:
        >>> import torch
        >>> from lit_losses import TinyLM
        >>> model = TinyLM(vocab_size=64, d_model=16, n_heads=2, regularizers=[{"name": "z_loss"}])
        >>> batch = {"input_ids": torch.randint(0, 64, (2, 8)), "labels": torch.randint(0, 64, (2, 8))}
        >>> sorted(model.compute_loss(batch).terms), model.predict_step(batch, 0).shape
        (['z_loss'], torch.Size([2, 8]))
    """

    #: How the batches' ``labels`` are laid out (`LabelFormat`): what `GlobalStatsLoader` counts.
    label_format: LabelFormat = "next_token"
    #: A subclass's own arguments that are not its architecture: a run resumed from a checkpoint may
    #: change them, like `RegularizedLM`'s own (a warning lists each; `lit_losses.checkpoint.resume`).
    resume_changeable_options: tuple[str, ...] = ()
    #: A subclass's arguments that are not saved with its checkpoint (a built object): never compared.
    resume_unsaved_options: tuple[str, ...] = ()
    #: A subclass's arguments added in a later version, with their defaults: a checkpoint written before
    #: one existed trained as with its default, so resuming it at that default is no change.
    resume_added_options: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        head_backend: Backend = "auto",
        head_chunk_size: int | None = None,
        loss_agg: AggMode = "token-mean",
        optimizer: OptimizerConfig = OptimizerConfig(),  # noqa: B008 (read-only default)
        ignore_index: int = -100,
        check_finite: bool = True,
        regularizers: list[RegularizerSpec] | None = None,
        regularizer_grad_norm: bool = False,
        base_loss_weight: float = 1.0,
        base_loss: BaseLossName | str = "cross_entropy",
        base_loss_args: dict[str, Any] | None = None,
        loss_agg_norm: float | None = None,
        grpo: GRPOPreset | None = None,
        dpo: DPOPreset | None = None,
        kto: KTOPreset | None = None,
        cpo: CPOPreset | None = None,
        orpo: ORPOPreset | None = None,
        ref_model: FrozenSource | None = None,
        distillation: DistillationConfig | None = None,
        token_metrics: bool = False,
        head_matmul_precision: MatmulPrecision = "auto",
    ) -> None:
        super().__init__()
        self.frozen_sources: dict[str, tuple[FrozenSource, str]] = {}
        self.frozen_models: dict[str, FrozenModel] = {}
        self.head_backend = check_choice(head_backend, Backend, "model.head_backend")
        self.save_hyperparameters()
        self.head_chunk_size = chunk_size_option(head_chunk_size)
        self.head_matmul_precision = check_choice(
            head_matmul_precision, MatmulPrecision, "model.head_matmul_precision"
        )
        self.ignore_index = ignore_index
        self.check_finite = check_finite
        self.optimizer_config = OptimizerConfig.coerce(optimizer)
        self.objective = Objective.from_options(
            regularizers=regularizers,
            loss_agg=loss_agg,
            base_loss_weight=base_loss_weight,
            regularizer_grad_norm=regularizer_grad_norm,
            base_loss=base_loss,
            base_loss_args=base_loss_args,
            loss_agg_norm=loss_agg_norm,
            grpo=grpo,
            preference=select_preset(dpo=dpo, kto=kto, cpo=cpo, orpo=orpo),
            distillation=distillation,
            token_metrics=token_metrics,
        )
        self.regularizer_set = self.objective.regularizers
        self.loss_agg = self.objective.loss_agg
        self.base_loss_weight = self.objective.base_loss_weight
        self._reference_option(ref_model)
        teacher = None if self.objective.distillation is None else self.objective.distillation.config.teacher
        if teacher is not None:
            self.add_frozen_model("teacher", teacher, where="model.distillation.teacher")
        preference = self.objective.preference
        self.val_telemetry = ValidationTelemetry(
            self.loss_agg,
            metric_names=self.objective.metric_names("val"),
            units=None if preference is None else preference.units,
        )
        self.step_telemetry = StepTelemetry()
        self._non_finite_handled: bool | None = None  # read at each trainer call's setup (`setup`)

    @property
    def telemetry(self) -> dict[str, Any]:
        """The last optimizer step as a nested dict (see `StepTelemetry`)."""
        return self.step_telemetry.nested

    def forward_hidden(self, batch: dict[str, Tensor]) -> Tensor:
        """Hidden states ``[B, T, D]`` of the model body for ``batch``."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward_hidden(batch)")

    def hidden_states(self, batch: dict[str, Tensor]) -> Tensor:
        """`forward_hidden`'s output, checked to be one ``[B, T, D]`` tensor (`checked_hidden`)."""
        return checked_hidden(self.forward_hidden(batch), type(self).__name__)

    def output_projection(self) -> tuple[Tensor, Tensor | None]:
        """The output projection ``(weight [V, D], bias [V] | None)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement output_projection()")

    def output_head(self) -> FusedLMHead:
        """The fused head over `output_projection` (references; vocabulary-parallel when sharded)."""
        weight, bias = checked_projection(self.output_projection(), type(self).__name__)
        return head_for(
            weight,
            bias,
            backend=self.head_backend,
            chunk_size=self.head_chunk_size,
            ignore_index=self.ignore_index,
            check_finite=self._checks_hidden_states(),
            matmul_precision=self.head_matmul_precision,
        )

    def _checks_hidden_states(self) -> bool:
        """``check_finite``, unless a callback of the trainer skips non-finite steps
        (`lit_losses.non_finite`): then the NaN must reach the loss for the callback's rules. The callbacks
        are read once per trainer call (``fit``, ``validate``, …) at `setup`, after Lightning has attached
        them all; outside a trainer call, here."""
        handled = self._non_finite_handled
        if handled is None:
            handled = non_finite_steps_handled(self._trainer)
        return self.check_finite and not handled

    def add_frozen_model(self, name: str, source: FrozenSource, *, where: str) -> None:
        """Name a frozen auxiliary model (a reference policy, a teacher; `lit_losses.models.frozen`): its
        ``source`` is checked now (a `ConfigError` naming ``where``), the model loaded when a trainer sets
        this module up for ``fit`` or ``validate`` (`setup`), or at the first `frozen_model` call. It is no
        submodule: no optimizer state, nothing in the checkpoint but the option that names its source."""
        self.frozen_sources[name] = (check_frozen_source(source, where), where)

    def frozen_model(self, name: str) -> FrozenModel:
        """The frozen model ``name`` (`add_frozen_model`), loaded if needed, on the device and in the dtype
        of this module's output projection."""
        if name not in self.frozen_models:
            if name not in self.frozen_sources:
                raise KeyError(f"no frozen model {name!r}; named ones: {sorted(self.frozen_sources)}")
            source, where = self.frozen_sources[name]
            self.frozen_models[name] = load_frozen(source, where=where, policy=self)
        frozen = self.frozen_models[name]
        frozen.follow(self.output_projection()[0])
        return frozen

    def initial_copy(self) -> nn.Module:
        """A copy of this model with its current weights, for a frozen ``initial_policy``: rebuilt from the
        hyper-parameters, then given this model's state. Override it for a model whose hyper-parameters do
        not rebuild it (`HFCausalLM` copies its Hugging Face model)."""
        hparams = {k: v for k, v in self.hparams.items() if not k.startswith("_")}
        try:
            copy = type(self)(**hparams)
        except TypeError as err:
            raise ConfigError(
                f"{INITIAL_POLICY!r}: {type(self).__name__} cannot be rebuilt from its hyper-parameters "
                f"({err}); override its initial_copy(), or give model.ref_model a checkpoint"
            ) from err
        wanted = copy.state_dict()
        state = {k: v.detach().clone() for k, v in self.state_dict().items() if k in wanted}
        copy.load_state_dict(state, assign=True)  # this model's values, dtypes and devices
        return copy

    def adapters_disabled(self, where: str) -> Callable[[], AbstractContextManager[Any]]:
        """A context-manager factory in which this model computes without its PEFT adapters (a frozen
        ``disabled_adapters`` source); `HFCausalLM` with ``lora`` has one.

        Raises:
            ConfigError: naming ``where``: this model has no adapters.
        """
        raise ConfigError(
            f"{where}={DISABLED_ADAPTERS!r}: {type(self).__name__} has no PEFT adapters to disable; use "
            "'initial_policy', a checkpoint or a Hugging Face checkpoint directory"
        )

    def _reference_option(self, ref_model: FrozenSource | None) -> None:
        """Name the frozen reference of ``ref_model`` (checked now), or refuse it when the loss reads none."""
        preference = self.objective.preference
        if ref_model is None:
            return
        if preference is None or not preference.uses_reference_model:
            reads = (
                "no preference loss is set"
                if preference is None
                else f"{preference.where} reads no reference model (reference_free, "
                "precompute_ref_log_probs, or a loss without a reference)"
            )
            raise ConfigError(f"model.ref_model={ref_model!r} is set but {reads}; remove it")
        self.add_frozen_model("reference", ref_model, where="model.ref_model")

    def has_adapters(self) -> bool:
        """Whether the model has PEFT adapters to disable (`adapters_disabled`; `HFCausalLM` with lora)."""
        return False

    def reference_model(self) -> FrozenModel:
        """The frozen reference policy of the preference loss (``model.ref_model``; by default
        ``disabled_adapters`` for a model with adapters, else ``initial_policy``)."""
        if "reference" not in self.frozen_sources:
            source = DISABLED_ADAPTERS if self.has_adapters() else INITIAL_POLICY
            self.add_frozen_model("reference", source, where="model.ref_model")
        return self.frozen_model("reference")

    def reference_logprobs(self, batch: dict[str, Any], labels: Tensor) -> Tensor:
        """``log p_ref(labels)`` ``[B, T]`` under `reference_model` (no gradient; the head's options)."""
        return self.reference_model().logprobs(
            batch,
            labels,
            backend=self.head_backend,
            chunk_size=self.head_chunk_size,
            ignore_index=self.ignore_index,
            matmul_precision=self.head_matmul_precision,
        )

    def policy_logprobs(self, batch: dict[str, Any], labels: Tensor) -> Tensor:
        """``log p(labels)`` ``[B, T]`` of this model, without gradient (KTO's KL rows)."""
        with torch.no_grad():
            return self.output_head()(self.hidden_states(batch), labels, ("logprobs",)).logprobs

    def teacher_outputs(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor | None]:
        """The frozen distillation teacher's ``(hidden [B, T, Dt], weight [V, Dt], bias)`` for ``batch``
        (no gradient, eval mode; ``model.distillation.teacher``)."""
        teacher = self.frozen_model("teacher")
        return (teacher.hidden_states(batch), *teacher.output_projection())

    def check_frozen_vocabularies(self) -> None:
        """Refuse a frozen model (a distillation teacher, a reference policy) whose vocabulary is not this
        model's size (a `ConfigError` naming its option and both sizes)."""
        size = self.output_projection()[0].shape[0]
        for name, (_, where) in self.frozen_sources.items():
            frozen = self.frozen_model(name)
            other = frozen.output_projection()[0].shape[0]
            if other == size:
                continue
            role, why = (
                ("the student", "distillation compares distributions over one vocabulary")
                if name == "teacher"
                else ("the policy", "the reference scores the policy's tokens")
            )
            raise ConfigError(
                f"{where}={frozen.source!r} has a vocabulary of {other} tokens and {role} "
                f"({type(self).__name__}) {size}: {why} (the same tokenizer)"
            )

    def forward_logits(self, batch: dict[str, Tensor]) -> Tensor:
        """Full logits ``[B, T, V]`` (inference)."""
        return self.output_head().forward_logits(self.hidden_states(batch))

    def global_stats(self, batch: dict[str, Any], stage: Stage) -> GlobalStats:
        """Counts to normalize by: in training the `GlobalStats` that `GlobalStatsLoader` attached (global
        counts of the optimizer step, ``loss_scale = A × D``), else this micro-batch's own counts."""
        attached = batch.get(GLOBAL_STATS_KEY)
        if stage == "train" and isinstance(attached, GlobalStats):
            return attached
        if stage == "train" and accumulation_factor(self._trainer) > 1:
            _WARNINGS.warn(LOCAL_NORMALIZATION_WARNING)
        self.regularizer_set.check_mask_keys(tuple(batch))
        return GlobalStats.local_only(batch, self.mask_keys(), self.ignore_index)

    def mask_keys(self) -> tuple[str, ...]:
        """Mask keys whose global counts the loss terms need (``"labels"``: ``labels != ignore_index``)."""
        return self.objective.mask_keys()

    def head_outputs_needed(self) -> tuple[str, ...]:
        """Head outputs consumed by the loss terms (none: cross-entropy alone, the fast path)."""
        return self.objective.head_outputs_needed()

    def regularize(self, ctx: LossContext) -> tuple[Tensor, dict[str, TermResult]]:
        """Weighted sum of the regularizer terms and their results (`RegularizerSet`)."""
        return self.regularizer_set(ctx)

    def compute_loss(self, batch: dict[str, Any], stage: Stage = "train") -> LossOutput:
        """Loss of one micro-batch, normalized by the global counts (before ``loss_scale``)."""
        batch_tensor(batch, "labels")
        batch = self.objective.reject(batch, self.ignore_index)  # before the counts (rollout_rs)
        hidden = self.hidden_states(batch)
        if self._checks_hidden_states():
            check_hidden_states(hidden, where=f"{stage} batch at step {int(self.global_step)}")
        stats = self.global_stats(batch, stage)
        preference = self.objective.preference
        uses_reference = preference is not None and preference.uses_reference_model
        return self.objective(
            self.output_head(),
            hidden,
            batch=batch,
            stats=stats,
            step=int(self.global_step),
            stage=stage,
            needed=self.head_outputs_needed(),
            regularize=self.regularize,
            reference=self.reference_logprobs if uses_reference else None,
            policy=self.policy_logprobs,
            teacher=self.teacher_outputs if "teacher" in self.frozen_sources else None,
        )

    def setup(self, stage: str) -> None:
        """Before training: refuse a head backend that cannot run on the trainer's device
        (`check_backend_runs`), a base loss or a regularizer's ``mask_key`` that reads a batch key the data
        module never provides (`check_provided`, `RegularizerSet.check_mask_keys`; data modules that tell
        their keys with ``batch_keys()``, as `TextDataModule`),
        and an ``ignore_index`` other than the one the data module labels positions without a target with.
        Read whether a callback skips non-finite steps (once per trainer call, `_checks_hidden_states`).
        Load the frozen models (`add_frozen_model`) for ``fit`` and ``validate``: before any weights are
        restored from a checkpoint, so that an ``initial_policy`` copy is the weights the module was built
        with.
        """
        self._non_finite_handled = non_finite_steps_handled(self._trainer)
        device = self._trainer.strategy.root_device if self._trainer is not None else self.device
        check_backend_runs(self.head_backend, device, where="model.init_args.head_backend")
        if stage in ("fit", "validate"):
            preference = self.objective.preference
            if preference is not None and preference.uses_reference_model:
                self.reference_model()
            for name in self.frozen_sources:
                self.frozen_model(name)
            self.check_frozen_vocabularies()
        data = getattr(self._trainer, "datamodule", None) if stage == "fit" else None
        data_ignore = getattr(data, "ignore_index", self.ignore_index)
        if isinstance(data_ignore, int) and data_ignore != self.ignore_index:
            raise ConfigError(
                f"model.init_args.ignore_index={self.ignore_index} differs from the label value "
                f"{type(data).__name__} gives positions without a target ({data_ignore}); remove the option "
                f"or set it to {data_ignore}"
            )
        provided = data.batch_keys() if callable(getattr(data, "batch_keys", None)) else ()
        if provided:
            self.regularizer_set.check_mask_keys(provided, provider=type(data).__name__)
        if provided and self.objective.preference is not None:
            self.objective.preference.check_data(provided, source=type(data).__name__)
        elif provided and self.objective.distillation is not None:
            self.objective.distillation.check_data(provided, source=type(data).__name__)
        elif provided and self.objective.base_loss_weight > 0:
            reader = f"model.base_loss={self.objective.base_loss.name!r}"
            check_provided(
                reads=self.objective.base_loss.entry.reads,
                provided=provided,
                reader=reader,
                source=type(data).__name__,
            )
        if self.objective.rejects:
            self._check_rejection(provided, source=type(data).__name__)

    def _check_rejection(self, provided: tuple[str, ...], source: str) -> None:
        """A rollout rejection (``rollout_rs``) needs next-token labels (it changes them before they are
        counted) and the data's ``old_logprobs``."""
        where = f"model.base_loss_args.rollout_rs (base loss {self.objective.base_loss.name!r})"
        if self.label_format != "next_token":
            raise ConfigError(
                f"{where} rejects tokens before the step is counted, which needs next-token labels; "
                f"label_format={self.label_format!r} labels are shifted later (use label_format: next_token)"
            )
        if provided:
            check_provided(reads=[OLD_LOGPROBS], provided=provided, reader=where, source=source)

    def on_train_start(self) -> None:
        """Configure every `GlobalStatsLoader` of the fit with the trainer's and the loss terms' needs (a
        rollout rejection is applied by the loader, before it counts the step)."""
        configure_train_loaders(
            self.trainer,
            mask_keys=self.mask_keys(),
            ignore_index=self.ignore_index,
            label_format=self.label_format,
            transform=self.objective.reject if self.objective.rejects else None,
        )

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        out = self.compute_loss(batch, "train")
        check_window(batch, batch_idx, self._trainer)
        self.step_telemetry.record(self, out, batch_idx)  # its share of the step, logged once per step
        return out.total * out.stats.loss_scale

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.val_telemetry.record(self, self.compute_loss(batch, "val"))  # val/loss, val/loss_total

    def predict_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        """Per-token log-probabilities ``[B, T]`` of the labels (0 at ignored positions)."""
        labels = batch_tensor(batch, "labels")
        return self.output_head()(self.hidden_states(batch), labels, "logprobs").logprobs

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Skip (with a controller) or refuse (without) a step whose gradients are not finite
        (`lit_losses.non_finite`)."""
        check_optimizer_step(self, optimizer)

    def configure_optimizers(self) -> dict[str, Any]:
        return optimizer_and_schedule(self, self.optimizer_config, self._trainer)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Save the regularizers' run-time weights and flags, the input tokens trained on so far
        (``train/num_tokens``), hyper-parameters as plain data, the run's layout
        (`lit_losses.checkpoint.topology`) and the names of the optimizer states' parameters
        (`lit_losses.checkpoint.reshard`): what resuming on another layout needs."""
        checkpoint["lit_losses_regularizers"] = self.regularizer_set.state_dict()
        checkpoint[TOKENS_SEEN_KEY] = self.step_telemetry.tokens_seen
        if "hyper_parameters" in checkpoint:
            checkpoint["hyper_parameters"] = plain_data(checkpoint["hyper_parameters"])
        record_topology(checkpoint, self.trainer)
        record_param_names(checkpoint, module=self, optimizers=self.trainer.optimizers)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Check this run's options against the checkpoint's; restore its run-time state (`resume`) and the
        count of input tokens trained on (0 from a checkpoint written before it was saved)."""
        restore_checkpoint_state(self, checkpoint)
        self.step_telemetry.tokens_seen = int(checkpoint.get(TOKENS_SEEN_KEY, 0))

    def teardown(self, stage: str) -> None:
        self.regularizer_set.close()
        self._non_finite_handled = None  # the next trainer call reads its own callbacks


__all__ = ["LossContext", "LossOutput", "RegularizedLM"]
