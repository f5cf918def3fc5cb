"""`LossContext` (what a loss term reads in one micro-batch) and `LossOutput` (what the step returns)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from lit_losses.aggregation.stats import GlobalStats
from lit_losses.heads import HeadOutput

Stage = Literal["train", "val", "predict"]


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
        cache: values derived from the context once and shared by its terms (e.g. the sequence
            form's ``(data, logprobs_list)``).

    Example:
        >>> import torch
        >>> from lit_losses.heads import HeadOutput
        >>> logp = torch.tensor([[-1.0, -2.0]])
        >>> ctx = LossContext({"labels": torch.tensor([[3, 4]])}, HeadOutput(logprobs=logp), None,
        ...                   torch.tensor([[True, True]]), None, step=0, stage="train")
        >>> ctx.logprobs
        tensor([[-1., -2.]])
        >>> ctx.entropy
        Traceback (most recent call last):
        ...
        AttributeError: head output 'entropy' was not computed: declare it in the term's needs
    """

    batch: dict[str, Any]
    head: HeadOutput
    hidden: Tensor | None
    mask: Tensor
    stats: GlobalStats | None
    step: int
    stage: Stage
    cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

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


def logprobs_first(needed: tuple[str, ...]) -> tuple[str, ...]:
    """The head outputs to compute for a loss that reads ``logprobs``: ``logprobs``, then the others of
    ``needed`` (what the regularizers read) in their order.

    Example:
        >>> logprobs_first(("entropy", "logprobs", "lse"))
        ('logprobs', 'entropy', 'lse')
    """
    return ("logprobs", *[name for name in needed if name != "logprobs"])


TELEMETRY_KEYS = ("value", "contribution", "error", "grad_norm_sq")
"""Per-term values whose global value is a sum over micro-batches and ranks."""


@dataclass
class LossOutput:
    """The loss of one micro-batch and its parts (all already normalized by the global counts).

    ``total = base_loss_weight · base + regularizer_total``; ``terms`` holds each regularizer's
    `TermResult` (``value``, ``weight``, ``contribution``, ``error``, ``custom``, ``grad_norm_sq``);
    ``base_metrics`` the base loss's telemetry (e.g. ``clip_fraction``), each already a share of the
    step's mean (logged as ``<stage>/base_loss/<name>``); ``metrics`` a loss's telemetry under the names its
    users know (the preference losses: TRL's ``rewards/chosen``, …), likewise shares of the step's mean,
    logged as ``<stage>/<name>``.

    Example:
        >>> import torch
        >>> out = LossOutput(torch.tensor(2.5), torch.tensor(2.0), torch.tensor(0.5), stats=None)
        >>> sorted(out.logged_values("train"))
        ['train/base_loss', 'train/loss_total', 'train/regularizer_total']
    """

    total: Tensor
    base: Tensor
    regularizer_total: Tensor
    stats: GlobalStats | None
    terms: dict[str, Any] = field(default_factory=dict)
    num_tokens: int = 0
    base_metrics: dict[str, Tensor] = field(default_factory=dict)
    metrics: dict[str, Tensor] = field(default_factory=dict)
    metric_weights: dict[str, float] = field(default_factory=dict)
    """The validation weight of a metric that is a mean over other units than the loss (its count in
    the micro-batch: the token metrics' tokens); the others take the loss's weight."""

    def logged_values(self, stage: str) -> dict[str, Tensor]:
        """Flat telemetry whose global value is a sum over micro-batches and ranks.

        Per term: ``value``, ``contribution``, ``error`` (a count, logged as 0/1) and, when computed,
        ``grad_norm_sq`` (squared norms add up over micro-batches and ranks; logged as ``grad_norm``);
        the base loss's ``base_metrics`` as ``<stage>/base_loss/<name>``, ``metrics`` as ``<stage>/<name>``.
        """
        values = {
            f"{stage}/loss_total": self.total.detach(),
            f"{stage}/base_loss": self.base.detach(),
            f"{stage}/regularizer_total": self.regularizer_total.detach(),
        }
        for name, value in self.base_metrics.items():
            values[f"{stage}/base_loss/{name}"] = value.detach()
        for name, value in self.metrics.items():
            values[f"{stage}/{name}"] = value.detach()
        for name, term in self.terms.items():
            for key in TELEMETRY_KEYS:
                if term[key] is not None:
                    values[f"regularizers/{name}/{key}"] = torch.as_tensor(term[key])
        return values
