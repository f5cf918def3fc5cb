"""`check_regularizer`: a gradient check of a loss term run exactly as `RegularizerSet` runs it."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lit_losses.aggregation import AggMode, GlobalStats
from lit_losses.autograd import GradientReport, check_gradients
from lit_losses.heads import HeadOutput
from lit_losses.loss.context import LossContext
from lit_losses.regularizers.runner import RegularizerSet
from lit_losses.regularizers.spec import RegularizerSpec


def check_regularizer(
    term: Any,
    logprobs: Tensor,
    mask: Tensor | None = None,
    *,
    lse: Tensor | None = None,
    entropy: Tensor | None = None,
    hidden: Tensor | None = None,
    batch: dict[str, Any] | None = None,
    agg: AggMode = "token-mean",
    **kwargs: Any,
) -> GradientReport:
    """`check_gradients` for a loss term, against its inputs (log-probabilities and the rest).

    The term (a registry name, a callable ``fn(ctx)`` or a `RegularizerSpec`) is run the way
    `RegularizerSet` runs it (output checks, aggregation with ``agg`` over ``mask``), as a function of
    the float64 tensors given among ``logprobs``, ``lse``, ``entropy`` and ``hidden``. ``batch`` supplies
    the other keys the term reads (``labels`` is derived from ``mask`` when absent).

    Example:
        >>> import torch
        >>> from lit_losses.regularizers.testing import check_regularizer
        >>> logprobs = -torch.rand(2, 5, dtype=torch.float64, requires_grad=True)
        >>> check_regularizer("logprob_l1", logprobs).passed
        True
    """
    spec = term if isinstance(term, RegularizerSpec) else None
    if spec is None:
        spec = RegularizerSpec(
            name=term if isinstance(term, str) else getattr(term, "__name__", "term"), fn=term
        )
    mask = torch.ones(logprobs.shape, dtype=torch.bool) if mask is None else mask.bool()
    data = dict(batch or {})
    data.setdefault("labels", torch.where(mask, 0, -100))
    terms = RegularizerSet([spec], default_agg=agg)
    stats = GlobalStats.local_only(data, ("labels", *terms.mask_keys()))
    names = [
        n
        for n, t in (("logprobs", logprobs), ("lse", lse), ("entropy", entropy), ("hidden", hidden))
        if t is not None
    ]

    def fn(*tensors: Tensor) -> Tensor:
        values = dict(zip(names, tensors, strict=True))
        head = HeadOutput(values.get("logprobs"), values.get("lse"), values.get("entropy"))
        hidden_ = values.get("hidden", torch.zeros((*logprobs.shape, 1), dtype=torch.float64))
        ctx = LossContext(data, head, hidden_, mask=mask, stats=stats, step=0, stage="train")
        total, _ = terms(ctx)
        return total

    inputs = [t for t in (logprobs, lse, entropy, hidden) if t is not None]
    return check_gradients(fn, *inputs, name=f"regularizer {spec.name!r}", **kwargs)
