"""`StepTelemetry`: exact global values of an optimizer step, logged once per step."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics.aggregation import MeanMetric

from lit_losses.aggregation import AggMode, StepSums, accumulation_factor, mode_denominator, window_ends
from lit_losses.aggregation.metrics import MAX_SUFFIX
from lit_losses.loss.context import LossOutput
from lit_losses.regularizers import RegularizerSet, TermResult

NUM_TOKENS_KEY = "train/num_tokens"
"""A count of the micro-batch's input tokens (the token metrics'): summed unscaled, logged cumulatively."""
UNSCALED = (MAX_SUFFIX, NUM_TOKENS_KEY)
TOKENS_SEEN_KEY = "lit_losses_tokens_seen"
"""The checkpoint's entry of `StepTelemetry.tokens_seen`: ``train/num_tokens`` goes on after a resume."""


class StepTelemetry(nn.Module):
    """Sums of every logged value over the micro-batches and ranks of an optimizer step.

    Each micro-batch adds ``value × share`` where ``share = loss_scale / (A × D)`` is what Lightning
    (``÷A``) and DDP (``÷D``) make of its loss; the sum over the step is then the global value. A
    squared gradient norm adds ``‖g‖² × share²`` (the step's gradient w.r.t. a micro-batch's head
    outputs is ``share × g``, and the micro-batches' outputs are disjoint), so ``grad_norm`` is exact
    with any loader; a value named ``…_max`` is a maximum over the micro-batches and ranks (unscaled);
    ``train/num_tokens`` (`lit_losses.loss.token_metrics`) an unscaled count, logged as the running total
    of the steps so far (TRL's cumulative ``num_tokens``).
    The sums live in one torchmetrics state (`StepSums`, ``dist_reduce_fx="sum"``: one collective per
    step, one more for maxima), created at the first update. `compute` returns the values to log
    (``…/grad_norm_sq`` as ``…/grad_norm``, ``…/error`` as 0/1, each term's weight and custom metrics,
    ``train/base_loss_weight``) and stores the nested `nested` dict:
    ``{loss_total, base_loss: {value, weight, custom}, regularizers: {name: {value, weight,
    contribution, custom, error[, grad_norm]}}, regularizer_total}`` with
    ``loss_total = base_loss.weight × base_loss.value + regularizer_total``; ``base_loss.custom`` holds
    the base loss's telemetry (``train/base_loss/<name>``: ``clip_fraction``, ``ratio_mean``,
    ``approx_kl``, ``advantage_mean``, …), exact means over the step's valid tokens. A loss's own
    metrics (`LossOutput.metrics`: the preference losses' ``rewards/chosen``, …, exact means over the step's
    pairs) are logged as ``train/<name>`` and nested under ``metrics``.

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
        self.metric_names: tuple[str, ...] = ()
        self.nested: dict[str, Any] = {}
        """The last step as the nested dict of the class docstring."""
        self.tokens_seen = 0
        """``train/num_tokens``: the input tokens of every step so far (saved in checkpoints)."""

    def update(self, values: Mapping[str, Tensor], share: float, terms: Mapping[str, TermResult]) -> None:
        """Add one micro-batch's logged values, scaled by its share of the step."""
        keys = tuple(values)
        if self.sums is None:
            device = next(iter(values.values())).device if values else None
            self.sums = StepSums(keys).to(device)
        elif self.sums.keys != keys:
            raise RuntimeError(f"the logged loss terms changed during training: {self.sums.keys} -> {keys}")
        squared = share * share
        self.sums.update(
            {
                k: v if k.endswith(UNSCALED) else v * (squared if k.endswith("/grad_norm_sq") else share)
                for k, v in values.items()
            }
        )
        self.last_terms = terms

    def record(self, module: Any, out: LossOutput, batch_idx: int) -> None:
        """`update` with one training micro-batch of ``module`` (its share: ``loss_scale / (A × D)``) and,
        when Lightning steps the optimizer after it, `log_step`."""
        share = out.stats.loss_scale / accumulation_factor(module._trainer)
        self.metric_names = tuple(out.metrics)
        self.update(out.logged_values("train"), share, out.terms)
        if window_ends(module._trainer, batch_idx):
            self.log_step(module, getattr(module, "regularizer_set", None), module.global_step)

    def log_step(self, module: Any, regularizers: RegularizerSet | None, step: int) -> None:
        """`compute` and log the values with ``module.log`` (``train/loss_total`` on the progress bar)."""
        base_weight = getattr(getattr(module, "objective", None), "base_loss_weight", None)
        for key, value in self.compute(regularizers, step, base_weight).items():
            module.log(key, value, prog_bar=key == "train/loss_total", on_step=True, on_epoch=False)

    def compute(
        self, regularizers: RegularizerSet | None, step: int, base_weight: float | None = None
    ) -> dict[str, Tensor]:
        """The step's values to log (then the sums restart); ``base_weight``: the base loss's weight."""
        assert self.sums is not None, "compute() before any update()"
        values = {}
        for key, value in self.sums.compute().items():
            if key.endswith("/grad_norm_sq"):
                key, value = key.removesuffix("_sq"), value.clamp_min(0).sqrt()
            elif key.endswith("/error"):
                value = (value > 0).to(value.dtype)
            elif key == NUM_TOKENS_KEY:
                self.tokens_seen += int(value)
                values[key] = torch.tensor(float(self.tokens_seen), dtype=torch.float64)
                continue
            values[key] = value.float()
        self.sums.reset()
        if base_weight is not None:
            values["train/base_loss_weight"] = torch.tensor(float(base_weight), dtype=torch.float64)
        for name in regularizers.terms if regularizers is not None else ():
            weight = regularizers.effective_weight(name, step)
            values[f"regularizers/{name}/weight"] = torch.tensor(weight, dtype=torch.float64)
        for name, term in self.last_terms.items():
            for key, value in term["custom"].items():
                values[f"regularizers/{name}/custom/{key}"] = torch.tensor(value, dtype=torch.float64)
        self.nested = nested_telemetry(values, self.last_terms, self.metric_names)
        return values


