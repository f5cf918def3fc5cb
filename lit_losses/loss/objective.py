"""`Objective`: the loss of one micro-batch, and the one choice of the path that computes it."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import Tensor

from lit_losses.aggregation import LABELS_KEY, AggMode, GlobalStats, check_mode, token_weights
from lit_losses.aggregation.modes import NORM_MODE, check_norm
from lit_losses.aggregation.stats import batch_segment_ids
from lit_losses.errors import ConfigError
from lit_losses.heads import FusedLMHead, HeadOutput
from lit_losses.loss.context import LossContext, LossOutput, Stage, logprobs_first
from lit_losses.loss.distillation import Distillation, DistillationStep, Teacher
from lit_losses.loss.preference import (
    CHOSEN_MASK,
    PreferenceLoss,
    PreferenceStep,
    Reference,
    check_preference_options,
)
from lit_losses.loss.preference_unpaired import DESIRABLE_MASK, PolicyNoGrad, UnpairedPreferenceLoss
from lit_losses.loss.token_metrics import TokenMetrics
from lit_losses.objectives import (
    LOSS_WEIGHTS,
    SAMPLE_WEIGHTS,
    BaseLossBatch,
    BoundBaseLoss,
    KTOPreset,
    PreferencePreset,
    token_values,
)
from lit_losses.objectives.distillation import DistillationConfig, check_distillation_options
from lit_losses.objectives.inputs import ROLLOUT_VALID
from lit_losses.objectives.options import check_flag
from lit_losses.objectives.presets import GRPOPreset, apply_preset
from lit_losses.regularizers import FusedTerms, RegularizerError, RegularizerSet, RegularizerSpec, TermResult

LossPath = Literal["plain_ce", "fused", "general", "preference", "distillation"]
Regularize = Callable[[LossContext], tuple[Tensor, dict[str, TermResult]]]


def batch_tensor(batch: Mapping[str, Any], key: str) -> Tensor:
    """``batch[key]``, or a `KeyError` that lists the keys the batch has."""
    if key not in batch:
        raise KeyError(f"batch key {key!r} is missing; the batch has keys {sorted(batch)}")
    return batch[key]


class Objective:
    """``total = w_base · base + Σ_i w_i · r_i`` for one micro-batch, normalized by global counts.

    ``base = Σ_t a_t · u_t · v_t · L_t``: the per-token base loss ``L_t`` (``base_loss``, by name:
    ``cross_entropy`` ``−log p_t[y_t]`` by default, or a policy-gradient loss of `lit_losses.objectives`),
    weighted by the batch's ``loss_weights`` ``v`` and ``sample_weights`` ``u`` when it has them (1
    otherwise) and by the aggregation weights ``a`` of ``loss_agg`` (`lit_losses.aggregation.token_weights`);
    the regularizers are a `RegularizerSet`. `path` is the one place where the computation is chosen:

    - ``plain_ce``: training with the ``cross_entropy`` base loss alone: the head's fused cross-entropy
      fast path (every gradient computed in forward, no logits recompute).
    - ``fused``: training where the base loss and every enabled term are pointwise (`RegularizerSet.fusable`,
      e.g. ``ppo`` + ``kl_reference`` + ``entropy``): chunk by chunk inside the head, gradients in forward.
    - ``general``: anything else (validation; a base loss that needs whole sequences, e.g. GSPO's
      sequence ratios): per-token head outputs with autograd, then the terms on a `LossContext`. Both
      pointwise paths evaluate the base loss with the same code on the valid tokens (row-major).
    - ``preference``: a preference preset (``model.dpo``, ``model.cpo``, ``model.orpo``, ``model.kto``) is
      the base loss: per-token head outputs with autograd, the preset's loss of each pair (or sequence)
      over the step's pairs (`PreferenceLoss`; sequences: `UnpairedPreferenceLoss`), then the terms on a
      `LossContext` as on the general path.
    - ``distillation``: ``model.distillation`` is the base loss: the divergence to a teacher (and the
      hard-label cross-entropy) aggregated with ``loss_agg`` (`Distillation`), then the terms on a
      `LossContext` as on the general path.

    Args:
        regularizers: the loss terms.
        loss_agg: aggregation mode of the base loss.
        base_loss_weight: ``w_base`` (0: the regularizers are the whole loss).
        base_loss: the base loss by name (`lit_losses.objectives.BASE_LOSSES`) or import path.
        base_loss_args: its parameters (Tinker's ``loss_fn_config`` names, e.g. ``clip_low_threshold``).
        loss_agg_norm: the constant ``C`` of ``seq-mean-token-sum-norm`` (required when the base loss or a
            regularizer aggregates with it); it applies to the regularizers as well.
        preference: a preference preset whose loss replaces ``base_loss`` (`PreferenceLoss`).
        distillation: logit distillation from a teacher, replacing ``base_loss`` (`Distillation`).
        token_metrics: add TRL's per-token metrics of the loss's trainer to `LossOutput.metrics`
            (`TokenMetrics`: ``entropy``, ``mean_token_accuracy``, ``num_tokens``, ``logits/chosen``,
            ``logits/rejected``); one more no-grad forward pass of the head over the valid tokens.

    Raises:
        ConfigError: bad options, each naming its ``model.…`` path.

    Example:
        >>> import torch
        >>> from lit_losses.aggregation import GlobalStats
        >>> from lit_losses.heads import FusedLMHead
        >>> from lit_losses.regularizers import RegularizerSet
        >>> head = FusedLMHead(torch.zeros(4, 3))  # uniform over 4 tokens: −log p = log 4
        >>> batch = {"labels": torch.tensor([[1, 2, -100]])}
        >>> objective = Objective(RegularizerSet())
        >>> objective.path("train", objective.head_outputs_needed())
        'plain_ce'
        >>> out = objective(head, torch.randn(1, 3, 3), batch, GlobalStats.local_only(batch), 0, "train")
        >>> round(float(out.total), 4)  # log 4
        1.3863
        >>> ppo = Objective(RegularizerSet(), base_loss="ppo", base_loss_args={"clip_high_threshold": 1.28})
        >>> ppo.path("train", ppo.head_outputs_needed())
        'fused'
        >>> batch |= {"sampling_logprobs": torch.full((1, 3), -1.0), "advantages": torch.ones(1, 3)}
        >>> out = ppo(head, torch.randn(1, 3, 3), batch, GlobalStats.local_only(batch), 0, "train")
        >>> round(float(out.total), 4), float(out.base_metrics["clip_fraction"])  # r = e^(1 − log 4) ≈ 0.68
        (-0.6796, 0.0)
    """

    def __init__(
        self,
        regularizers: RegularizerSet,
        loss_agg: AggMode = "token-mean",
        base_loss_weight: float = 1.0,
        base_loss: str = "cross_entropy",
        base_loss_args: Mapping[str, Any] | None = None,
        loss_agg_norm: float | None = None,
        preference: PreferencePreset | None = None,
        distillation: DistillationConfig | None = None,
        token_metrics: bool = False,
    ) -> None:
        check_mode(loss_agg, "model.loss_agg")
        if not isinstance(base_loss_weight, int | float) or isinstance(base_loss_weight, bool):
            raise ConfigError(f"model.base_loss_weight must be a number, got {base_loss_weight!r}")
        if not base_loss_weight >= 0 or not math.isfinite(base_loss_weight):
            raise ConfigError(f"model.base_loss_weight must be >= 0 and finite, got {base_loss_weight}")
        if base_loss_weight == 0 and len(regularizers) == 0:
            raise ConfigError(
                "model.base_loss_weight is 0 and model.regularizers is empty: nothing to optimize "
                "(add a regularizer or give the base loss a weight > 0)"
            )
        self.regularizers = regularizers
        self.loss_agg = loss_agg
        self.base_loss_weight = float(base_loss_weight)
        self.base_loss = BoundBaseLoss.resolve(base_loss, base_loss_args)
        self.loss_agg_norm = regularizers.agg_norm = agg_norm_option(loss_agg_norm, loss_agg, regularizers)
        self.preference = preference_loss(preference)
        self.distillation = None if distillation is None else Distillation(distillation)
        self.token_metrics = token_metrics_of(preference) if token_metrics else None
        self._warnings = WarningCache()

    @classmethod
    def from_options(
        cls,
        regularizers: Sequence[RegularizerSpec | Mapping[str, Any]] | None = None,
        loss_agg: AggMode = "token-mean",
        base_loss_weight: float = 1.0,
        regularizer_grad_norm: bool = False,
        base_loss: str = "cross_entropy",
        base_loss_args: Mapping[str, Any] | None = None,
        loss_agg_norm: float | None = None,
        grpo: GRPOPreset | Mapping[str, Any] | None = None,
        preference: PreferencePreset | None = None,
        distillation: DistillationConfig | Mapping[str, Any] | None = None,
        token_metrics: bool = False,
    ) -> Objective:
        """The objective of `RegularizedLM`'s options, every one checked (a `ConfigError` naming
        ``model.<option>``); ``grpo`` (`apply_preset`) sets the base loss, its aggregation and KL term;
        ``preference`` replaces the base loss (`check_preference_options`), and so does ``distillation``
        (`check_distillation_options`)."""
        distillation = DistillationConfig.coerce(distillation)
        if distillation is not None:
            check_distillation_options(
                base_loss=base_loss, base_loss_args=base_loss_args, grpo=grpo, preference=preference
            )
        if preference is not None:
            check_preference_options(
                preference,
                base_loss=base_loss,
                base_loss_args=base_loss_args,
                loss_agg=loss_agg,
                loss_agg_norm=loss_agg_norm,
                grpo=grpo,
            )
        if grpo is not None:
            given = {"base_loss": base_loss, "base_loss_args": base_loss_args, "loss_agg": loss_agg}
            preset = GRPOPreset.coerce(grpo)
            options = apply_preset(preset, **given, loss_agg_norm=loss_agg_norm, terms=regularizers)
            scales = {"base_loss_weight": base_loss_weight, "regularizer_grad_norm": regularizer_grad_norm}
            objective = cls.from_options(**options, **scales, token_metrics=token_metrics)
            if objective.token_metrics is not None:  # GRPOTrainer's set, not SFT's
                objective.token_metrics = TokenMetrics("grpo")
            return objective
        terms = RegularizerSet(regularizers or (), loss_agg, regularizer_grad_norm)
        return cls(
            terms,
            loss_agg=loss_agg,
            base_loss_weight=base_loss_weight,
            base_loss=base_loss,
            base_loss_args=base_loss_args,
            loss_agg_norm=loss_agg_norm,
            preference=preference,
            distillation=distillation,
            token_metrics=check_flag(token_metrics, "model.token_metrics"),
        )

    def head_outputs_needed(self) -> tuple[str, ...]:
        """Head outputs consumed by the loss terms (empty: ``cross_entropy`` alone, the fast path)."""
        needed = tuple(n for n in self.regularizers.needs() if n != "hidden")
        if self.distillation is not None:  # the base loss computes its own; the hard CE fused when alone
            return needed
        if self.preference is not None:
            return logprobs_first(needed)
        if not self.base_loss.plain_ce and self.base_loss_weight > 0 and "logprobs" not in needed:
            return ("logprobs", *needed)
        if self.base_loss_weight == 0 and not needed:
            return ("logprobs",)
        return needed

    def mask_keys(self) -> tuple[str, ...]:
        """Mask keys whose global counts the loss terms need (``"labels"``: ``labels != ignore_index``;
        ``"rollout_valid"``: the completion tokens before a rollout rejection, `rejects`)."""
        metrics = () if self.token_metrics is None else self.token_metrics.mask_keys()
        if self.preference is not None:
            keys = (*self.preference.mask_keys(), *metrics, *self.regularizers.mask_keys())
            return tuple(dict.fromkeys(keys))
        rollout = (ROLLOUT_VALID,) if self.rejects else ()
        return tuple(dict.fromkeys((LABELS_KEY, *rollout, *metrics, *self.regularizers.mask_keys())))

    def metric_names(self, stage: Stage = "train") -> tuple[str, ...]:
        """The names of the loss's `LossOutput.metrics` in ``stage`` (the preference losses' TRL metrics,
        the token metrics), or none."""
        if self.distillation is not None:
            names = self.distillation.metric_names()
        else:
            names = () if self.preference is None else self.preference.metric_names()
        return names if self.token_metrics is None else (*names, *self.token_metrics.metric_names(stage))

    @property
    def rejects(self) -> bool:
        """The base loss rejects rollout tokens (verl's ``rollout_rs``): batches go through `reject`
        before their tokens are counted."""
        correction = self.base_loss.correction
        return correction is not None and correction.rejects

    def reject(self, batch: dict[str, Any], ignore_index: int = -100) -> dict[str, Any]:
        """``batch`` with the rejected rollout tokens' labels set to ``ignore_index`` (and their mask of
        before as ``rollout_valid``): what the step's counts and loss must see (`BoundBaseLoss.reject`;
        ``batch`` itself without a rejection, or when it was applied already)."""
        return self.base_loss.reject(batch, ignore_index)

    def path(self, stage: Stage, needed: tuple[str, ...], batch: Mapping[str, Any] | None = None) -> LossPath:
        """Which computation `__call__` takes (see the class docstring); ``batch``: the micro-batch, when
        known (a sequence-level rollout correction is pointwise on a batch with ``old_logprobs``)."""
        if self.distillation is not None:
            return "distillation"
        if self.preference is not None:
            return "preference"
        if stage != "train":
            return "general"
        if not needed:
            return "plain_ce"
        pointwise = self.base_loss.pointwise if batch is None else self.base_loss.pointwise_for(batch)
        if not torch.is_grad_enabled() or not pointwise:
            return "general"
        if self.regularizers.active():
            return "fused" if self.regularizers.fusable() else "general"
        # no term: the base loss alone (cross_entropy here only when forced to per-token outputs)
        return "fused" if not self.base_loss.plain_ce and self.base_loss_weight > 0 else "general"

    def __call__(
        self,
        head: FusedLMHead,
        hidden: Tensor,
        batch: Mapping[str, Any],
        stats: GlobalStats,
        step: int,
        stage: Stage,
        needed: tuple[str, ...] | None = None,
        regularize: Regularize | None = None,
        reference: Reference | None = None,
        policy: PolicyNoGrad | None = None,
        teacher: Teacher | None = None,
    ) -> LossOutput:
        """The `LossOutput` of one micro-batch (before ``stats.loss_scale``), with the token metrics
        (`TokenMetrics`) when they are on.

        Args:
            head: the output head over the model's output projection.
            hidden: hidden states ``[B, T, D]``.
            batch: the micro-batch (``labels`` and whatever the terms read).
            stats: the counts to normalize by.
            step: the optimizer step.
            stage: ``train``, ``val`` or ``predict``.
            needed: head outputs the terms consume (default: `head_outputs_needed`).
            regularize: the general path's terms (default: the `RegularizerSet`).
            reference: a frozen reference's log-probabilities, for a preference loss that reads them.
            policy: the policy's log-probabilities without gradient (KTO's KL rows).
            teacher: the frozen teacher's hidden states and output projection, for ``distillation``.
        """
        if self.distillation is not None:
            ctx = self.distillation_context(
                head, hidden, batch=batch, stats=stats, step=step, stage=stage, needed=needed, teacher=teacher
            )
            out = self.general_output(ctx, regularize=regularize)
        elif self.preference is not None:
            ctx = self.preference_context(
                head,
                hidden,
                batch=batch,
                stats=stats,
                step=step,
                stage=stage,
                needed=needed,
                reference=reference,
                policy=policy,
            )
            out = self.general_output(ctx, regularize=regularize)
        else:
            out = self.token_loss(
                head,
                hidden,
                batch=batch,
                stats=stats,
                step=step,
                stage=stage,
                needed=needed,
                regularize=regularize,
            )
        if self.token_metrics is not None and stage != "predict":
            values, weights = self.token_metrics(head, hidden, batch=batch, stats=stats, stage=stage)
            out.metrics = {**out.metrics, **values}
            out.metric_weights = {**out.metric_weights, **weights}
        return out

    def token_loss(
        self,
        head: FusedLMHead,
        hidden: Tensor,
        batch: Mapping[str, Any],
        stats: GlobalStats,
        step: int,
        stage: Stage,
        needed: tuple[str, ...] | None,
        regularize: Regularize | None,
    ) -> LossOutput:
        """The token-level loss (the base loss over the labelled tokens and the regularizers) of one
        micro-batch, without the token metrics; the arguments are `__call__`'s."""
        labels = batch_tensor(batch, "labels")
        mask = labels != head.ignore_index
        needed = self.head_outputs_needed() if needed is None else needed
        accum_dtype = torch.promote_types(hidden.dtype, torch.float32)
        weights = self.base_weights(batch, mask=mask, stats=stats, dtype=accum_dtype)
        if stage == "train" and stats.position == 0 and stats.get(LABELS_KEY).num_tokens == 0:
            self._warnings.warn(
                f"optimizer step {step} has no valid label in any micro-batch; "
                "its loss is 0 with zero gradients"
            )
        num_tokens = stats.get_local(LABELS_KEY).num_tokens
        path = self.path(stage, needed, batch)
        base_batch = None if self.base_loss.plain_ce else self.base_loss.for_batch(batch, mask, accum_dtype)
        if path == "fused":  # the base loss and the terms chunk by chunk inside the head
            fused = FusedTerms(
                self.regularizers,
                batch=batch,
                mask=mask,
                stats=stats,
                step=step,
                base_weights=weights[mask],
                base_loss_weight=self.base_loss_weight,
                base_loss=base_batch,
            )
            total = head.pointwise_loss(
                hidden, labels, fused, with_entropy="entropy" in needed, needs=("logprobs", *needed)
            )
            base, reg_total, terms = fused.finish()
        else:  # the base loss from the head, then the terms on a LossContext
            if path == "plain_ce":
                base = head.weighted_ce(hidden, labels, weights)
                head_out = HeadOutput()
            else:
                head_out = head(hidden, labels, logprobs_first(needed))
                base = base_value(base_batch, weights=weights, logprobs=head_out.logprobs, mask=mask)
            ctx = LossContext(
                batch, head=head_out, hidden=hidden, mask=mask, stats=stats, step=step, stage=stage
            )
            total, reg_total, terms = self.add_regularizers(ctx, base=base, regularize=regularize)
        return LossOutput(
            total,
            base=base,
            regularizer_total=reg_total,
            stats=stats,
            terms=terms,
            num_tokens=num_tokens,
            base_metrics=base_metrics(base_batch, stats),
        )

    def preference_context(
        self,
        head: FusedLMHead,
        hidden: Tensor,
        batch: Mapping[str, Any],
        stats: GlobalStats,
        step: int,
        stage: Stage,
        needed: tuple[str, ...] | None,
        reference: Reference | None,
        policy: PolicyNoGrad | None = None,
    ) -> LossContext:
        """The preference loss of the micro-batch (`PreferenceLoss`), as a `LossContext` whose ``cache``
        holds its ``base`` value and ``metrics`` for `general_output`."""
        needed = self.head_outputs_needed() if needed is None else needed
        pref = self.preference(head, hidden, batch, stats, reference=reference, needed=needed, policy=policy)
        mask = batch["labels"] != head.ignore_index
        return replaced_base_context(
            pref, batch=batch, hidden=hidden, mask=mask, stats=stats, step=step, stage=stage
        )

    def distillation_context(
        self,
        head: FusedLMHead,
        hidden: Tensor,
        batch: Mapping[str, Any],
        stats: GlobalStats,
        step: int,
        stage: Stage,
        needed: tuple[str, ...] | None,
        teacher: Teacher | None,
    ) -> LossContext:
        """The distillation loss of the micro-batch (`Distillation`, aggregated with ``loss_agg``'s global
        weights), as a `LossContext` whose ``cache`` holds its ``base`` value and ``metrics``."""
        needed = self.head_outputs_needed() if needed is None else needed
        mask = batch_tensor(batch, LABELS_KEY) != head.ignore_index
        weights = self.base_weights(
            batch, mask=mask, stats=stats, dtype=torch.promote_types(hidden.dtype, torch.float32)
        )
        out = self.distillation(head, hidden, batch, weights, teacher=teacher, needed=needed)
        return replaced_base_context(
            out, batch=batch, hidden=hidden, mask=mask, stats=stats, step=step, stage=stage
        )

    def general_output(self, ctx: LossContext, regularize: Regularize | None) -> LossOutput:
        """``w_base · base + Σ_i w_i r_i`` with the base value in ``ctx.cache`` and the terms on ``ctx``."""
        base = ctx.cache["base"]
        total, reg_total, terms = self.add_regularizers(ctx, base=base, regularize=regularize)
        return LossOutput(
            total,
            base=base,
            regularizer_total=reg_total,
            stats=ctx.stats,
            terms=terms,
            num_tokens=ctx.stats.get_local(LABELS_KEY).num_tokens,
            metrics=ctx.cache.get("metrics", {}),
        )

    def add_regularizers(
        self, ctx: LossContext, base: Tensor, regularize: Regularize | None
    ) -> tuple[Tensor, Tensor, dict[str, TermResult]]:
        """``(total, Σ_i w_i r_i, terms)``: the terms on ``ctx`` (``regularize``, default the
        `RegularizerSet`) added to the base value, ``total = w_base · base + Σ_i w_i r_i``; in training
        with ``w_base = 0``, a `RegularizerError` when no term has a gradient path
        (`check_something_to_optimize`)."""
        reg_total, terms = (regularize or self.regularizers)(ctx)
        if ctx.stage == "train" and self.base_loss_weight == 0 and torch.is_grad_enabled():
            check_something_to_optimize(reg_total, terms, f"step {ctx.step}")
        total = (base if self.base_loss_weight == 1.0 else self.base_loss_weight * base) + reg_total
        return total, reg_total, terms

    def base_weights(
        self, batch: Mapping[str, Any], mask: Tensor, stats: GlobalStats, dtype: torch.dtype
    ) -> Tensor:
        """``a_t · u_t · v_t``: the aggregation weights of ``loss_agg`` (global counts, ``sample_weights``
        ``u``) times the ``loss_weights`` ``v``; absent keys count as 1 (and cost nothing)."""
        where = f"base loss {self.base_loss.name!r}"
        sample = None
        if SAMPLE_WEIGHTS in batch:
            sample = token_values(batch, key=SAMPLE_WEIGHTS, mask=mask, reader=where)
        segments = batch_segment_ids(batch)
        weights = token_weights(
            mask,
            mode=self.loss_agg,
            stats=stats.get(LABELS_KEY),
            segment_ids=segments,
            dtype=dtype,
            norm=self.loss_agg_norm,
            sample_weights=sample,
        )
        if LOSS_WEIGHTS in batch:
            loss_weights = token_values(batch, key=LOSS_WEIGHTS, mask=mask, reader=where)
            weights = weights * torch.where(mask, loss_weights.to(dtype), 0.0)
        return weights


