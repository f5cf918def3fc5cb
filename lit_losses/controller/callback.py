"""`TrainingController`: a Lightning Callback that evaluates YAML rules on events and performs operations."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
from jsonargparse.typing import Path_fr

from lit_losses.aggregation.window import window_ends
from lit_losses.controller.config import UnregisteredClassError, load_source, parse_config
from lit_losses.controller.conventions import CALLING_CONVENTIONS, CallingConvention, event_arguments
from lit_losses.controller.entries import Controller
from lit_losses.controller.events import ALL_EVENTS
from lit_losses.controller.loop import end_epoch
from lit_losses.controller.metrics import epoch_progress, register_metric_handlers
from lit_losses.controller.operations import ControllerStop, register_operation_handlers
from lit_losses.controller.perform import Firing, handle
from lit_losses.controller.reach import check_reachable
from lit_losses.controller.rules import RuleEvaluator

log = logging.getLogger("lit_losses.controller")


class TrainingController(L.Callback):
    """Rules on metrics, fired on Lightning events, performing operations; safe, DDP-consistent, resumable.

    The config (a YAML path, an inline YAML string or a dict) has three lists (fms-hf-tuning's schema;
    its configs run unchanged)::

        controller-metrics:   # {name, class, arguments}: values that rules read (alias controller_metrics)
        operations:           # {name, class, arguments}: actions (should_*); + `lightning`, `hfcontrols`
        controllers:          # {name, triggers, rule, operations, patience, config, on_error}

    **Each event** (a Lightning hook, ``on_optimizer_step_start``/``on_optimizer_step_end`` once per
    optimizer step, or a Hugging Face name such as ``on_log``): metric handlers that compute on it
    recompute their value (a dict gets the global ``step``; a value stays usable on later events), each
    controller triggered by it evaluates its rule with simpleeval (rules whose metrics are not available
    yet skip), the outcomes of all of the event's controllers are combined across ranks in **one**
    reduction (a rule that holds on any rank holds everywhere, so every rank takes the same branch),
    patience counts, and the operations run (on every rank when they need to, such as checkpointing;
    otherwise on rank 0); what they ask of the trainer (`TrainerControl` flags, ``should_stop``) is then
    done on every rank. A rule that raises or whose value is not a boolean stops the run with an error
    naming the controller, the rule and the metric values (``on_error: warn``: a warning, every time).

    **Validation** happens in ``__init__`` (syntax, names, classes, actions, triggers, patience: all
    problems in one `ConfigError` naming each YAML path), at ``setup`` (against the module and the
    trainer, e.g. a `RegularizerControl`'s regularizer name, a rollback to checkpoints in a run without
    them) and when training starts (a controller that can never act, its events or metrics being those
    of a validation this run does not have: `lit_losses.controller.reach`), before the first step. A
    config naming handler classes not registered yet waits for `register_metric_handlers` /
    `register_operation_handlers` (called on this object, as fms-hf-tuning does) until ``setup``.

    **State** (patience counts, metric windows and values, operations' state) is saved in checkpoints.

    Args:
        config: YAML path, inline YAML, or dict. A relative path written in a CLI config file is relative
            to that file's folder (else to the working directory); the run's saved ``config.yaml`` holds it
            absolute.

    Raises:
        ConfigError: every problem of the config at once (see `parse_config`).

    Example:
        >>> from lit_losses.controller import TrainingController
        >>> controller = TrainingController('''  # the YAML of a config file, inline
        ... controller-metrics:
        ...   - {name: state, class: TrainingState}
        ... controllers:
        ...   - name: stop-at-100
        ...     triggers: [on_optimizer_step_end]
        ...     rule: state["global_step"] >= 100
        ...     operations: [lightning.should_training_stop]
        ... ''')
        >>> controller.counters, controller.fired
        ({'stop-at-100': 0}, [])

        Then ``L.Trainer(callbacks=[controller])``.
    """

    #: A non-finite optimizer step is skipped and shown to the rules (``train/non_finite_step``, a NaN
    #: ``train/loss_total``) instead of stopping the run with an error (`lit_losses.non_finite`).
    handles_non_finite_steps = True

    def __init__(self, config: Path_fr | str | Path | dict[str, Any]) -> None:
        super().__init__()
        self._source = load_source(config)
        self.evaluator = RuleEvaluator()
        self.values: dict[str, Any] = {}
        """The latest value of each metric, by metric name (a dict carries its ``step``)."""
        self.fired: list[dict[str, Any]] = []
        """``{"controller", "step", "event", "operations"}`` of every firing (this process)."""
        self.counters: dict[str, int] = {}
        self.stop: ControllerStop | None = None
        """The controller that stopped training with ``lightning.should_training_stop`` (this run)."""
        self.config = None
        self.conventions: list[CallingConvention] = []
        """The calling conventions of this config's metric handlers besides lit_losses' own."""
        self.convention_state: dict[str, Any] = {}
        """What calling conventions keep for this controller (e.g. fms-hf-tuning's ``log_history``)."""
        self._by_event: dict[str, list[Controller]] = {}
        self._skipped_once: set[str] = set()
        self._running: set[str] = set()
        self._end_epoch = False
        self._pending: UnregisteredClassError | None = None
        self._try_parse()

    def _try_parse(self) -> None:
        try:
            self.config = parse_config(self._source)
        except UnregisteredClassError as exc:  # fms-hf-tuning registers handlers after creating the callback
            self._pending = exc
            return
        self._pending = None
        self.counters = {c.name: self.counters.get(c.name, 0) for c in self.config.controllers}
        self._by_event = {e: [c for c in self.config.controllers if e in c.triggers] for e in ALL_EVENTS}
        self._events = {e for e in ALL_EVENTS if self._by_event[e]}
        self._events |= {e for h in self.config.metrics.values() for e in h.events}
        computes = [h.compute for h in self.config.metrics.values() if not h.lightning_style()]
        self.conventions = [c for c in CALLING_CONVENTIONS if any(c.accepts(m) for m in computes)]

    def register_metric_handlers(self, *handlers: list[type] | type, **named: type) -> None:
        """Register metric handler classes (`register_metric_handlers`) and use them in this config."""
        register_metric_handlers(*handlers, **named)
        if self.config is None:
            self._try_parse()

    def register_operation_handlers(self, *handlers: list[type] | type, **named: type) -> None:
        """Register operation handler classes (`register_operation_handlers`) and use them here."""
        register_operation_handlers(*handlers, **named)
        if self.config is None:
            self._try_parse()

    @property
    def state_key(self) -> str:
        """The key of this callback's state in checkpoints (depends on the controller names)."""
        names = [c.get("name") for c in self._source.get("controllers") or [] if isinstance(c, Mapping)]
        return self._generate_state_key(controllers=sorted(str(n) for n in names))

    # ---- Lightning hooks ---------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Check the operations against the module (e.g. regularizer names), before any step.

        Raises:
            ConfigError: a handler class still not registered, or an operation that cannot work on
                ``pl_module``.
        """
        if self._pending is not None:
            raise self._pending
        for handler in self.config.operations.values():
            handler.setup(trainer, pl_module)

    def on_fit_start(self, trainer, pl_module):
        self._on_event("on_fit_start", trainer, pl_module)

    def on_train_start(self, trainer, pl_module):
        check_reachable(self.config, trainer)
        for handler in self.config.operations.values():
            handler.start(trainer, pl_module, self)
        self._on_event("on_train_start", trainer, pl_module)

    def on_train_epoch_start(self, trainer, pl_module):
        self._on_event("on_train_epoch_start", trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self._on_event("on_optimizer_step_start", trainer, pl_module)
        self._on_event("on_train_batch_start", trainer, pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._on_event("on_before_optimizer_step", trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._on_event("on_train_batch_end", trainer, pl_module)
        if window_ends(trainer, batch_idx):
            self._on_event("on_optimizer_step_end", trainer, pl_module)
            if self._end_epoch:  # asked for at this step or earlier in its window
                self._end_epoch = False
                end_epoch(trainer)

    def on_train_epoch_end(self, trainer, pl_module):
        self._end_epoch = False
        self._on_event("on_train_epoch_end", trainer, pl_module)

    def on_validation_start(self, trainer, pl_module):
        self._on_event("on_validation_start", trainer, pl_module)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._on_event("on_validation_batch_end", trainer, pl_module)

    def on_validation_epoch_end(self, trainer, pl_module):
        self._on_event("on_validation_epoch_end", trainer, pl_module)

    def on_validation_end(self, trainer, pl_module):
        self._on_event("on_validation_end", trainer, pl_module)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self._on_event("on_save_checkpoint", trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        self._on_event("on_train_end", trainer, pl_module)

    # ---- one event ---------------------------------------------------------------------------
    def _on_event(self, event: str, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.config is None or event not in self._events or trainer.sanity_checking:
            return
        if event in self._running:  # an operation that runs its own event again (a save on save)
            return
        self._running.add(event)
        try:
            firing = Firing(
                self,
                event=event,
                trainer=trainer,
                pl_module=pl_module,
                extras=event_arguments(event, trainer),
                epoch=epoch_progress(trainer),
            )
            handle(firing)
        finally:
            self._running.discard(event)

    def controllers_on(self, event: str) -> list[Controller]:
        """The controllers that ``event`` triggers, in YAML order."""
        return self._by_event.get(event, [])

    def note_once(self, key: str, message: str, warn: bool = False) -> None:
        """Log ``message`` at INFO (``warn``: as a ``UserWarning``) the first time ``key`` is noted (e.g. a
        rule skipped: metrics missing)."""
        if key in self._skipped_once:
            return
        self._skipped_once.add(key)
        if warn:
            warnings.warn(message, UserWarning, stacklevel=2)
        else:
            log.info(message)

    def request_epoch_end(self) -> None:
        """End the epoch at the end of the current optimizer step's window (``should_epoch_stop``)."""
        self._end_epoch = True

    # ---- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Patience counters, latest metric values, metric and operation handler states."""
        config = self.config
        return {
            "counters": dict(self.counters),
            "values": {k: dict(v) if isinstance(v, Mapping) else v for k, v in self.values.items()},
            "metrics": {name: h.state_dict() for name, h in config.metrics.items()} if config else {},
            "operations": {name: h.state_dict() for name, h in config.operations.items()} if config else {},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore `state_dict`'s output; controllers and handlers no longer configured are ignored."""
        self.counters.update({k: v for k, v in state_dict.get("counters", {}).items() if k in self.counters})
        self.values = dict(state_dict.get("values", {}))
        for kind in ("metrics", "operations"):
            handlers = getattr(self.config, kind, {})
            for name, state in state_dict.get(kind, {}).items():
                if name in handlers:
                    handlers[name].load_state_dict(state)


__all__ = ["ALL_EVENTS", "TrainingController"]
