"""`Objective`: the loss of one micro-batch, and the one choice of the path that computes it."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import Tensor

from lit_losses.aggregation import LABELS_KEY, AggMode, GlobalStats, check_mode, token_weights
from lit_losses.aggregation.stats import batch_segment_ids
from lit_losses.errors import ConfigError
from lit_losses.heads import FusedLMHead, HeadOutput
from lit_losses.loss.context import LossContext, LossOutput, Stage
from lit_losses.regularizers import FusedTerms, RegularizerError, RegularizerSet, TermResult

LossPath = Literal["plain_ce", "fused", "general"]
Regularize = Callable[[LossContext], tuple[Tensor, dict[str, TermResult]]]


def batch_tensor(batch: Mapping[str, Any], key: str) -> Tensor:
    """``batch[key]``, or a `KeyError` that lists the keys the batch has."""
    if key not in batch:
        raise KeyError(f"batch key {key!r} is missing; the batch has keys {sorted(batch)}")
    return batch[key]


class Objective:
    """``total = w_base · base + Σ_i w_i · r_i`` for one micro-batch, normalized by global counts.

    ``base = Σ_t a_t · (−log p_t[y_t])`` with the aggregation weights ``a`` of ``loss_agg`` (see
    `lit_losses.aggregation.token_weights`); the regularizers are a `RegularizerSet`. `path` is the
    one place where the computation is chosen:

    - ``plain_ce``: training with the base loss alone: the head's fused cross-entropy fast path
      (every gradient computed in forward, no logits recompute).
    - ``fused``: training where every enabled term is pointwise (`RegularizerSet.fusable`): the terms
      run chunk by chunk inside the head, gradients in forward as well.
    - ``general``: anything else (and validation): per-token head outputs with autograd, then the
      terms on a `LossContext`.

    Args:
        regularizers: the loss terms.
        loss_agg: aggregation mode of the base loss.
        base_loss_weight: ``w_base`` (0: the regularizers are the whole loss).

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
    """

    def __init__(
        self, regularizers: RegularizerSet, loss_agg: AggMode = "token-mean", base_loss_weight: float = 1.0
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
        self.regularizers, self.loss_agg = regularizers, loss_agg
        self.base_loss_weight = float(base_loss_weight)
        self._warnings = WarningCache()

    def head_outputs_needed(self) -> tuple[str, ...]:
        """Head outputs consumed by the loss terms (the base loss alone needs only ``logprobs``)."""
        needed = tuple(n for n in self.regularizers.needs() if n != "hidden")
        if self.base_loss_weight == 0 and not needed:
            return ("logprobs",)
        return needed

    def mask_keys(self) -> tuple[str, ...]:
        """Mask keys whose global counts the loss terms need (``"labels"``: ``labels != ignore_index``)."""
        return (LABELS_KEY, *self.regularizers.mask_keys())

    def path(self, stage: Stage, needed: tuple[str, ...]) -> LossPath:
        """Which computation `__call__` takes (see the class docstring)."""
        if stage != "train":
            return "general"
        if not needed:
            return "plain_ce"
        return "fused" if torch.is_grad_enabled() and self.regularizers.fusable() else "general"

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
    ) -> LossOutput:
        """The `LossOutput` of one micro-batch (before ``stats.loss_scale``).

        Args:
            head: the output head over the model's output projection.
            hidden: hidden states ``[B, T, D]``.
            batch: the micro-batch (``labels`` and whatever the terms read).
            stats: the counts to normalize by.
            step: the optimizer step.
            stage: ``train``, ``val`` or ``predict``.
            needed: head outputs the terms consume (default: `head_outputs_needed`).
            regularize: the general path's terms (default: the `RegularizerSet`).
        """
        labels = batch_tensor(batch, "labels")
        mask = labels != head.ignore_index
        needed = self.head_outputs_needed() if needed is None else needed
        accum_dtype = torch.promote_types(hidden.dtype, torch.float32)
        weights = token_weights(
            mask, self.loss_agg, stats.get(LABELS_KEY), batch_segment_ids(batch), accum_dtype
        )
        if stage == "train" and stats.position == 0 and stats.get(LABELS_KEY).num_tokens == 0:
            self._warnings.warn(
                f"optimizer step {step} has no valid label in any micro-batch; "
                "its loss is 0 with zero gradients"
            )
        num_tokens = stats.get_local(LABELS_KEY).num_tokens
        path = self.path(stage, needed)
        if path == "fused":
            fused = FusedTerms(
                self.regularizers, batch, mask, stats, step, weights[mask], self.base_loss_weight
            )
            total = head.pointwise_loss(
                hidden, labels, fused, with_entropy="entropy" in needed, needs=("logprobs", *needed)
            )
            base, reg_total, terms = fused.finish()
            return LossOutput(total, base, reg_total, stats, terms, num_tokens)
        if path == "plain_ce":
            base = head.weighted_ce(hidden, labels, weights)
            head_out = HeadOutput()
        else:
            head_out = head(hidden, labels, ("logprobs", *[o for o in needed if o != "logprobs"]))
            base = -(weights.to(head_out.logprobs.dtype) * head_out.logprobs).sum()
        ctx = LossContext(batch, head_out, hidden, mask, stats, step, stage)
        reg_total, terms = (regularize or self.regularizers)(ctx)
        if stage == "train" and self.base_loss_weight == 0 and torch.is_grad_enabled():
            check_something_to_optimize(reg_total, terms, f"step {step}")
        total = (base if self.base_loss_weight == 1.0 else self.base_loss_weight * base) + reg_total
        return LossOutput(total, base, reg_total, stats, terms, num_tokens)


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
