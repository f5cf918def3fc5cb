"""`Distillation`: the base loss of one micro-batch under ``model.distillation`` (`DistillationConfig`),
normalized by the counts of the whole optimizer step.

At each labelled position ``t`` (``labels != ignore_index``; the aggregation weights ``a_t`` of
``model.loss_agg`` over the step's global counts, times the batch's ``loss_weights``/``sample_weights``
when it has them):

1. the divergence ``d_t`` between the student's and the teacher's next-token distributions, logits never
   materialized: from the frozen teacher's hidden states of the same micro-batch (computed under
   ``no_grad``) and its output projection (`lit_losses.heads.linear_distillation`; in training with the
   weights ``a_t`` given, so that its gradients are computed in forward: four matmuls), or from the
   batch's offline ``teacher_topk_ids``/``teacher_topk_logprobs`` (`lit_losses.heads.topk_distillation`);
2. the hard-label cross-entropy ``c_t = −log p_t[y_t]`` of the untempered student (the head's fused
   cross-entropy when it has a weight; without gradient, for the telemetry, when it has none);
3. ``base = weight · Σ_t a_t d_t + ce_weight · Σ_t a_t c_t``, the micro-batch's share of the step's loss.

Telemetry (``<stage>/distillation/<name>``, each the micro-batch's share of the step's value, aggregated
like the loss): ``divergence`` (``Σ a_t d_t``), ``hard_ce`` (``Σ a_t c_t``) and ``top1_agreement`` (``Σ a_t
[argmax p_t = argmax q_t]``: with ``token-mean``, the fraction of the step's labelled tokens where the two
models' most probable tokens agree; offline, the teacher's first-ranked id, compared over the ids
without ``tail``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lit_losses.aggregation import LABELS_KEY
from lit_losses.errors import BatchKeyError, ConfigError
from lit_losses.heads import (
    FusedLMHead,
    HeadOutput,
    VocabParallelHead,
    linear_distillation,
    topk_distillation,
)
from lit_losses.loss.context import logprobs_first
from lit_losses.objectives.distillation import WHERE, DistillationConfig
from lit_losses.objectives.inputs import check_provided

TEACHER_TOPK_IDS = "teacher_topk_ids"
"""Batch key of the offline teacher's top-k token ids ``[B, T, k]`` (int64)."""
TEACHER_TOPK_LOGPROBS = "teacher_topk_logprobs"
"""Batch key of their log-probabilities ``[B, T, k]``."""
METRICS = ("distillation/divergence", "distillation/hard_ce", "distillation/top1_agreement")
"""The telemetry names, logged as ``<stage>/<name>``."""

Teacher = Callable[[Mapping[str, Any]], tuple[Tensor, Tensor, Tensor | None]]
"""``batch → (hidden [B, T, Dt], weight [V, Dt], bias [V] | None)`` of the frozen teacher, no gradient."""


@dataclass
class DistillationStep:
    """What `Distillation` gives for one micro-batch.

    Attributes:
        base: ``weight · D + ce_weight · CE`` (with gradient).
        head: the head's per-token outputs the regularizers need (empty when they need none).
        metrics: `METRICS`, each the micro-batch's share of the step's value.
    """

    base: Tensor
    head: HeadOutput
    metrics: dict[str, Tensor] = field(default_factory=dict)


