"""What the controller asks of Lightning's training loop that Lightning has no public API for.

The user need: controller operations that validate now (``should_validate``/``should_evaluate``) or end
the epoch now (``should_epoch_stop``), e.g. to evaluate when a loss spikes or to cut an epoch short.
Lightning offers no public call for either from a callback; without this module those operations could not
exist. The controller's other loop actions (save, log now, scale the learning rate) sit beside them.

Checked against lightning 2.6.6. Lightning cannot run the validation loop in the middle of ``fit`` on
demand (``Trainer.validate`` starts a run of its own; when validation happens is fixed by
``val_check_interval`` at the start of fit), nor end an epoch from a callback (only the module's
``on_train_batch_start`` returning ``-1`` can). These helpers do what ``_TrainingEpochLoop`` does around a
scheduled validation and at an epoch's last batch, private attributes included. Re-check them (and
tests/controller/test_operations.py) when upgrading Lightning.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L


def has_validation_data(trainer: L.Trainer) -> bool:
    """Whether fit was given validation data (loaded lazily, so `val_dataloaders` may still be None)."""
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    return bool(trainer.val_dataloaders) or val_loop._data_source.is_defined()


def validate_inside_fit(trainer: L.Trainer, controller: str) -> None:
    """Run the validation loop now, as Lightning does for ``val_check_interval < 1`` (nothing outside
    training or during a validation).

    The logger connector's ``_first_loop_iter`` tells whether logged values are step- or epoch-level;
    the validation loop resets it, so it is saved and restored (else the training metrics logged after
    the validation would be taken as epoch-level).

    Raises:
        RuntimeError: fit has no validation data.
    """
    if not trainer.training or trainer.validating or trainer.sanity_checking:
        return
    if not has_validation_data(trainer):
        raise RuntimeError(f"controller {controller!r}: should_validate without validation data")
    trainer.validating = True  # so that the trainer's active loop is the validation loop
    first_loop_iter = trainer._logger_connector._first_loop_iter
    trainer.fit_loop.epoch_loop.val_loop.run()
    trainer.training = True
    trainer._logger_connector._first_loop_iter = first_loop_iter


def end_epoch(trainer: L.Trainer) -> None:
    """End the current epoch after the micro-batch being processed (call it at the end of an optimizer
    step): marked as the epoch's last batch, as Lightning does when the module's ``on_train_batch_start``
    returns ``-1``. The next epoch starts with a new pass over the data."""
    trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True


def log_now(trainer: L.Trainer) -> None:
    """Send the current scalar metrics to every logger at this step."""
    metrics = {
        k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1
    }
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def save_now(trainer: L.Trainer, dirpath: str | None, controller: str) -> str:
    """Save a checkpoint on every rank to ``<dirpath>/controller-<controller>-step<N>.ckpt`` (default
    folder ``<default_root_dir>/controller-checkpoints``); returns its path."""
    folder = Path(dirpath or Path(trainer.default_root_dir) / "controller-checkpoints")
    path = folder / f"controller-{controller}-step{trainer.global_step}.ckpt"
    trainer.save_checkpoint(path)
    return str(path)


def scale_learning_rate(trainer: L.Trainer, factor: float) -> None:
    """Multiply the learning rate of every optimizer by ``factor``, and the schedulers' base rates, so
    that a schedule continues from the new level."""
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            group["lr"] *= factor
    for config in trainer.lr_scheduler_configs:
        if hasattr(config.scheduler, "base_lrs"):
            config.scheduler.base_lrs = [lr * factor for lr in config.scheduler.base_lrs]
