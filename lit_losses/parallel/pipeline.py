"""`PipelineLoss`: the fused-head loss as the ``loss_fn`` of a ``torch.distributed.pipelining`` schedule."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lit_losses.aggregation import LABELS_KEY, AggMode, GlobalStats, count_masks, sum_counts
from lit_losses.aggregation.stats import counts_to_tensor, tensor_to_counts
from lit_losses.choices import check_choice
from lit_losses.distributed import all_reduce
from lit_losses.errors import ConfigError
from lit_losses.heads import MatmulPrecision, head_for
from lit_losses.loss.objective import Objective
from lit_losses.regularizers import RegularizerSet, RegularizerSpec
from lit_losses.validation import checked_projection

OutputProjection = Callable[[], tuple[Tensor, "Tensor | None"]]


class PipelineLoss:
    """The loss of the last pipeline stage: the fused head on the stage's hidden states, normalized by the
    global counts of the whole batch.

    A schedule (``ScheduleGPipe``, ``Schedule1F1B``, …) splits the batch of ``step(..., target=...)`` into
    ``n_microbatches`` along dim 0, calls ``loss_fn(output, target)`` at the last stage for each, and sums
    their gradients (then divides them by ``n_microbatches`` when ``scale_grads``, its default). The
    micro-batches are accumulation micro-batches: `target` counts the whole batch first (all-reduced over
    ``process_group``, the data-parallel replicas of the pipeline), and each micro-batch's loss, from the
    same `Objective` as `RegularizedLM` (base loss in ``loss_agg`` + regularizers), is divided by those
    counts and multiplied by ``loss_scale = (n_microbatches if scale_grads else 1) × replicas``. The step's
    gradient is then that of the whole global batch in one go, whatever the split.

    Hidden states are not checked for NaN/Inf: with dynamic shapes the schedule calls ``loss_fn`` once on
    uninitialized activations to infer gradient shapes. Give ``PipelineStage`` its ``input_args`` and
    ``output_args`` (static shapes) to avoid that call (needed with regularizers, which refuse NaN).

    Args:
        output_projection: ``() -> (weight [V, D], bias | None)`` of the last stage (called per
            micro-batch; a DTensor sharded along the vocabulary gives the vocabulary-parallel head).
        n_microbatches: the schedule's ``n_microbatches``.
        loss_agg: aggregation mode of the base loss.
        regularizers: loss terms (`RegularizerSpec`); their masks must be ``labels`` (a target has no
            other key).
        scale_grads: the schedule's ``scale_grads``.
        head_backend: head backend (`FusedLMHead`).
        head_chunk_size: tokens per chunk of the head.
        ignore_index: label value of positions without a target.
        process_group: the data-parallel group whose replicas' counts make the global batch (``None``:
            this pipeline alone).
        base_loss_weight: weight of the base loss.
        loss_agg_norm: the constant ``C`` of ``seq-mean-token-sum-norm`` (``(1/S) Σ_s Σ_{t∈s} L_t / C``),
            required when ``loss_agg`` or a regularizer's ``agg`` is that mode.
        head_matmul_precision: the head's ``matmul_precision`` (`lit_losses.heads.precision`).

    Raises:
        ConfigError: bad options (``loss_agg_norm`` missing where that mode needs it, …).

    Example:
        >>> import torch
        >>> from lit_losses.parallel import PipelineLoss
        >>> weight = torch.randn(11, 4, requires_grad=True)
        >>> loss_fn = PipelineLoss(lambda: (weight, None), n_microbatches=2, scale_grads=False)
        >>> labels = torch.tensor([[1, 2, 3], [4, -100, -100]])  # 4 valid tokens, 3 and 1 per row
        >>> target = loss_fn.target(labels)  # what schedule.step(..., target=target) is given
        >>> hidden = torch.randn(2, 3, 4)
        >>> losses = [loss_fn(h, t) for h, t in zip(hidden.split(1), target.split(1))]  # the schedule
        >>> full = -torch.log_softmax(hidden @ weight.T, -1)[labels != -100].gather(
        ...     1, labels[labels != -100][:, None]).mean()
        >>> torch.allclose(loss_fn.step_loss(losses), full)
        True
    """

    def __init__(
        self,
        output_projection: OutputProjection,
        n_microbatches: int,
        loss_agg: AggMode = "token-mean",
        regularizers: Sequence[RegularizerSpec | dict] | None = None,
        scale_grads: bool = True,
        head_backend: str = "auto",
        head_chunk_size: int | None = None,
        ignore_index: int = -100,
        process_group: Any = None,
        base_loss_weight: float = 1.0,
        loss_agg_norm: float | None = None,
        head_matmul_precision: MatmulPrecision = "auto",
    ) -> None:
        if n_microbatches < 1:
            raise ConfigError(f"PipelineLoss: n_microbatches must be >= 1, got {n_microbatches}")
        self.output_projection = output_projection
        self.n_microbatches = n_microbatches
        terms = RegularizerSet(regularizers or (), loss_agg)
        try:
            self.objective = Objective(terms, loss_agg, base_loss_weight, loss_agg_norm=loss_agg_norm)
        except ConfigError as exc:
            raise ConfigError(f"PipelineLoss: {exc}") from None
        other = [k for k in self.objective.mask_keys() if k != LABELS_KEY]
        if other:
            raise ConfigError(
                f"PipelineLoss: regularizers with mask keys {other}; a target holds labels only"
            )
        self.head_backend = head_backend
        self.head_chunk_size = head_chunk_size
        self.head_matmul_precision = check_choice(
            head_matmul_precision, MatmulPrecision, "PipelineLoss head_matmul_precision"
        )
        self.ignore_index = ignore_index
        self.process_group = process_group
        replicas = dist.get_world_size(process_group) if process_group is not None else 1
        self.loss_scale = float((n_microbatches if scale_grads else 1) * replicas)
        self.step = -1
        self._global: dict | None = None

    def target(self, labels: Tensor, segment_ids: Tensor | None = None) -> Tensor:
        """Count the whole batch (``labels [B, T]``, packed sequences from ``segment_ids``), all-reduce the
        counts over ``process_group`` and return the ``target`` to give ``schedule.step``: ``labels``, or
        ``[B, T, 2]`` labels and segment ids. Call it once per step, before ``schedule.step``."""
        batch = {LABELS_KEY: labels, **({} if segment_ids is None else {"segment_ids": segment_ids})}
        keys = self.objective.mask_keys()
        counts = counts_to_tensor(sum_counts([count_masks(batch, keys, self.ignore_index)]), keys)
        if self.process_group is not None:
            counts = all_reduce(counts, group=self.process_group)  # under NCCL too (CPU counts)
        self._global = tensor_to_counts(counts, keys)
        self.step += 1
        return labels if segment_ids is None else torch.stack((labels, segment_ids.to(labels.dtype)), dim=-1)

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        """The loss of one micro-batch: ``output [b, T, D]`` hidden states, ``target`` its part of `target`'s
        result; normalized by the whole batch's counts and multiplied by ``loss_scale``."""
        if self._global is None:
            raise RuntimeError("PipelineLoss: call loss_fn.target(labels) before schedule.step(...)")
        batch = {LABELS_KEY: target}
        if target.dim() == 3:
            batch = {LABELS_KEY: target[..., 0], "segment_ids": target[..., 1]}
        keys = self.objective.mask_keys()
        local = count_masks(batch, keys, self.ignore_index)
        stats = GlobalStats(self._global, self.loss_scale, local, position=0, window=self.n_microbatches)
        weight, bias = checked_projection(self.output_projection(), "PipelineLoss")
        head = head_for(
            weight,
            bias,
            backend=self.head_backend,
            chunk_size=self.head_chunk_size,
            ignore_index=self.ignore_index,
            check_finite=False,
            matmul_precision=self.head_matmul_precision,
        )
        return self.objective(head, output, batch, stats, max(self.step, 0), "train").total * self.loss_scale

    def step_loss(self, losses: Sequence[Tensor]) -> Tensor:
        """The step's loss from the losses the schedule collected (``schedule.step(..., losses=losses)``):
        this pipeline's part of the global-batch loss (the whole of it without data-parallel replicas)."""
        return torch.stack([loss.detach() for loss in losses]).sum() / self.loss_scale