def nested_telemetry(
    values: Mapping[str, Tensor], last_terms: Mapping[str, TermResult], metric_names: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The flat logged values as the nested dict users read (`RegularizedLM.telemetry`; the
    schema of ``docs/concepts/telemetry.md``, see `StepTelemetry`). The base loss's weight is 1 unless
    ``train/base_loss_weight`` says; ``metric_names`` (``train/<name>``) go under ``metrics``."""

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
    base_weight = float(values["train/base_loss_weight"]) if "train/base_loss_weight" in values else 1.0
    prefix = "train/base_loss/"
    base_custom = {k.removeprefix(prefix): float(v) for k, v in values.items() if k.startswith(prefix)}
    nested = {
        "loss_total": get("train/loss_total"),
        "base_loss": {"value": get("train/base_loss"), "weight": base_weight, "custom": base_custom},
        "regularizer_total": get("train/regularizer_total"),
        "regularizers": regularizers,
    }
    if metric_names:
        nested["metrics"] = {name: get(f"train/{name}") for name in metric_names}
    return nested


class ValidationTelemetry(nn.Module):
    """``val/loss`` and ``val/loss_total`` over the whole validation set and every rank.

    Each micro-batch's value (normalized by its own counts) is weighted by the count it was divided by
    (`mode_denominator`), so ``Σ value·count / Σ count`` with torchmetrics' weighted `MeanMetric` (sum
    states) is the global value, exact under DDP. A loss that is a mean over other units (``units``: the
    preference losses' pairs or sequences, from the micro-batch's rows with a label) is weighted by them,
    and its ``metric_names`` (`LossOutput.metrics`) are logged as ``val/<name>`` the same way, each weighted
    by its own count where the micro-batch gives one (`LossOutput.metric_weights`: the token metrics').

    Example:
        >>> import torch
        >>> from lit_losses.aggregation import GlobalStats
        >>> val = ValidationTelemetry("token-mean")
        >>> for loss, n in ((1.0, 3), (3.0, 1)):
        ...     stats = GlobalStats.local_only({"labels": torch.zeros(1, n, dtype=torch.long)})
        ...     val.update(LossOutput(torch.tensor(loss), torch.tensor(loss), torch.tensor(0.0), stats))
        >>> val.loss.compute()  # (1·3 + 3·1) / 4
        tensor(1.5000)
    """

    def __init__(
        self, loss_agg: AggMode, metric_names: tuple[str, ...] = (), units: Callable[[int], int] | None = None
    ) -> None:
        super().__init__()
        self.loss_agg = loss_agg
        self.units = units
        self.loss = MeanMetric()
        self.loss_total = MeanMetric()
        self.metric_names = tuple(metric_names)
        self.metrics = nn.ModuleList(MeanMetric() for _ in self.metric_names)

    def record(self, module: Any, out: LossOutput) -> None:
        """`update` with one validation micro-batch and log ``val/loss`` (on the progress bar) and
        ``val/loss_total`` with ``module.log``, computed once per epoch."""
        self.update(out)
        module.log("val/loss", self.loss, prog_bar=True, on_step=False, on_epoch=True)
        module.log("val/loss_total", self.loss_total, on_step=False, on_epoch=True)
        for name, metric in zip(self.metric_names, self.metrics, strict=True):
            module.log(f"val/{name}", metric, on_step=False, on_epoch=True)

    def update(self, out: LossOutput) -> None:
        """Add one validation micro-batch."""
        local = out.stats.get_local()
        weight = self.units(local.num_sequences) if self.units else mode_denominator(self.loss_agg, local)
        if weight:
            self.loss.update(out.base.detach(), weight=weight)
            self.loss_total.update(out.total.detach(), weight=weight)
            for name, metric in zip(self.metric_names, self.metrics, strict=True):
                metric.update(out.metrics[name].detach(), weight=out.metric_weights.get(name, weight))
