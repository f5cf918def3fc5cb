"""`RegularizedLM`: the LightningModule base that users subclass (the contract and the Lightning hooks)."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import Tensor
from torchmetrics.aggregation import MeanMetric

from lit_losses.aggregation import (
    GLOBAL_STATS_KEY,
    AggMode,
    GlobalStats,
    accumulation_factor,
    check_window,
    configure_train_loaders,
    mode_denominator,
    window_ends,
)
from lit_losses.choices import check_choice
from lit_losses.heads import FusedLMHead
from lit_losses.heads.fused_head import Backend
from lit_losses.hparams import plain_data
from lit_losses.loss.context import LossContext, LossOutput, Stage
from lit_losses.loss.objective import Objective, batch_tensor
from lit_losses.loss.telemetry import StepTelemetry
from lit_losses.optim import OptimizerConfig, build_optimizer
from lit_losses.regularizers import RegularizerSet, RegularizerSpec, TermResult

LOCAL_NORMALIZATION_WARNING = (
    "training batches carry no global statistics: each micro-batch is normalized by its own counts, which "
    "biases the gradient when accumulate_grad_batches × world_size > 1 and the counts differ; use "
    "lit_losses.GlobalStatsLoader for the train dataloader"
)


class RegularizedLM(L.LightningModule):
    """Base LightningModule for language models trained with custom losses.

    **Subclass contract.** Implement ``forward_hidden(batch) -> Tensor [B, T, D]`` (the body's hidden
    states) and ``output_projection() -> (weight [V, D], bias [V] | None)`` (an ``nn.Linear``'s
    parameters or the tied embedding; gradients accumulate into it).

    **The loss** of a micro-batch is ``(w_base · base + Σ_i w_i r_i) × stats.loss_scale`` (`Objective`),
    ``base = −log p(label)`` aggregated with ``loss_agg`` over the *global* counts of the optimizer step
    (`GlobalStatsLoader`); ``loss_scale = A × D`` cancels Lightning's ``÷ accumulate_grad_batches`` and
    DDP's average. ``train/*`` and ``regularizers/*`` are logged once per optimizer step as exact global
    values (`StepTelemetry`), ``val/loss`` over the whole validation set; `telemetry` holds the last
    step as a nested dict; regularizer weights and enabled flags are saved in checkpoints.

    **Plug points** (overridable): `global_stats`, `mask_keys`, `head_outputs_needed`, `regularize`.

    Args:
        head_backend: output-head backend.
        head_chunk_size: tokens per chunk of the fused head (default: from a memory budget).
        loss_agg: aggregation mode of the base loss.
        optimizer: AdamW and learning-rate schedule settings.
        ignore_index: label value of positions without a target.
        check_finite: check hidden states for NaN/Inf before the head.
        regularizers: loss terms (`RegularizerSpec`; from YAML a list of dicts with its fields).
        regularizer_grad_norm: log each term's gradient norm w.r.t. the per-token log-probabilities.
        base_loss_weight: weight of the base cross-entropy (0: the regularizers are the whole loss).

    Example:
        >>> import torch
        >>> class Bigram(RegularizedLM):
        ...     def __init__(self, **kwargs):
        ...         super().__init__(**kwargs)
        ...         self.embed = torch.nn.Embedding(10, 10)
        ...     def forward_hidden(self, batch):
        ...         return self.embed(batch["input_ids"])
        ...     def output_projection(self):
        ...         return torch.eye(10), None  # logits = the embedding
        >>> model = Bigram(regularizers=[{"name": "z_loss", "weight": 1e-4}])
        >>> batch = {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[2, 3, -100]])}
        >>> out = model.compute_loss(batch)
        >>> out.total.backward()
        >>> sorted(out.terms), model.predict_step(batch, 0).shape
        (['z_loss'], torch.Size([1, 3]))
    """

    def __init__(
        self,
        head_backend: Backend = "auto",
        head_chunk_size: int | None = None,
        loss_agg: AggMode = "token-mean",
        optimizer: OptimizerConfig | None = None,
        ignore_index: int = -100,
        check_finite: bool = True,
        regularizers: list[RegularizerSpec] | None = None,
        regularizer_grad_norm: bool = False,
        base_loss_weight: float = 1.0,
    ) -> None:
        super().__init__()
        self.head_backend = check_choice(head_backend, Backend, "model.head_backend")
        self.save_hyperparameters()
        self.head_chunk_size, self.ignore_index, self.check_finite = (
            head_chunk_size,
            ignore_index,
            check_finite,
        )
        self.optimizer_config = OptimizerConfig(**optimizer) if isinstance(optimizer, dict) else optimizer
        self.optimizer_config = self.optimizer_config or OptimizerConfig()
        self.regularizer_set = RegularizerSet(regularizers or (), loss_agg, regularizer_grad_norm)
        self.objective = Objective(self.regularizer_set, loss_agg, base_loss_weight)
        self.loss_agg, self.base_loss_weight = loss_agg, self.objective.base_loss_weight
        self.val_loss, self.val_loss_total = MeanMetric(), MeanMetric()
        self.step_telemetry = StepTelemetry()
        self._warnings = WarningCache()

    @property
    def telemetry(self) -> dict[str, Any]:
        """The last optimizer step: ``{loss_total, base_loss, regularizer_total, regularizers: {name:
        {value, weight, contribution, custom}}}``."""
        return self.step_telemetry.nested

    # ---- subclass contract and plug points ----------------------------------------------------
    def forward_hidden(self, batch: dict[str, Tensor]) -> Tensor:
        """Hidden states ``[B, T, D]`` of the model body for ``batch``."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward_hidden(batch)")

    def output_projection(self) -> tuple[Tensor, Tensor | None]:
        """The output projection ``(weight [V, D], bias [V] | None)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement output_projection()")

    def output_head(self) -> FusedLMHead:
        """The fused head over `output_projection` (references, not copies)."""
        weight, bias = self.output_projection()
        return FusedLMHead(weight, bias, self.head_backend, self.head_chunk_size, self.ignore_index,
                           check_finite=self.check_finite)  # fmt: skip

    def forward_logits(self, batch: dict[str, Tensor]) -> Tensor:
        """Full logits ``[B, T, V]`` (inference)."""
        return self.output_head().forward_logits(self.forward_hidden(batch))

    def global_stats(self, batch: dict[str, Any], stage: Stage) -> GlobalStats:
        """Counts to normalize by: in training the `GlobalStats` that `GlobalStatsLoader` attached (global
        counts of the optimizer step, ``loss_scale = A × D``), else this micro-batch's own counts."""
        attached = batch.get(GLOBAL_STATS_KEY)
        if stage == "train" and isinstance(attached, GlobalStats):
            return attached
        if stage == "train" and accumulation_factor(self._trainer) > 1:
            self._warnings.warn(LOCAL_NORMALIZATION_WARNING)
        return GlobalStats.local_only(batch, self.mask_keys(), self.ignore_index)

    def mask_keys(self) -> tuple[str, ...]:
        """Mask keys whose global counts the loss terms need (``"labels"``: ``labels != ignore_index``)."""
        return self.objective.mask_keys()

    def head_outputs_needed(self) -> tuple[str, ...]:
        """Head outputs consumed by the loss terms (the base loss alone needs only ``logprobs``)."""
        return self.objective.head_outputs_needed()

    def regularize(self, ctx: LossContext) -> tuple[Tensor, dict[str, TermResult]]:
        """Weighted sum of the regularizer terms and their results (`RegularizerSet`)."""
        return self.regularizer_set(ctx)

    def compute_loss(self, batch: dict[str, Any], stage: Stage = "train") -> LossOutput:
        """Loss of one micro-batch, normalized by the global counts (before ``loss_scale``)."""
        batch_tensor(batch, "labels")
        hidden = self.forward_hidden(batch)
        stats = self.global_stats(batch, stage)
        return self.objective(self.output_head(), hidden, batch, stats, int(self.global_step), stage,
                              self.head_outputs_needed(), self.regularize)  # fmt: skip

    # ---- Lightning hooks ---------------------------------------------------------------------
    def on_train_start(self) -> None:
        """Configure every `GlobalStatsLoader` of the fit with the trainer's and the loss terms' needs."""
        configure_train_loaders(self.trainer, self.mask_keys(), self.ignore_index)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        out = self.compute_loss(batch, "train")
        check_window(batch, batch_idx, self._trainer)
        share = out.stats.loss_scale / accumulation_factor(self._trainer)  # its share of the step
        self.step_telemetry.update(out.logged_values("train"), share, out.terms)
        if window_ends(self._trainer, batch_idx):
            for key, value in self.step_telemetry.compute(self.regularizer_set, self.global_step).items():
                self.log(key, value, prog_bar=key == "train/loss_total", on_step=True, on_epoch=False)
        return out.total * out.stats.loss_scale

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        out = self.compute_loss(batch, "val")
        weight = mode_denominator(self.loss_agg, out.stats.get_local())
        if weight:  # Σ value·count / Σ count over every micro-batch of every rank (exact in DDP)
            self.val_loss.update(out.base.detach(), weight=weight)
            self.val_loss_total.update(out.total.detach(), weight=weight)
        self.log("val/loss", self.val_loss, prog_bar=True, on_step=False, on_epoch=True)
        self.log("val/loss_total", self.val_loss_total, on_step=False, on_epoch=True)

    def predict_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        """Per-token log-probabilities ``[B, T]`` of the labels (0 at ignored positions)."""
        labels = batch_tensor(batch, "labels")
        return self.output_head()(self.forward_hidden(batch), labels, "logprobs").logprobs

    def configure_optimizers(self) -> dict[str, Any]:
        total = int(self.trainer.estimated_stepping_batches) if self._trainer is not None else 1
        optimizer, scheduler = build_optimizer(self, self.optimizer_config, max(total, 1))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Save the regularizers' run-time weights and enabled flags; hyper-parameters as plain data
        (``torch.load(weights_only=True)`` and ``load_from_checkpoint`` rebuild them)."""
        checkpoint["lit_losses_regularizers"] = self.regularizer_set.state_dict()
        if "hyper_parameters" in checkpoint:
            checkpoint["hyper_parameters"] = plain_data(checkpoint["hyper_parameters"])

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the regularizers' weights and enabled flags in force at the checkpoint."""
        if "lit_losses_regularizers" in checkpoint:
            self.regularizer_set.load_state_dict(checkpoint["lit_losses_regularizers"])

    def teardown(self, stage: str) -> None:
        self.regularizer_set.close()


__all__ = ["LossContext", "LossOutput", "RegularizedLM"]
