"""`SpikeRecovery`: roll the model and the optimizer back when a loss spike rule holds, skip data, and give up
after a number of attempts."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_losses.aggregation.window import train_loaders
from lit_losses.controller.loop import scale_learning_rate
from lit_losses.controller.operations import OperationHandler, register_operation_handlers
from lit_losses.errors import ConfigError

log = logging.getLogger("lit_losses.controller")

Source = Literal["snapshot", "checkpoint"]
"""Where a rollback restores from: the last in-memory snapshot, or the last checkpoint file."""


class RecoveryError(RuntimeError):
    """Spike recovery gave up: its rule still held after ``max_attempts`` consecutive rollbacks."""


def _cloned(state: Any) -> Any:
    return copy.deepcopy(state)


class SpikeRecovery(OperationHandler):
    """``should_roll_back``: undo the optimizer step(s) that produced a loss spike and go on with other data.

    When its controller's rule holds (e.g. the step loss is far above its recent mean), on every rank:

    1. the model, the optimizers, the LR schedulers, the regularizers' run-time weights and the
       controller's own state (patience counts, metric windows: the spike leaves them) are restored from
       the last **snapshot** (kept in memory after every ``every``-th optimizer step whose rules did not
       ask for a rollback; the first one when training starts) or from the last **checkpoint** file
       (``source: checkpoint``; ``checkpoint``: a path, default the newest file of the trainer's
       ``ModelCheckpoint`` callbacks);
    2. the next ``skip_batches`` micro-batches of the training data are dropped (the data already seen
       is not replayed: the step that spiked is not trained again; the epoch then ends early, at the last
       whole accumulation window; needs a `GlobalStatsLoader`);
    3. the learning rate is multiplied by ``lr_factor`` (default 1: unchanged);
    4. after ``max_attempts`` rollbacks with no clean optimizer step in between, the run stops with a
       `RecoveryError` naming the steps.

    The global step keeps counting (a rolled-back step still counts toward ``max_steps``). Its rule is
    decided on every rank together (the controller's one reduction), so every rank rolls back at the
    same step. Triggers: ``on_optimizer_step_end`` (or ``on_step_end`` / ``on_log``),
    ``on_train_epoch_end``, ``on_validation_end``: between optimizer steps, never inside a window.

    Example:
        >>> from lit_losses.controller import parse_config
        >>> config = parse_config({
        ...     "controller-metrics": [{"name": "loss", "class": "HistoryBasedMetric",
        ...                             "arguments": {"key": "train/loss_total", "window": 10}}],
        ...     "operations": [{"name": "recover", "class": "SpikeRecovery",
        ...                     "arguments": {"skip_batches": 2, "max_attempts": 3}}],
        ...     "controllers": [{"name": "spike", "triggers": ["on_optimizer_step_end"],
        ...                      "rule": 'loss["full"] and loss["window"][-1] > 3 * mean(loss["window"])',
        ...                      "operations": ["recover.should_roll_back"]}],
        ... })
        >>> config.operations["recover"].arguments
        {'skip_batches': 2, 'max_attempts': 3}
    """

    every_rank = ("should_roll_back",)
    action_triggers: ClassVar[dict[str, tuple[str, ...]]] = {
        "should_roll_back": ("on_optimizer_step_end", "on_train_epoch_end", "on_validation_end")
    }
    ARGUMENTS = ("source", "checkpoint", "every", "skip_batches", "lr_factor", "max_attempts")

    def validate(self, metric_names):
        self._unknown_arguments(self.ARGUMENTS)
        args = self.arguments
        if args.get("source", "snapshot") not in get_args(Source):
            raise ConfigError(f"arguments.source {args['source']!r} is not one of {get_args(Source)}")
        for key, default, low in (("every", 1, 1), ("skip_batches", 0, 0), ("max_attempts", 3, 1)):
            value = args.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"arguments.{key} must be an integer >= {low}, got {value!r}")
        factor = args.get("lr_factor", 1.0)
        if not isinstance(factor, int | float) or isinstance(factor, bool) or factor <= 0:
            raise ConfigError(f"arguments.lr_factor must be a number > 0, got {factor!r}")
        self.attempts: list[int] = []
        self.snapshot: dict[str, Any] | None = None
        self._rolled_back_at: int | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Refuse ``source: checkpoint`` without a ``checkpoint`` path in a run that writes no checkpoint.

        Raises:
            ConfigError: naming the operation and the trainer options that would write checkpoints.
        """
        if self.arguments.get("source") != "checkpoint" or self.arguments.get("checkpoint"):
            return
        if not any(isinstance(c, ModelCheckpoint) for c in trainer.checkpoint_callbacks):
            raise ConfigError(
                f"operation {self.name!r}: source: checkpoint rolls back to the newest checkpoint of the "
                "trainer's ModelCheckpoint, but this run writes none (trainer.enable_checkpointing=false and "
                "no ModelCheckpoint in trainer.callbacks); enable checkpointing, give arguments.checkpoint, "
                "or use source: snapshot"
            )

    def start(self, trainer: L.Trainer, pl_module: L.LightningModule, controller: Any) -> None:
        """Check that data can be skipped, and take the first snapshot."""
        if self.arguments.get("skip_batches", 0) and not train_loaders(trainer):
            raise ConfigError(
                f"operation {self.name!r}: skip_batches needs a GlobalStatsLoader as the training data "
                "(TextDataModule's, or lit_losses.GlobalStatsLoader)"
            )
        self._take_snapshot(trainer, pl_module, controller)

    def after_step(self, trainer: L.Trainer, pl_module: L.LightningModule, controller: Any) -> None:
        """A clean step (no rollback at it) resets the attempts and, every ``every`` steps, is snapshot."""
        if self._rolled_back_at == trainer.global_step:
            return
        self.attempts = []
        if trainer.global_step % self.arguments.get("every", 1) == 0:
            self._take_snapshot(trainer, pl_module, controller)

    def should_roll_back(self, trainer: L.Trainer, pl_module: L.LightningModule, context: dict) -> None:
        step, max_attempts = trainer.global_step, self.arguments.get("max_attempts", 3)
        if len(self.attempts) >= max_attempts:
            raise RecoveryError(
                f"operation {self.name!r} (controller {context['controller']!r}): gave up after "
                f"{max_attempts} rollbacks (at steps {self.attempts}); the rule still held at step {step} "
                f"on {context['event']} with {self._read(context)}"
            )
        attempts, self._rolled_back_at = [*self.attempts, step], step
        controller = context["callback"]
        if self.arguments.get("source", "snapshot") == "checkpoint":
            restored = self._restore_checkpoint(trainer, pl_module, controller)
        else:
            restored = self._restore(trainer, pl_module, controller, state=self.snapshot)
        self.attempts = attempts  # restoring the controller's state restored this handler's too
        for optimizer in trainer.optimizers:
            optimizer.zero_grad(set_to_none=True)
        if self.arguments.get("lr_factor", 1.0) != 1.0:
            scale_learning_rate(trainer, float(self.arguments["lr_factor"]))
        skip = self.arguments.get("skip_batches", 0)
        for loader in train_loaders(trainer) if skip else ():
            loader.skip(skip)
        context["rolled_back_to"] = restored
        if trainer.is_global_zero:
            log.warning(
                "[controller %s] loss spike at step %d: rolled back to %s (attempt %d of %d), skipping %d "
                "micro-batches",
                context["controller"],
                step,
                restored,
                len(self.attempts),
                max_attempts,
                skip,
            )

    # ---- snapshots -----------------------------------------------------------------------------
    @staticmethod
    def _read(context: dict) -> str:
        metrics = context["metrics"]
        return ", ".join(f"{k}={v!r}" for k, v in metrics.items()) or "no metric values"

    def _take_snapshot(self, trainer: L.Trainer, pl_module: L.LightningModule, controller: Any) -> None:
        regularizers = getattr(pl_module, "regularizer_set", None)
        self.snapshot = {
            "step": trainer.global_step,
            "state_dict": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            "optimizer_states": [_cloned(o.state_dict()) for o in trainer.optimizers],
            "lr_schedulers": [_cloned(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs],
            "regularizers": _cloned(regularizers.state_dict()) if regularizers is not None else None,
            "controller": _cloned(controller.state_dict()),
        }

    @staticmethod
    def _restore(trainer: L.Trainer, pl_module: L.LightningModule, controller: Any, state: dict) -> str:
        pl_module.load_state_dict(state["state_dict"])
        for optimizer, saved in zip(trainer.optimizers, state["optimizer_states"], strict=True):
            optimizer.load_state_dict(_cloned(saved))
        for config, saved in zip(trainer.lr_scheduler_configs, state["lr_schedulers"], strict=True):
            config.scheduler.load_state_dict(_cloned(saved))
        regularizers = getattr(pl_module, "regularizer_set", None)
        if regularizers is not None and state.get("regularizers") is not None:
            regularizers.load_state_dict(state["regularizers"])
        if state.get("controller") is not None:
            controller.load_state_dict(_cloned(state["controller"]))
        return f"the snapshot of step {state['step']}"

    def _restore_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, controller: Any) -> str:
        path = self.arguments.get("checkpoint") or _newest_checkpoint(trainer)
        if not path or not Path(path).is_file():
            raise RecoveryError(f"operation {self.name!r}: no checkpoint to roll back to (got {path!r})")
        checkpoint = torch.load(path, map_location=pl_module.device, weights_only=True)
        state = {
            "step": checkpoint.get("global_step"),
            "state_dict": checkpoint["state_dict"],
            "optimizer_states": checkpoint.get("optimizer_states", []),
            "lr_schedulers": checkpoint.get("lr_schedulers", []),
            "regularizers": checkpoint.get("lit_losses_regularizers"),
            "controller": checkpoint.get("callbacks", {}).get(controller.state_key),
        }
        self._restore(trainer, pl_module, controller, state=state)
        return f"checkpoint {path} (step {state['step']})"

    def state_dict(self) -> dict[str, Any]:
        return {"attempts": list(getattr(self, "attempts", []))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.attempts = list(state.get("attempts", []))


def _newest_checkpoint(trainer: L.Trainer) -> str | None:
    """The most recently written checkpoint of the trainer's ``ModelCheckpoint`` callbacks."""
    paths = set()
    for callback in trainer.checkpoint_callbacks:
        last, best = getattr(callback, "last_model_path", ""), getattr(callback, "best_model_path", "")
        paths.update(p for p in (last, best) if p)
        paths.update(getattr(callback, "best_k_models", {}))
    existing = [p for p in paths if Path(p).is_file()]
    return max(existing, key=lambda p: Path(p).stat().st_mtime_ns) if existing else None


register_operation_handlers(SpikeRecovery)
