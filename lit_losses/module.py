"""`RegularizedLM`: the LightningModule base that users subclass."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torchmetrics.aggregation import MeanMetric

from lit_losses.aggregation import (
    AGG_MODES,
    GLOBAL_STATS_KEY,
    LABELS_KEY,
    GlobalStats,
    GlobalStatsLoader,
    StepSums,
    check_mode,
    mode_denominator,
    token_weights,
)
from lit_losses.errors import ConfigError
from lit_losses.heads import BACKENDS, FusedLMHead, HeadOutput
from lit_losses.optim import OptimizerConfig, build_optimizer
from lit_losses.regularizers import RegularizerSet, RegularizerSpec


@dataclass
class LossContext:
    """Everything a loss term may read in one micro-batch step.

    Attributes:
        batch: the micro-batch dict (``input_ids``, ``labels``, ``segment_ids``, ``position_ids``, …).
        head: head outputs (``logprobs``/``lse``/``entropy`` ``[B, T]``, 0 at ignored positions).
        hidden: hidden states ``[B, T, D]``.
        mask: ``labels != ignore_index`` ``[B, T]``.
        stats: global counts of the optimizer step and the ``loss_scale``.
        step: the trainer's global (optimizer) step.
        stage: ``"train"``, ``"val"`` or ``"predict"``.
    """

    batch: dict[str, Any]
    head: HeadOutput
    hidden: Tensor
    mask: Tensor
    stats: GlobalStats
    step: int
    stage: str

    @property
    def logprobs(self) -> Tensor:
        """``log p(label)`` ``[B, T]`` (0 at ignored positions)."""
        return self._head_field("logprobs")

    @property
    def lse(self) -> Tensor:
        """Log-sum-exp of the logits ``[B, T]``."""
        return self._head_field("lse")

    @property
    def entropy(self) -> Tensor:
        """Entropy of the predicted distribution ``[B, T]``."""
        return self._head_field("entropy")

    def _head_field(self, name: str) -> Tensor:
        value = getattr(self.head, name)
        if value is None:
            raise AttributeError(f"head output {name!r} was not computed: declare it in the term's needs")
        return value


@dataclass
class LossOutput:
    """The loss of one micro-batch and its parts (all already normalized by the global counts)."""

    total: Tensor
    base: Tensor
    regularizer_total: Tensor
    stats: GlobalStats
    terms: dict[str, dict[str, Any]] = field(default_factory=dict)
    num_tokens: int = 0

    def logged_values(self, stage: str) -> dict[str, Tensor]:
        """Flat telemetry whose global value is a sum over micro-batches and ranks.

        Per term: ``value``, ``contribution``, ``error`` (a count, logged as 0/1) and, when computed,
        ``grad_norm_sq`` (squared norms add up over micro-batches and ranks; logged as ``grad_norm``).
        """
        values = {
            f"{stage}/loss_total": self.total.detach(),
            f"{stage}/base_loss": self.base.detach(),
            f"{stage}/regularizer_total": self.regularizer_total.detach(),
        }
        for name, term in self.terms.items():
            for key in ("value", "contribution", "error", "grad_norm_sq"):
                if term.get(key) is not None:
                    values[f"regularizers/{name}/{key}"] = torch.as_tensor(term[key])
        return values


class RegularizedLM(L.LightningModule):
    """Base LightningModule for language models trained with custom losses.

    **Subclass contract.** Implement

    - ``forward_hidden(batch) -> Tensor [B, T, D]``: the model body's hidden states;
    - ``output_projection() -> (weight [V, D], bias [V] | None)``: the output projection (an
      ``nn.Linear``'s parameters, or the tied input embedding; gradients accumulate into it).

    **What the base owns.** The output head (`FusedLMHead`, backend chosen by ``head_backend``), the
    per-step `LossContext`, the base loss ``−log p(label)`` aggregated with ``loss_agg``, logging, the
    optimizer and schedule (`OptimizerConfig`), ``forward_logits(batch)`` for inference and a
    ``predict_step`` returning per-token log-probabilities ``[B, T]``.

    **Plug points** (each a named method, overridable):

    - ``global_stats(batch, stage)``: the counts every aggregation divides by; in training the
      `GlobalStats` attached by `GlobalStatsLoader` (global counts of the optimizer step), else the
      micro-batch's own counts. ``on_train_start`` configures the loader (A, mask keys, limits).
    - ``mask_keys()``: the mask keys whose global counts are needed (``labels`` + the terms').
    - ``head_outputs_needed()``: which head outputs the loss terms consume. Training with the base
      loss alone takes the plain-CE fast path; with pointwise terms only (all built-ins), the terms run
      chunk by chunk inside the head; both compute every gradient in forward (no logits recompute).
    - ``regularize(ctx)``: the `RegularizerSet`; returns ``(weighted sum, per-term telemetry)``.
    - Controller: `TrainingController` reads the logged metrics and ``regularizer_set``.

    **Loss and logging.** The loss of one micro-batch is ``(w_base · base + Σ_i w_i r_i) ×
    stats.loss_scale``, where ``loss_scale = A × D`` cancels Lightning's division by
    ``accumulate_grad_batches`` and DDP's average over ranks. ``train/*`` and ``regularizers/*`` are
    logged once per optimizer step from torchmetrics sum states (exact global values); ``val/loss`` is
    the global value over the validation set; ``telemetry`` holds the last step as a nested dict.
    Regularizer weights and enabled flags are saved in checkpoints.

    Args:
        head_backend: output-head backend (``auto``, ``chunked``, ``naive``, ``torch``, ``liger``).
        head_chunk_size: tokens per chunk of the fused head (default: from a memory budget).
        loss_agg: aggregation mode of the base loss (``token-mean``, ``token-sum``,
            ``seq-mean-token-sum``, ``seq-mean-token-mean``).
        optimizer: AdamW and learning-rate schedule settings.
        ignore_index: label value of positions without a target.
        check_finite: check hidden states for NaN/Inf before the head.
        regularizers: loss terms (`RegularizerSpec`; from YAML a list of dicts with its fields).
        regularizer_grad_norm: log each term's gradient norm w.r.t. the per-token log-probabilities.
        base_loss_weight: weight of the base cross-entropy (0: the regularizers are the whole loss).
    """

    def __init__(
        self,
        head_backend: str = "auto",
        head_chunk_size: int | None = None,
        loss_agg: str = "token-mean",
        optimizer: OptimizerConfig | None = None,
        ignore_index: int = -100,
        check_finite: bool = True,
        regularizers: list[RegularizerSpec] | None = None,
        regularizer_grad_norm: bool = False,
        base_loss_weight: float = 1.0,
    ) -> None:
        super().__init__()
        if head_backend not in BACKENDS:
            raise ConfigError(f"unknown model.head_backend {head_backend!r}; choose among {BACKENDS}")
        check_mode(loss_agg, "model.loss_agg")
        self.save_hyperparameters()
        self.head_backend, self.head_chunk_size = head_backend, head_chunk_size
        self.loss_agg, self.ignore_index, self.check_finite = loss_agg, ignore_index, check_finite
        self.optimizer_config = OptimizerConfig(**optimizer) if isinstance(optimizer, dict) else optimizer
        self.optimizer_config = self.optimizer_config or OptimizerConfig()
        self.regularizer_set = RegularizerSet(regularizers or (), loss_agg, regularizer_grad_norm)
        if base_loss_weight < 0:
            raise ConfigError(f"model.base_loss_weight must be >= 0, got {base_loss_weight}")
        self.base_loss_weight = float(base_loss_weight)
        self.val_loss = MeanMetric()
        self.val_loss_total = MeanMetric()
        self.telemetry: dict[str, Any] = {}
        """The last optimizer step's values as a nested dict (``loss_total``, ``base_loss``,
        ``regularizer_total``, ``regularizers: {name: {value, weight, contribution, custom}}``)."""

    # ---- subclass contract -------------------------------------------------------------------
    def forward_hidden(self, batch: dict[str, Tensor]) -> Tensor:
        """Hidden states ``[B, T, D]`` of the model body for ``batch``."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward_hidden(batch)")

    def output_projection(self) -> tuple[Tensor, Tensor | None]:
        """The output projection ``(weight [V, D], bias [V] | None)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement output_projection()")

    # ---- head --------------------------------------------------------------------------------
    def output_head(self) -> FusedLMHead:
        weight, bias = self.output_projection()
        return FusedLMHead(
            weight,
            bias,
            backend=self.head_backend,
            chunk_size=self.head_chunk_size,
            ignore_index=self.ignore_index,
            check_finite=self.check_finite,
        )

    def forward_logits(self, batch: dict[str, Tensor]) -> Tensor:
        """Full logits ``[B, T, V]`` (inference)."""
        return self.output_head().forward_logits(self.forward_hidden(batch))

    # ---- plug points -------------------------------------------------------------------------
    def global_stats(self, batch: dict[str, Any], stage: str) -> GlobalStats:
        """Counts to normalize by.

        In training, the `GlobalStats` attached by `GlobalStatsLoader` (global counts of the optimizer
        step, ``loss_scale = A × D``); without it, or in validation and prediction, this micro-batch's
        own counts with ``loss_scale = 1`` (per-micro-batch normalization).
        """
        attached = batch.get(GLOBAL_STATS_KEY)
        if stage == "train" and isinstance(attached, GlobalStats):
            return attached
        if stage == "train" and self._trainer is not None and self._accumulation_factor() > 1:
            self._warn_local_normalization()
        return GlobalStats.local_only(batch, self.mask_keys(), self.ignore_index)

    def mask_keys(self) -> tuple[str, ...]:
        """Mask keys whose global counts the loss terms need (``"labels"``: ``labels != ignore_index``)."""
        return (LABELS_KEY, *self.regularizer_set.mask_keys())

    def head_outputs_needed(self) -> tuple[str, ...]:
        """Head outputs consumed by the loss terms (the base loss alone needs only ``logprobs``)."""
        needed = tuple(n for n in self.regularizer_set.needs() if n != "hidden")
        if self.base_loss_weight == 0 and not needed:
            return ("logprobs",)
        return needed

    def regularize(self, ctx: LossContext) -> tuple[Tensor, dict[str, dict[str, Any]]]:
        """Weighted sum of the regularizer terms and their telemetry (`RegularizerSet`)."""
        return self.regularizer_set(ctx)

    # ---- the loss ----------------------------------------------------------------------------
    def compute_loss(self, batch: dict[str, Any], stage: str = "train") -> LossOutput:
        """Loss of one micro-batch, normalized by the global counts (before ``loss_scale``)."""
        labels = self._batch_tensor(batch, "labels")
        hidden = self.forward_hidden(batch)
        mask = labels != self.ignore_index
        stats = self.global_stats(batch, stage)
        accum_dtype = torch.promote_types(hidden.dtype, torch.float32)
        weights = token_weights(
            mask, self.loss_agg, stats.get(LABELS_KEY), batch.get("segment_ids"), accum_dtype
        )
        if stage == "train" and stats.position == 0 and stats.get(LABELS_KEY).num_tokens == 0:
            rank_zero_warn(
                f"optimizer step {self.global_step} has no valid label in any micro-batch; "
                "its loss is 0 with zero gradients"
            )
        head = self.output_head()
        extra = self.head_outputs_needed()
        terms = self.regularizer_set
        if stage == "train" and extra and torch.is_grad_enabled() and terms.fusable():
            # every term is pointwise: evaluated chunk by chunk inside the head, gradients in forward
            chunk_loss, finish = terms.fused_chunk_loss(
                batch, mask, stats, int(self.global_step), weights[mask], self.base_loss_weight
            )
            total = head.pointwise_loss(hidden, labels, chunk_loss, with_entropy="entropy" in extra)
            base, reg_total, telemetry = finish()
            num_tokens = stats.get_local(LABELS_KEY).num_tokens
            return LossOutput(total, base, reg_total, stats, telemetry, num_tokens)
        if stage == "train" and not extra:
            base = head.weighted_ce(hidden, labels, weights)
            head_out = HeadOutput()
        else:
            head_out = head(hidden, labels, ("logprobs", *[o for o in extra if o != "logprobs"]))
            base = -(weights.to(head_out.logprobs.dtype) * head_out.logprobs).sum()
        ctx = LossContext(batch, head_out, hidden, mask, stats, int(self.global_step), stage)
        reg_total, terms = self.regularize(ctx)
        num_tokens = stats.get_local(LABELS_KEY).num_tokens
        total = (base if self.base_loss_weight == 1.0 else self.base_loss_weight * base) + reg_total
        return LossOutput(total, base, reg_total, stats, terms, num_tokens)

    @staticmethod
    def _batch_tensor(batch: dict[str, Any], key: str) -> Tensor:
        if key not in batch:
            raise KeyError(f"batch key {key!r} is missing; the batch has keys {sorted(batch)}")
        return batch[key]

    # ---- Lightning hooks ---------------------------------------------------------------------
    def on_train_start(self) -> None:
        """Configure every `GlobalStatsLoader` of the fit with the trainer's and the loss terms' needs."""
        trainer = self.trainer

        def configure(loader: GlobalStatsLoader) -> None:
            loader.configure(
                trainer.accumulate_grad_batches,
                self.mask_keys(),
                self.ignore_index,
                trainer.num_training_batches,
            )

        apply_to_collection(trainer.train_dataloader, GlobalStatsLoader, configure)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        out = self.compute_loss(batch, "train")
        stats = out.stats
        accumulate = self.trainer.accumulate_grad_batches if self._trainer is not None else 1
        if isinstance(batch.get(GLOBAL_STATS_KEY), GlobalStats) and batch_idx % accumulate != stats.position:
            raise RuntimeError(
                f"GlobalStatsLoader window out of step with Lightning's accumulation: batch {batch_idx} is "
                f"micro-batch {stats.position} of its window, Lightning expects {batch_idx % accumulate}"
            )
        # what Lightning (÷A) and DDP (÷D) make of this micro-batch's loss: its share of the step's loss
        share = stats.loss_scale / self._accumulation_factor()
        values = out.logged_values("train")
        self._step_sums(tuple(values)).update({k: v * share for k, v in values.items()})
        self.__dict__["_last_terms"] = out.terms
        if self._window_ends(batch_idx):
            self._log_step_sums()
        return out.total * stats.loss_scale

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        out = self.compute_loss(batch, "val")
        weight = mode_denominator(self.loss_agg, out.stats.get_local(LABELS_KEY))
        if weight:
            # Σ value·count / Σ count over every micro-batch of every rank (sum states, exact in DDP)
            self.val_loss.update(out.base.detach(), weight=weight)
            self.val_loss_total.update(out.total.detach(), weight=weight)
        self.log("val/loss", self.val_loss, prog_bar=True, on_step=False, on_epoch=True)
        self.log("val/loss_total", self.val_loss_total, on_step=False, on_epoch=True)

    # ---- step telemetry ----------------------------------------------------------------------
    def _accumulation_factor(self) -> int:
        """``A × D``: what Lightning and DDP divide a micro-batch's gradient by."""
        if self._trainer is None:
            return 1
        return int(self.trainer.accumulate_grad_batches) * int(self.trainer.world_size)

    def _window_ends(self, batch_idx: int) -> bool:
        if self._trainer is None:
            return True
        num_batches = self.trainer.num_training_batches
        return (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0 or batch_idx + 1 >= num_batches

    def _step_sums(self, keys: tuple[str, ...]) -> StepSums:
        sums = self.__dict__.get("_train_step_sums")
        if sums is None:
            sums = StepSums(keys).to(self.device)
            self.__dict__["_train_step_sums"] = sums  # not a submodule: no state in checkpoints
        elif sums.keys != keys:
            raise RuntimeError(f"the logged loss terms changed during training: {sums.keys} -> {keys}")
        return sums

    def _log_step_sums(self) -> None:
        sums = self.__dict__["_train_step_sums"]
        values = {}
        for key, value in sums.compute().items():
            if key.endswith("/grad_norm_sq"):
                key, value = key.removesuffix("_sq"), value.clamp_min(0).sqrt()
            elif key.endswith("/error"):
                value = (value > 0).to(value.dtype)
            values[key] = value.float()
        sums.reset()
        terms = self.regularizer_set
        for name in terms.terms:
            weight = terms.effective_weight(name, self.global_step)
            values[f"regularizers/{name}/weight"] = torch.tensor(weight, dtype=torch.float64)
        last = self.__dict__.get("_last_terms", {})
        for name, term in last.items():
            for key, value in term.get("custom", {}).items():
                values[f"regularizers/{name}/custom/{key}"] = torch.tensor(value, dtype=torch.float64)
        for key, value in values.items():
            self.log(key, value, prog_bar=key == "train/loss_total", on_step=True, on_epoch=False)
        self.telemetry = _nested_telemetry(values, last)

    def _warn_local_normalization(self) -> None:
        if not self.__dict__.get("_warned_local_normalization"):
            self.__dict__["_warned_local_normalization"] = True
            rank_zero_warn(
                "training batches carry no global statistics: each micro-batch is normalized by its own "
                "counts, which biases the gradient when accumulate_grad_batches × world_size > 1 and the "
                "counts differ; use lit_losses.GlobalStatsLoader for the train dataloader"
            )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Save the regularizers' run-time weights and enabled flags; keep hyper-parameters plain data.

        Dataclass configs become dicts and callables their import paths, so that checkpoints load with
        ``torch.load(weights_only=True)`` (Lightning's default) and ``load_from_checkpoint`` rebuilds them.
        """
        checkpoint["lit_losses_regularizers"] = self.regularizer_set.state_dict()
        if "hyper_parameters" in checkpoint:
            checkpoint["hyper_parameters"] = plain_data(checkpoint["hyper_parameters"])

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the regularizers' weights and enabled flags in force at the checkpoint."""
        if "lit_losses_regularizers" in checkpoint:
            self.regularizer_set.load_state_dict(checkpoint["lit_losses_regularizers"])

    def teardown(self, stage: str) -> None:
        self.regularizer_set.close()

    def predict_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        """Per-token log-probabilities ``[B, T]`` of the labels (0 at ignored positions)."""
        labels = self._batch_tensor(batch, "labels")
        return self.output_head()(self.forward_hidden(batch), labels, "logprobs").logprobs

    def configure_optimizers(self) -> dict[str, Any]:
        total = int(self.trainer.estimated_stepping_batches) if self._trainer is not None else 1
        optimizer, scheduler = build_optimizer(self, self.optimizer_config, max(total, 1))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def plain_data(value: Any) -> Any:
    """``value`` with dataclasses as dicts and callables as import paths (``module.qualname``)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: plain_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(plain_data(v) for v in value)
    if callable(value) and not isinstance(value, type):
        module, name = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
        if module and name and "<" not in name:
            return f"{module}.{name}"
        return repr(value)
    return value


def _nested_telemetry(values: dict[str, Tensor], last_terms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def get(key: str) -> float:
        return float(values[key]) if key in values else 0.0

    regularizers = {}
    for name, term in last_terms.items():
        prefix = f"regularizers/{name}"
        regularizers[name] = {
            "value": get(f"{prefix}/value"),
            "weight": get(f"{prefix}/weight"),
            "contribution": get(f"{prefix}/contribution"),
            "custom": dict(term.get("custom", {})),
        }
        if f"{prefix}/grad_norm" in values:
            regularizers[name]["grad_norm"] = get(f"{prefix}/grad_norm")
        regularizers[name]["error"] = get(f"{prefix}/error")
    return {
        "loss_total": get("train/loss_total"),
        "base_loss": get("train/base_loss"),
        "regularizer_total": get("train/regularizer_total"),
        "regularizers": regularizers,
    }


__all__ = ["AGG_MODES", "LossContext", "LossOutput", "RegularizedLM"]
