"""`PreemptionCheckpoint`: a preempted fit ends at an optimizer step with a checkpoint and a non-zero exit.

Schedulers (SLURM, Kubernetes, torchrun's agent, a spot-instance reclaim) announce a preemption with
``SIGTERM`` (some with ``SIGUSR1``) and kill the job a grace period later. Without this callback Lightning
stops after the micro-batch in flight, writes no checkpoint (the work since the last periodic one is
lost, and a stop in the middle of an accumulation window cannot be resumed exactly) and exits with code 0,
which a scheduler reads as success. With it, the signal is only recorded; the fit goes on to the end of
the optimizer step in flight, every rank agrees on that step, the checkpoint is written, and the process
exits with ``128 + signal number`` (143 for ``SIGTERM``, 138 for ``SIGUSR1``: the code a shell reports for a
process that the signal ended, which requeue rules already match). ``lit-losses fit`` adds it to every fit.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lit_losses.aggregation.window import window_ends
from lit_losses.errors import ConfigError
from lit_losses.registry import closest
from lit_losses.validation import check_names


class Preempted(SIGTERMException):
    """The fit stopped for a preemption signal; its ``code`` (``128 + signal number``) is the exit status."""


def preemption_exit_code(signum: int) -> int:
    """``128 + signum``: what a shell reports for a process that signal ``signum`` ended.

    Example:
        >>> preemption_exit_code(signal.SIGTERM), preemption_exit_code(signal.SIGUSR1)
        (143, 138)
    """
    return 128 + int(signum)


class PreemptionCheckpoint(Checkpoint):
    """On ``SIGTERM`` (and ``SIGUSR1`` where no SLURM requeue handler owns it), finish the optimizer step in
    flight, save a checkpoint, and stop the fit with `Preempted` (exit status ``128 + signal``) once the
    step's metrics are logged (before a validation or the next micro-batch; a run whose last step it
    was ends as usual).

    The signal may reach the ranks at different moments: at the end of each optimizer step every rank
    tells whether it received one (one boolean all-reduce), and all stop after the same step. The
    checkpoint is written where `ModelCheckpoint` writes (its ``dirpath``; else ``<log_dir>/checkpoints``,
    else ``<default_root_dir>/checkpoints``) as ``preempted-step=<N>.ckpt`` (a folder of shards under
    ``save_distributed_checkpoint``). Resuming from it with ``--ckpt_path`` continues the run exactly,
    as from a periodic checkpoint written at the same step.

    Args:
        signals: the signal names to handle (default ``SIGTERM`` and ``SIGUSR1``).

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[PreemptionCheckpoint()], logger=False, enable_progress_bar=False)
        >>> [type(c).__name__ for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)]
        ['PreemptionCheckpoint']
    """

    def __init__(self, signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")) -> None:
        super().__init__()
        self.signals = check_signals(signals)
        self.received: int | None = None
        """The signal received and not acted on yet."""
        self.checkpoint_path: Path | None = None
        """The checkpoint written at the preemption (``None`` until then)."""
        self.exit_code: int | None = None
        """The exit status once the preemption checkpoint is written (the fit stops at the next hook)."""
        self._previous: dict[int, Any] = {}
        self._launcher: Any = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Take the signals (after Lightning installed its own handlers, which run when a fit starts)."""
        self.received = None
        self.exit_code = None
        self._launcher = getattr(trainer.strategy, "launcher", None)
        if threading.current_thread() is not threading.main_thread():
            rank_zero_warn(
                "PreemptionCheckpoint: the fit runs outside the main thread, which alone can take signals"
            )
            return
        for name in self.signals:
            signum = getattr(signal, name)
            if signum == signal.SIGUSR1 and slurm_requeues(trainer):
                continue  # Lightning's SLURM handler saves and requeues the job
            self._previous[signum] = signal.signal(signum, self._record)

    def _record(self, signum: int, _frame: Any) -> None:
        if self.received is None:
            self.received = signum
            rank_zero_info(
                f"lit-losses: received {signal.Signals(signum).name}: stopping after this optimizer step"
            )
        self._forward(signum)

    def _forward(self, signum: int) -> None:
        """Pass the signal on to the processes that Lightning's launcher started (as Lightning does)."""
        if self._launcher is not None and hasattr(self._launcher, "kill"):
            self._launcher.kill(signum)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.exit_code is not None or not window_ends(trainer, batch_idx):
            return  # already stopping, or the optimizer step is still in flight
        if not trainer.strategy.reduce_boolean_decision(self.received is not None, all=False):
            return
        signum = self.received if self.received is not None else signal.SIGTERM  # another rank's signal
        self.checkpoint_path = self.dirpath(trainer) / f"preempted-step={trainer.global_step}.ckpt"
        trainer.save_checkpoint(self.checkpoint_path)  # where ModelCheckpoint saves: resumes exactly
        self.exit_code = preemption_exit_code(signum)
        rank_zero_info(
            f"lit-losses: preempted by {signal.Signals(signum).name} after step {trainer.global_step}; "
            f"checkpoint {self.checkpoint_path}; exit code {self.exit_code}"
        )

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._stop_if_preempted()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop_if_preempted()

    def _stop_if_preempted(self) -> None:
        """Stop at the first hook after the step's metrics went to the loggers (not in the middle of them)."""
        if self.exit_code is not None:
            raise Preempted(self.exit_code)

    @staticmethod
    def dirpath(trainer: L.Trainer) -> Path:
        """Where the preemption checkpoint goes: the `ModelCheckpoint`'s folder, else the run's."""
        callback = trainer.checkpoint_callback
        folder = getattr(callback, "dirpath", None)
        if folder:
            return Path(folder)
        return Path(trainer.log_dir or trainer.default_root_dir) / "checkpoints"

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._record:  # not replaced since
                signal.signal(signum, previous)
        self._previous = {}


def check_signals(signals: Any) -> tuple[str, ...]:
    """``signals`` as a tuple of signal names that this platform has (``SIGTERM``, ``SIGUSR1``, …).

    Raises:
        ConfigError: one name given as a string (not a list), or a name without a signal.

    Example:
        >>> check_signals(["SIGTERM"])
        ('SIGTERM',)
        >>> check_signals(["SIGTREM"])
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: PreemptionCheckpoint.signals[0]='SIGTREM' is not a signal; ...
    """
    names = check_names(signals, "PreemptionCheckpoint.signals", "signal names")
    known = [s.name for s in signal.Signals]
    for i, name in enumerate(names):
        if name not in known:
            raise ConfigError(
                f"PreemptionCheckpoint.signals[{i}]={name!r} is not a signal{closest(name, known)}"
            )
    return names


def slurm_requeues(trainer: L.Trainer) -> bool:
    """Whether Lightning's SLURM auto-requeue handler takes ``SIGUSR1`` in this fit."""
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if isinstance(environment, SLURMEnvironment):
        return environment.auto_requeue
    return SLURMEnvironment.detect()