def token_metrics_of(preference: PreferencePreset | None) -> TokenMetrics:
    """The `TokenMetrics` of a loss: its preference preset's trainer (the chosen tokens: ``chosen_mask``,
    KTO's ``desirable_mask``), else SFT's."""
    if preference is None:
        return TokenMetrics("sft")
    chosen = DESIRABLE_MASK if isinstance(preference, KTOPreset) else CHOSEN_MASK
    return TokenMetrics(preference.trainer, chosen_key=chosen)


def replaced_base_context(
    out: PreferenceStep | DistillationStep,
    *,
    batch: Mapping[str, Any],
    hidden: Tensor,
    mask: Tensor,
    stats: GlobalStats,
    step: int,
    stage: Stage,
) -> LossContext:
    """The `LossContext` of a micro-batch whose base loss a preset replaced (``out``: the preference or
    distillation loss of the micro-batch): the regularizers read its head outputs, and its ``cache`` holds
    the ``base`` value and the ``metrics`` that `Objective.general_output` adds up."""
    ctx = LossContext(
        dict(batch), head=out.head, hidden=hidden, mask=mask, stats=stats, step=step, stage=stage
    )
    ctx.cache["base"] = out.base
    ctx.cache["metrics"] = out.metrics
    return ctx


def preference_loss(preset: PreferencePreset | None) -> PreferenceLoss | UnpairedPreferenceLoss | None:
    """The loss path of a preference preset: `UnpairedPreferenceLoss` for KTO, `PreferenceLoss` for the
    paired ones."""
    if preset is None:
        return None
    return UnpairedPreferenceLoss(preset) if isinstance(preset, KTOPreset) else PreferenceLoss(preset)


