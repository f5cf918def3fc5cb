"""`TrainingController`: a Lightning Callback that evaluates YAML rules on hooks and performs operations."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lit_losses.controller.config import Controller, parse_config
from lit_losses.controller.metrics import ALL_EVENTS
from lit_losses.controller.operations import RegularizerControl
from lit_losses.controller.rules import RuleEvaluator

log = logging.getLogger("lit_losses.controller")


class TrainingController(L.Callback):
    """Rules on metrics, fired on Lightning hooks, performing operations; safe, DDP-consistent, resumable.

    The config (a YAML path, an inline YAML string or a dict) has three lists::

        controller-metrics:   # {name, class, arguments}: values that rules read (alias controller_metrics)
        operations:           # {name, class, arguments}: actions (methods should_*); `lightning` is built in
        controllers:          # {name, triggers, rule, operations, patience}

    **Each hook** listed in some ``triggers``: metric handlers that support the hook recompute their
    value (stamped with the global ``step``; a value stays usable on later hooks), each controller's
    rule is evaluated with simpleeval (rules whose metrics are not available yet skip, logged once),
    the decisions of all controllers of the hook are combined across ranks in **one** reduction (a rule
    that holds on any rank holds everywhere, so every rank takes the same branch and no collective is
    left waiting), patience counters advance, and the operations run (on every rank when they need
    to, such as checkpointing; otherwise on rank 0).

    **Validation** happens in ``__init__`` (syntax, names, classes, actions, triggers, patience: all
    problems in one `ConfigError` naming each YAML path) and at ``setup`` (against the module, e.g. a
    `RegularizerControl`'s regularizer name), before the first training step.

    **State** (patience counters, metric windows and latest values) is saved in checkpoints.

    Args:
        config: YAML path, inline YAML, or dict.

    Raises:
        ConfigError: every problem of the config at once (see `parse_config`).

    Example:
        >>> from lit_losses.controller import TrainingController
        >>> controller = TrainingController({
        ...     "controller-metrics": [{"name": "state", "class": "TrainingState"}],
        ...     "controllers": [{"name": "stop-at-100", "triggers": ["on_train_batch_end"],
        ...                      "rule": 'state["global_step"] >= 100',
        ...                      "operations": ["lightning.should_training_stop"]}],
        ... })
        >>> controller.counters, controller.fired
        ({'stop-at-100': 0}, [])

        Then ``L.Trainer(callbacks=[controller])``.
    """

    def __init__(self, config: str | Path | dict[str, Any]) -> None:
        super().__init__()
        self.config = parse_config(config)
        self.evaluator = RuleEvaluator()
        self.values: dict[str, dict[str, Any]] = {}
        """The latest value of each metric, by metric name (each with its ``step``)."""
        self.counters = {c.name: 0 for c in self.config.controllers}
        self.fired: list[dict[str, Any]] = []
        """``{"controller", "step", "event", "operations"}`` of every firing (this process)."""

        self._skipped_once: set[str] = set()
        self._events = {t for c in self.config.controllers for t in c.triggers}

    @property
    def state_key(self) -> str:
        """The key of this callback's state in checkpoints (depends on the controller names)."""
        return self._generate_state_key(controllers=sorted(self.counters))

    # ---- Lightning hooks ---------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Check the operations against the module (e.g. regularizer names), before any step.

        Raises:
            ConfigError: an operation that cannot work on ``pl_module``.
        """
        for handler in self.config.operations.values():
            if isinstance(handler, RegularizerControl):
                handler.check_module(pl_module)

    def on_train_start(self, trainer, pl_module):
        self._on_event("on_train_start", trainer, pl_module)

    def on_train_epoch_start(self, trainer, pl_module):
        self._on_event("on_train_epoch_start", trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._on_event("on_train_batch_start", trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._on_event("on_train_batch_end", trainer, pl_module)

    def on_train_epoch_end(self, trainer, pl_module):
        self._on_event("on_train_epoch_end", trainer, pl_module)

    def on_validation_start(self, trainer, pl_module):
        self._on_event("on_validation_start", trainer, pl_module)

    def on_validation_epoch_end(self, trainer, pl_module):
        self._on_event("on_validation_epoch_end", trainer, pl_module)

    def on_validation_end(self, trainer, pl_module):
        self._on_event("on_validation_end", trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        self._on_event("on_train_end", trainer, pl_module)

    # ---- one event ---------------------------------------------------------------------------
    def _on_event(self, event: str, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if event not in self._events or trainer.sanity_checking:
            return
        step = trainer.global_step
        for name, handler in self.config.metrics.items():
            if event in handler.events:
                value = handler.compute(event, trainer, pl_module)
                if value is not None:
                    self.values[name] = {**value, "step": step}
        controllers = [c for c in self.config.controllers if event in c.triggers]
        local = [self._evaluate(c) for c in controllers]
        for controller, holds in zip(controllers, self._any_rank(trainer, pl_module, local), strict=True):
            if self._patience_reached(controller, holds):
                self._perform(controller, event, trainer, pl_module)

    def _evaluate(self, controller: Controller) -> bool:
        missing = controller.names - self.values.keys()
        if missing:
            self._once(
                controller.name,
                f"controller {controller.name!r}: metrics {sorted(missing)} not available yet; rule skipped",
            )
            return False
        try:
            return bool(self.evaluator.evaluate(controller.rule, self.values))
        except Exception as exc:  # e.g. a key not logged yet: skip, say so once
            self._once(
                controller.name, f"controller {controller.name!r}: rule skipped ({type(exc).__name__}: {exc})"
            )
            return False

    @staticmethod
    def _any_rank(trainer: L.Trainer, pl_module: L.LightningModule, local: list[bool]) -> list[bool]:
        if trainer.world_size == 1 or not local:
            return local
        votes = torch.tensor([float(v) for v in local], device=pl_module.device)
        votes = trainer.strategy.reduce(votes, reduce_op="sum")
        return [bool(v > 0) for v in votes.tolist()]

    def _patience_reached(self, controller: Controller, holds: bool) -> bool:
        patience = controller.patience
        if holds:
            self.counters[controller.name] += 1
        elif patience.mode == "reset_on_failure":
            self.counters[controller.name] = 0
        if self.counters[controller.name] >= patience.patience_threshold:
            self.counters[controller.name] = 0
            return True
        return False

    def _perform(
        self, controller: Controller, event: str, trainer: L.Trainer, pl_module: L.LightningModule
    ) -> None:
        context = {"controller": controller.name, "metrics": self.values, "event": event}
        for target, action in controller.operations:
            handler = self.config.operations[target]
            if action in handler.every_rank or trainer.is_global_zero:
                getattr(handler, action)(trainer, pl_module, context)
        record = {"controller": controller.name, "step": trainer.global_step, "event": event}
        self.fired.append({**record, "operations": [f"{t}.{a}" for t, a in controller.operations]})
        if trainer.is_global_zero:
            log.info("controller %r fired at step %d on %s", controller.name, trainer.global_step, event)

    def _once(self, key: str, message: str) -> None:
        if key not in self._skipped_once:
            self._skipped_once.add(key)
            log.info(message)

    # ---- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Patience counters, latest metric values and metric handler states, for checkpoints."""
        return {
            "counters": dict(self.counters),
            "values": {k: dict(v) for k, v in self.values.items()},
            "metrics": {name: h.state_dict() for name, h in self.config.metrics.items()},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore `state_dict`'s output; controllers and metrics no longer configured are ignored."""
        self.counters.update({k: v for k, v in state_dict.get("counters", {}).items() if k in self.counters})
        self.values.update(state_dict.get("values", {}))
        for name, state in state_dict.get("metrics", {}).items():
            if name in self.config.metrics:
                self.config.metrics[name].load_state_dict(state)


__all__ = ["ALL_EVENTS", "TrainingController"]
