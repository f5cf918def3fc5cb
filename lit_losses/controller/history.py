"""`HistoryBasedMetric`: windows of past values, one value per new observation."""

from __future__ import annotations

from collections import deque
from typing import Any

from lit_losses.controller.events import resolve_event
from lit_losses.controller.metrics import MetricHandler, as_number, epoch_progress, register_metric_handlers
from lit_losses.errors import ConfigError

TRAINING_LOSS_KEY = "train/loss_total"
"""The logged training loss that the Hugging Face-style window follows."""


class HistoryBasedMetric(MetricHandler):
    """The last values of logged metrics, appended once per *new observation*: once per occurrence of the
    event that produces them (a value logged once per optimizer step is appended once per optimizer step,
    whatever ``accumulate_grad_batches`` is and whatever hooks the controllers trigger on).

    Two forms, by arguments:

    - ``key`` (a logged metric) and ``window`` (its size, default 5): ``{"window": [values, oldest
      first], "steps": [their global steps], "full": bool}``. The values are read on ``source_event``:
      ``on_validation_end`` for a key starting with ``val``, else ``on_optimizer_step_end`` (any
      `Trigger` may be given).
    - fms-hf-tuning's ``window_size`` (default 1; negative: unbounded), no ``key``: ``{"training_loss":
      {"loss": [...], "steps": [...], "epoch": [...]}, "metrics": {"eval_loss": [...], ..., "steps":
      [...], "epoch": [...]}, "window_size": N}``: ``train/loss_total`` after each optimizer step, and
      every validation metric (``val/<x>`` as ``eval_<x>``) after each validation; ``epoch`` is
      fractional.

    The windows are saved in checkpoints.
    """

    events = ("on_optimizer_step_end", "on_validation_end")

    def validate(self) -> None:
        if "key" in self.arguments:
            self._unknown_arguments(("key", "window", "source_event"))
            key, size = self.arguments["key"], self.arguments.get("window", 5)
            if not isinstance(key, str) or not key:
                raise ConfigError(f"arguments.key must be a logged metric name, got {key!r}")
            default = "on_validation_end" if key.startswith("val") else "on_optimizer_step_end"
            self.events = (
                resolve_event(self.arguments.get("source_event", default), "arguments.source_event"),
            )
        else:
            self._unknown_arguments(("window_size",))
            size = self.arguments.get("window_size", 1)
            if isinstance(size, int) and not isinstance(size, bool) and size < 0:
                size = None  # fms-hf-tuning: a negative size keeps every value
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            name = "window" if "key" in self.arguments else "window_size"
            raise ConfigError(f"arguments.{name} must be an integer >= 1, got {size!r}")
        self.size: int | None = size
        self.windows: dict[str, dict[str, deque]] = {}

    def _append(self, group: str, values: dict[str, Any]) -> None:
        window = self.windows.setdefault(group, {})
        for name, value in values.items():
            window.setdefault(name, deque(maxlen=self.size)).append(value)

    def compute(self, event, trainer, pl_module):
        step, metrics = trainer.global_step, trainer.callback_metrics
        if "key" in self.arguments:
            value = metrics.get(self.arguments["key"])
            if value is not None:
                self._append("key", {"values": as_number(value), "steps": step})
            if "key" not in self.windows:
                return None
            values = list(self.windows["key"]["values"])
            return {
                "window": values,
                "steps": list(self.windows["key"]["steps"]),
                "full": len(values) == self.size,
            }
        epoch = epoch_progress(trainer)
        if event == "on_optimizer_step_end" and TRAINING_LOSS_KEY in metrics:
            self._append(
                "training_loss",
                {"loss": as_number(metrics[TRAINING_LOSS_KEY]), "steps": step, "epoch": epoch},
            )
        elif event == "on_validation_end":
            evaluated = {f"eval_{k[4:]}": as_number(v) for k, v in metrics.items() if k.startswith("val/")}
            if evaluated:
                self._append("metrics", {**evaluated, "steps": step, "epoch": epoch})
        if not self.windows:
            return None
        window = {
            group: {k: list(v) for k, v in self.windows.get(group, {}).items()}
            for group in ("training_loss", "metrics")
        }
        return {**window, "window_size": self.size if self.size is not None else -1}

    def state_dict(self):
        return {"windows": {g: {k: list(v) for k, v in w.items()} for g, w in self.windows.items()}}

    def load_state_dict(self, state):
        self.windows = {
            group: {k: deque(v, maxlen=self.size) for k, v in window.items()}
            for group, window in state.get("windows", {}).items()
        }


register_metric_handlers(HistoryBasedMetric)