def agg_norm_option(norm: Any, loss_agg: AggMode, regularizers: RegularizerSet) -> float | None:
    """``model.loss_agg_norm`` checked: required when ``loss_agg`` or a regularizer's ``agg`` is
    ``seq-mean-token-sum-norm``, else optional; a finite number > 0 when given."""
    users = ["model.loss_agg"] if loss_agg == NORM_MODE else []
    for name, term in regularizers.terms.items():
        if (term.spec.agg or regularizers.default_agg) == NORM_MODE:
            users.append(f"regularizer {name!r}")
    if norm is None and not users:
        return None
    try:
        return check_norm(norm, "model.loss_agg_norm")
    except ValueError as exc:
        raise ConfigError(f"{exc}; used by {', '.join(users)}" if users else str(exc)) from None


def base_value(base_batch: BaseLossBatch | None, weights: Tensor, logprobs: Tensor, mask: Tensor) -> Tensor:
    """``Σ_t w_t · L_t`` from per-token log-probabilities ``[B, T]`` (the general path)."""
    if base_batch is None:  # cross_entropy: L = −log p
        return -(weights.to(logprobs.dtype) * logprobs).sum()
    valid = logprobs[mask]
    return (weights[mask].to(valid.dtype) * base_batch(0, valid.shape[0], valid)).sum()


def base_metrics(base_batch: BaseLossBatch | None, stats: GlobalStats) -> dict[str, Tensor]:
    """The base loss's telemetry of one micro-batch, normalized by the step's valid tokens (a rollout
    correction's by its completion tokens before a rejection)."""
    if base_batch is None:
        return {}
    rollout = stats.get(ROLLOUT_VALID).num_tokens if ROLLOUT_VALID in stats.masks else None
    return base_batch.metrics(stats.get(LABELS_KEY).num_tokens, rollout_tokens=rollout)


def check_something_to_optimize(total: Tensor, terms: Mapping[str, TermResult], where: str) -> None:
    """Raise when ``total`` (the loss without the base term) has no gradient path and no term failed.

    A failed term skipped by its ``on_error`` policy is flagged in the telemetry instead: that step
    legitimately has zero gradient.
    """
    if total.requires_grad or any(float(t["error"]) for t in terms.values()):
        return
    raise RegularizerError(
        f"nothing to optimize at {where}: the base loss has weight 0 and no enabled regularizer has a "
        f"gradient path (regularizers: {sorted(terms) or 'none'}; enabled ones returned values without "
        "gradient or none is enabled)"
    )
