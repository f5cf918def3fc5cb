"""`StepTelemetry`: exact global values of an optimizer step, logged once per step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lit_losses.aggregation import StepSums
from lit_losses.regularizers import RegularizerSet, TermResult


class StepTelemetry(nn.Module):
    """Sums of every logged value over the micro-batches and ranks of an optimizer step.

    Each micro-batch adds ``value × share`` where ``share = loss_scale / (A × D)`` is what Lightning
    (``÷A``) and DDP (``÷D``) make of its loss; the sum over the step is then the global value. The
    sums live in one torchmetrics state (`StepSums`, ``dist_reduce_fx="sum"``: one collective per
    step), created at the first update. `compute` returns the values to log (``…/grad_norm_sq`` as
    ``…/grad_norm``, ``…/error`` as 0/1, each term's weight and custom metrics) and stores the nested
    `nested` dict.

    Example:
        >>> import torch
        >>> telemetry = StepTelemetry()
        >>> for loss in (1.0, 3.0):  # two micro-batches of one step, each already a share of it
        ...     telemetry.update({"train/loss_total": torch.tensor(loss)}, share=0.5, terms={})
        >>> telemetry.compute(regularizers=None, step=0)
        {'train/loss_total': tensor(2.)}
    """

    def __init__(self) -> None:
        super().__init__()
        self.sums: StepSums | None = None
        self.last_terms: Mapping[str, TermResult] = {}
        self.nested: dict[str, Any] = {}
        """The last step as ``{loss_total, base_loss, regularizer_total, regularizers: {name: {...}}}``."""

    def update(self, values: Mapping[str, Tensor], share: float, terms: Mapping[str, TermResult]) -> None:
        """Add one micro-batch's logged values, scaled by its share of the step."""
        keys = tuple(values)
        if self.sums is None:
            device = next(iter(values.values())).device if values else None
            self.sums = StepSums(keys).to(device)
        elif self.sums.keys != keys:
            raise RuntimeError(f"the logged loss terms changed during training: {self.sums.keys} -> {keys}")
        self.sums.update({k: v * share for k, v in values.items()})
        self.last_terms = terms

    def compute(self, regularizers: RegularizerSet | None, step: int) -> dict[str, Tensor]:
        """The step's values to log (then the sums restart)."""
        assert self.sums is not None, "compute() before any update()"
        values = {}
        for key, value in self.sums.compute().items():
            if key.endswith("/grad_norm_sq"):
                key, value = key.removesuffix("_sq"), value.clamp_min(0).sqrt()
            elif key.endswith("/error"):
                value = (value > 0).to(value.dtype)
            values[key] = value.float()
        self.sums.reset()
        for name in regularizers.terms if regularizers is not None else ():
            weight = regularizers.effective_weight(name, step)
            values[f"regularizers/{name}/weight"] = torch.tensor(weight, dtype=torch.float64)
        for name, term in self.last_terms.items():
            for key, value in term["custom"].items():
                values[f"regularizers/{name}/custom/{key}"] = torch.tensor(value, dtype=torch.float64)
        self.nested = nested_telemetry(values, self.last_terms)
        return values


def nested_telemetry(values: Mapping[str, Tensor], last_terms: Mapping[str, TermResult]) -> dict[str, Any]:
    """The flat logged values as the nested dict users read (`RegularizedLM.telemetry`)."""

    def get(key: str) -> float:
        return float(values[key]) if key in values else 0.0

    regularizers = {}
    for name, term in last_terms.items():
        prefix = f"regularizers/{name}"
        entry = {
            "value": get(f"{prefix}/value"),
            "weight": get(f"{prefix}/weight"),
            "contribution": get(f"{prefix}/contribution"),
            "custom": dict(term["custom"]),
        }
        if f"{prefix}/grad_norm" in values:
            entry["grad_norm"] = get(f"{prefix}/grad_norm")
        entry["error"] = get(f"{prefix}/error")
        regularizers[name] = entry
    return {
        "loss_total": get("train/loss_total"),
        "base_loss": get("train/base_loss"),
        "regularizer_total": get("train/regularizer_total"),
        "regularizers": regularizers,
    }
