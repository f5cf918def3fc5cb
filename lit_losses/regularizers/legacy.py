"""Adapter for legacy single-callback losses ``loss_fn(data, logprobs_list) -> (loss, metrics)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lit_losses.aggregation import sequence_ids

if TYPE_CHECKING:
    from lit_losses.loss.context import LossContext

LegacyLossFn = Callable[[dict[str, Any], list[Tensor]], tuple[Tensor, dict[str, Any]]]


def sequence_logprobs(ctx: LossContext) -> list[Tensor]:
    """One unpadded 1-D tensor of log-probabilities per sequence with a valid label, in order.

    A sequence is a row, or a (row, segment) pair in packed rows; only valid positions are kept.
    """
    mask = ctx.mask
    ids = sequence_ids(mask, ctx.batch.get("segment_ids"))[mask]
    values = ctx.head.logprobs[mask]
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=1)
    return list(torch.split(values[order], counts[counts > 0].tolist()))


def legacy_term(loss_fn: LegacyLossFn, **kwargs: Any) -> Callable[[LossContext], tuple[Tensor, dict]]:
    """Wrap ``loss_fn(data, logprobs_list, **kwargs) -> (loss, metrics)`` as a regularizer term.

    ``data`` is the micro-batch dict, ``logprobs_list`` the per-sequence log-probabilities
    (`sequence_logprobs`). The scalar ``loss`` is taken as a mean over the micro-batch's valid units
    (the aggregation contract) and ``metrics`` become the term's custom telemetry.
    """

    def term(ctx: LossContext) -> tuple[Tensor, dict]:
        loss, metrics = loss_fn(ctx.batch, sequence_logprobs(ctx), **kwargs)
        return loss, dict(metrics or {})

    term.__name__ = getattr(loss_fn, "__name__", "legacy_loss")
    return term
