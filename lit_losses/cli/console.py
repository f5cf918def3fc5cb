"""The console of ``lit-losses``: no advertising tips or known third-party deprecation noise, and a progress
bar that counts optimizer steps.

- `quiet_console` drops Lightning's ``💡 Tip: …`` lines (a `logging.Filter` on Lightning's rank-zero
  logger), the ``[rank: N] Seed set to …`` line of every process but rank 0, and torch's
  ``isinstance(treespec, LeafSpec)`` deprecation warning that Lightning's own ``_pytree`` utilities
  trigger (a `warnings` filter on that message). Other warnings stay.
- `StepProgressBar`: Lightning's `TQDMProgressBar` whose bar counts optimizer steps against
  ``trainer.max_steps`` (or, without ``max_steps``, against the epoch's optimizer steps), not
  micro-batches: with ``accumulate_grad_batches=4`` and ``max_steps=20`` it reads ``20/20`` at the end,
  where Lightning's reads ``80/20``. A later epoch starts the bar where the run stands and its rate
  counts the steps taken since (not every step of the run over the epoch's first second).
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import warnings
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar

TIP_PREFIX = "💡 Tip:"
"""How Lightning's advertising tips start (``litlogger``, ``litmodels``)."""

LIGHTNING_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
PER_RANK_LOGGERS = ("lightning.fabric.utilities.seed",)
"""Lightning loggers that print on every process (``[rank: 1] Seed set to 0``): rank 0's line is enough."""


class RankZeroOnly(logging.Filter):
    """A logging filter that drops every record on a process other than global rank 0 (``RANK``, or
    Lightning's ``LOCAL_RANK`` of a one-node launch)."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
        return rank in ("", "0")


class DropTips(logging.Filter):
    """A logging filter that drops records whose message starts with ``💡 Tip:``.

    Example:
        >>> tip = logging.LogRecord("x", logging.INFO, "", 0, "💡 Tip: install more", None, None)
        >>> seed = logging.LogRecord("x", logging.INFO, "", 0, "Seed set to 0", None, None)
        >>> DropTips().filter(tip), DropTips().filter(seed)
        (False, True)
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TIP_PREFIX)


def quiet_console() -> None:
    """Drop Lightning's tips, the seed line of ranks other than 0, and the ``LeafSpec`` deprecation warning
    from this process's console.

    Example:
        >>> quiet_console()
        >>> any(isinstance(f, DropTips) for f in logging.getLogger(LIGHTNING_LOGGERS[0]).filters)
        True
    """
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropTips) for f in logger.filters):
            logger.addFilter(DropTips())
    for name in PER_RANK_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RankZeroOnly) for f in logger.filters):
            logger.addFilter(RankZeroOnly())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


class StepProgressBar(TQDMProgressBar):
    """`TQDMProgressBar` counting optimizer steps: ``global_step / max_steps`` (or, without ``max_steps``,
    the epoch's optimizer steps so far over its ``ceil(batches / accumulate_grad_batches)``).

    Example:
        >>> trainer = L.Trainer(callbacks=[StepProgressBar()], max_steps=20, logger=False)
        >>> type(trainer.progress_bar_callback).__name__
        'StepProgressBar'
    """

    def steps_total(self, trainer: L.Trainer) -> float:
        """What the bar counts to."""
        if trainer.max_steps is not None and trainer.max_steps > 0:
            return trainer.max_steps
        batches = trainer.num_training_batches
        return math.ceil(batches / trainer.accumulate_grad_batches) if math.isfinite(batches) else batches

    def steps_done(self, trainer: L.Trainer, batch_idx: int) -> int:
        """Where the bar stands after micro-batch ``batch_idx``."""
        if trainer.max_steps is not None and trainer.max_steps > 0:
            return trainer.global_step
        return (batch_idx + 1) // trainer.accumulate_grad_batches

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        bar = self.train_progress_bar
        bar.total = self.steps_total(trainer)
        bar.n = bar.initial = self.steps_done(trainer, -1)  # the rate counts this epoch's steps only
        bar.unit = "step"
        bar.refresh()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        bar = self.train_progress_bar
        done = self.steps_done(trainer, batch_idx)
        if bar.disable or done == bar.n:
            return
        bar.n = done
        bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar


def use_step_progress_bar(trainer: L.Trainer, configured: Any) -> None:
    """Replace Lightning's default progress bar by a `StepProgressBar`, unless ``configured`` (the config's
    ``trainer.callbacks``: class paths, or ``{class_path: ...}`` entries) names a progress bar."""
    entries = configured if isinstance(configured, list) else [configured] if configured else []
    for entry in entries:
        path = entry if isinstance(entry, str) else getattr(entry, "class_path", None)
        module, _, name = str(path).rpartition(".")
        try:
            chosen = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            continue
        if isinstance(chosen, type) and issubclass(chosen, ProgressBar):
            return
    for index, callback in enumerate(trainer.callbacks):
        if type(callback) in (RichProgressBar, TQDMProgressBar):
            trainer.callbacks[index] = StepProgressBar()