class Distillation:
    """The base loss of one micro-batch under ``config`` (the module docstring).

    Example:
        >>> import torch
        >>> from lit_losses.heads import FusedLMHead
        >>> from lit_losses.objectives.distillation import DistillationConfig
        >>> loss = Distillation(DistillationConfig(teacher=None, loss="forward_kl"))
        >>> ids = torch.tensor([[[0, 1], [2, 3]]])  # [B=1, T=2, k=2]: the teacher's top-2 at each position
        >>> half = torch.full((1, 2, 2), -0.6931471805599453)  # log 1/2: all of its mass on the two ids
        >>> batch = {"labels": torch.tensor([[1, 2]]), "teacher_topk_ids": ids, "teacher_topk_logprobs": half}
        >>> head = FusedLMHead(torch.zeros(4, 3, dtype=torch.float64))  # the student: uniform over 4 tokens
        >>> weights = torch.full((1, 2), 0.5, dtype=torch.float64)  # token-mean over 2 tokens
        >>> step = loss(head, torch.randn(1, 2, 3, dtype=torch.float64), batch, weights, teacher=None)
        >>> round(float(step.base), 4)  # KL((1/2, 1/2, 0) ‖ (1/4, 1/4, 1/2)) = log 2
        0.6931
        >>> sorted(step.metrics)
        ['distillation/divergence', 'distillation/hard_ce', 'distillation/top1_agreement']
    """

    def __init__(self, config: DistillationConfig) -> None:
        self.config = config

    @property
    def where(self) -> str:
        """The option: ``model.distillation``."""
        return WHERE

    def batch_keys(self) -> tuple[str, ...]:
        """The batch keys the loss reads besides the model's inputs: ``labels``, and the offline teacher's."""
        offline = (TEACHER_TOPK_IDS, TEACHER_TOPK_LOGPROBS) if self.config.offline else ()
        return (LABELS_KEY, *offline)

    def metric_names(self) -> tuple[str, ...]:
        """`METRICS`."""
        return METRICS

    def check_data(self, provided: Iterable[str], source: str) -> None:
        """Before training: refuse data whose micro-batches lack a key the loss reads (`check_provided`),
        and data carrying an offline teacher's top-k beside a teacher model (they would go unused).

        Raises:
            ConfigError: one line naming the option and the data.

        Example:
            >>> loss = Distillation(DistillationConfig(teacher="initial_policy"))
            >>> loss.check_data(["input_ids", "labels", "teacher_topk_ids"], "DistillationDataModule")
            Traceback (most recent call last):
            ...
            lit_losses.errors.ConfigError: model.distillation.teacher='initial_policy' computes the ...
        """
        provided = tuple(provided)
        check_provided(reads=self.batch_keys(), provided=provided, reader=self.where, source=source)
        offline = [key for key in (TEACHER_TOPK_IDS, TEACHER_TOPK_LOGPROBS) if key in provided]
        if offline and not self.config.offline:
            teacher = self.config.teacher
            shown = (
                f"config(model_type={teacher.get('model_type')!r})"
                if isinstance(teacher, Mapping)
                else repr(teacher)
            )
            raise ConfigError(
                f"{WHERE}.teacher={shown} computes the teacher's distributions, but {source} carries an "
                f"offline teacher's ({', '.join(offline)}), which would go unused; set {WHERE}.teacher: null "
                "to train on the data's, or give the teacher model text data"
            )

    def divergence(
        self,
        head: FusedLMHead,
        hidden: Tensor,
        batch: Mapping[str, Any],
        weights: Tensor,
        teacher: Teacher | None,
    ) -> tuple[Tensor, Tensor]:
        """``(Σ_t a_t d_t, agreement [B, T])``: the aggregated divergence (a frozen teacher's in training:
        its gradients computed in forward, `linear_distillation`'s ``token_weights``) and whether the two
        models' most probable tokens agree."""
        cfg, labels = self.config, batch[LABELS_KEY]
        if isinstance(head, VocabParallelHead):
            raise ConfigError(
                f"{WHERE} needs the whole output projection; a vocabulary-parallel one is sharded"
            )
        options = dict(
            loss=cfg.loss,
            beta=cfg.beta,
            temperature=cfg.temperature,
            student_bias=head.bias,
            targets=labels,
            ignore_index=head.ignore_index,
            chunk_size=head.chunk_size,
            check_finite=head.check_finite,
            return_top1=True,
        )
        if cfg.offline:
            ids = batch_key(batch, TEACHER_TOPK_IDS)
            logprobs = batch_key(batch, TEACHER_TOPK_LOGPROBS)
            values, agree = topk_distillation(
                hidden, head.weight, ids, teacher_topk_logprobs=logprobs, tail=cfg.tail, **options
            )
            return (weights.to(values.dtype) * values).sum(), agree
        if teacher is None:
            raise ValueError(f"{WHERE}.teacher is set but no teacher was given to the loss")
        t_hidden, t_weight, t_bias = teacher(batch)
        backend = "naive" if head.backend == "naive" else "auto"
        fused = torch.is_grad_enabled() and hidden.requires_grad
        out = linear_distillation(
            hidden,
            head.weight,
            t_hidden,
            teacher_weight=t_weight,
            teacher_bias=t_bias,
            backend=backend,
            token_weights=weights if fused else None,
            **options,
        )
        return out if fused else ((weights.to(out[0].dtype) * out[0]).sum(), out[1])

    def hard_ce(
        self, head: FusedLMHead, hidden: Tensor, labels: Tensor, weights: Tensor, needed: tuple[str, ...]
    ) -> tuple[Tensor, HeadOutput]:
        """``(Σ_t a_t c_t, head outputs)``: with gradient when ``ce_weight > 0`` (from the per-token outputs
        the regularizers need, else the head's fused cross-entropy), else without (telemetry only)."""
        if needed:
            out = head(hidden, labels, logprobs_first(needed))
            return -(weights.to(out.logprobs.dtype) * out.logprobs).sum(), out
        if self.config.ce_weight > 0:
            return head.weighted_ce(hidden, labels, weights), HeadOutput()
        with torch.no_grad():
            logprobs = head(hidden.detach(), labels, ("logprobs",)).logprobs
        return -(weights.to(logprobs.dtype) * logprobs).sum(), HeadOutput()

    def __call__(
        self,
        head: FusedLMHead,
        hidden: Tensor,
        batch: Mapping[str, Any],
        weights: Tensor,
        teacher: Teacher | None,
        needed: tuple[str, ...] = (),
    ) -> DistillationStep:
        """The `DistillationStep` of one micro-batch (before ``stats.loss_scale``).

        Args:
            head: the student's output head.
            hidden: the student's hidden states ``[B, T, D]``.
            batch: the micro-batch (``labels``; offline, the teacher's top-k keys).
            weights: ``[B, T]`` aggregation weights ``a_t`` (0 at unlabelled positions).
            teacher: the frozen teacher (`Teacher`), or ``None`` offline.
            needed: head outputs the regularizers need.
        """
        cfg = self.config
        labels = batch[LABELS_KEY]
        soft, agree = self.divergence(head, hidden, batch, weights=weights, teacher=teacher)
        hard, head_out = self.hard_ce(head, hidden, labels, weights=weights, needed=needed)
        base = cfg.weight * soft if cfg.weight != 1.0 else soft
        if cfg.ce_weight > 0:
            base = base + cfg.ce_weight * hard
        metrics = {
            METRICS[0]: soft.detach(),
            METRICS[1]: hard.detach(),
            METRICS[2]: (weights.to(soft.dtype) * agree).sum(),
        }
        return DistillationStep(base, head=head_out, metrics=metrics)


def batch_key(batch: Mapping[str, Any], key: str) -> Tensor:
    """``batch[key]``, or a `BatchKeyError` naming ``model.distillation`` and the batch's keys."""
    if key not in batch:
        raise BatchKeyError(
            f"{WHERE} (teacher: null, offline top-k) reads batch key {key!r}, which the batch lacks (it has "
            f"{sorted(batch)}); give the records teacher_topk_ids and teacher_topk_logprobs "
            "(lit_losses.data.DistillationDataModule), or a teacher model"
        )
    return batch[key]


__all__ = [
    "METRICS",
    "TEACHER_TOPK_IDS",
    "TEACHER_TOPK_LOGPROBS",
    "Distillation",
    "DistillationStep",
    "Teacher",
]
