"""`RunRecord`: why and where a fit ended, as ``run_end.json`` in the run's folder and one short summary.

``lit-losses fit`` adds it to every fit. When the fit ends, global rank 0 writes ``<log_dir>/run_end.json``
(``trainer.log_dir``: the logger's version folder, else ``trainer.default_root_dir``)::

    {"reason": "max_steps" | "max_epochs" | "controller" | "stopped" | "preempted" | "interrupted" | "error",
     "detail": "...", "step": N, "epoch": E, "train_loss": x | null, "val_loss": x | null,
     "checkpoints": [...], "log_dir": "...", "controller": {"name", "step"} | null,
     "exit_code": 143 | null, "controller_firings": [{"controller", "step", "event", "operations"}, ...],
     "resume_command": "lit-losses fit --config <log_dir>/config.yaml --ckpt_path <checkpoint>" | null,
     "metrics": {...}, "objective": {"base_loss", "base_loss_args", "base_loss_weight", "loss_agg",
     "loss_agg_norm", "regularizers": [{"name", "weight", "enabled", "agg"}, ...]} | null}

``objective`` is what ran, after presets (``model.grpo``, ``model.dpo``, ``model.distillation``:
`lit_losses.loss.summary`); it is also saved beside the hyper-parameters (``hparams.yaml``) when the fit
starts. The summary prints it (why it ended, what ran, the final losses, the run folder, the
checkpoint, after a preemption or a stop the whole command that resumes the run, and the commands that
show the run: ``tensorboard --logdir <log_dir>`` and ``lit-losses report <log_dir>``).

While the fit runs, every firing of a `TrainingController` is also sent to the loggers as the scalar
``controller/<name>/fired`` (1.0 at the step it fired; ``controller/<name>/rollback`` for a spike
recovery), so that ``lit-losses report`` can mark it on the time axis, even on a run still going.
"""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path
from typing import Any, Literal

import lightning as L
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.cli import SaveConfigCallback

from lit_losses.checkpoint.preemption import Preempted, PreemptionCheckpoint
from lit_losses.cli.objective_line import describe_objective
from lit_losses.cli.trainer_errors import lightning_config_error
from lit_losses.controller import TrainingController
from lit_losses.errors import ConfigError
from lit_losses.loss.objective import Objective
from lit_losses.loss.summary import objective_summary

EndReason = Literal["max_steps", "max_epochs", "controller", "stopped", "preempted", "interrupted", "error"]
"""Why a fit ended."""

RUN_END_FILE = "run_end.json"
"""The file name of the end record in the run's log folder."""

RESUMABLE: tuple[EndReason, ...] = ("preempted", "stopped", "controller", "interrupted")
"""The reasons after which the summary prints the command that resumes the run."""


class RunRecord(L.Callback):
    """Records why the fit ended (``run_end.json`` in the run's folder) and prints a short summary.

    The reason is ``max_steps`` or ``max_epochs`` (the trainer's limit), ``controller`` (a
    `TrainingController` rule asked to stop: its name and step are recorded), ``stopped`` (another
    callback set ``trainer.should_stop``), ``preempted`` (`lit_losses.PreemptionCheckpoint`: its exit code
    ``128 + signal`` and its checkpoint), ``interrupted`` (Ctrl+C) or ``error`` (the exception's type and
    message). Written on global rank 0 only. A `ConfigError` raised before training started (a refused
    record, option or model), or Lightning refusing a trainer option then
    (`lit_losses.cli.trainer_errors.lightning_config_error`: ``val_check_interval`` larger than the epoch),
    is no run: ``lit-losses fit`` prints it as its one error line, and nothing is written or printed here.

    Args:
        summary: print the summary (on rank 0) when the fit ends.

    Example:
        >>> record = RunRecord(summary=False)
        >>> record.record is None
        True

        Then ``L.Trainer(callbacks=[record])``; after ``fit``, ``record.record["reason"]`` tells why it ended.
    """

    def __init__(self, summary: bool = True) -> None:
        super().__init__()
        self.summary = summary
        self.record: dict[str, Any] | None = None
        """The end record (``None`` until the fit ended)."""
        self._sent: dict[int, int] = {}
        self._stopped: tuple[EndReason, str, dict[str, Any] | None] | None = None
        self._started = False

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        log_firings(trainer, self._sent)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        log_firings(trainer, self._sent)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.record = None
            self._stopped = None
            self._started = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started = True

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Save what the run optimizes, after presets, beside its hyper-parameters (``hparams.yaml``)."""
        objective = objective_of(pl_module)
        if objective is not None:
            for logger in trainer.loggers:
                logger.log_hyperparams({"objective": objective})

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        log_firings(trainer, self._sent)
        self._stopped = stop_reason(trainer)  # written at teardown, after the last checkpoints are saved

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and self._stopped is None and self.record is None:
            self._stopped = stop_reason(trainer)  # a fit with nothing to train (max_steps=0): no on_train_end
        if self._stopped is not None:
            reason, detail, controller = self._stopped
            self._stopped = None
            self._finish(trainer, end_record(trainer, reason=reason, detail=detail, controller=controller))

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if not self._started and (refused(exception) or lightning_config_error(exception) is not None):
            return  # a refused input or trainer option: its one error line says it all, no record
        reason, detail, exit_code = exception_reason(trainer, exception)
        record = end_record(trainer, reason=reason, detail=detail, controller=None)
        record["exit_code"] = exit_code
        self._finish(trainer, record)

    def _finish(self, trainer: L.Trainer, record: dict[str, Any]) -> None:
        if record["reason"] in RESUMABLE:
            record["resume_command"] = resume_command(trainer, record["checkpoints"])
        self.record = record
        if not trainer.is_global_zero:
            return
        folder = Path(record["log_dir"])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / RUN_END_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        if self.summary:
            print(summary_text(record), flush=True)


def controllers(trainer: L.Trainer) -> list[TrainingController]:
    """The trainer's `TrainingController` callbacks."""
    return [c for c in trainer.callbacks if isinstance(c, TrainingController)]


def firings(trainer: L.Trainer) -> list[dict[str, Any]]:
    """Every controller firing of this process, in order."""
    return [dict(f) for c in controllers(trainer) for f in c.fired]


def log_firings(trainer: L.Trainer, sent: dict[int, int]) -> None:
    """Send the controllers' firings not sent yet to the loggers (rank 0), as ``controller/<name>/fired``
    (and ``controller/<name>/rollback`` for a spike recovery) = 1.0 at the step each fired."""
    for controller in controllers(trainer):
        new = controller.fired[sent.get(id(controller), 0) :]
        sent[id(controller)] = len(controller.fired)
        if not trainer.is_global_zero:
            continue
        for fired in new:
            metrics = {f"controller/{fired['controller']}/fired": 1.0}
            if any(op.endswith("should_roll_back") for op in fired["operations"]):
                metrics[f"controller/{fired['controller']}/rollback"] = 1.0
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=int(fired["step"]))


def stop_reason(trainer: L.Trainer) -> tuple[EndReason, str, dict[str, Any] | None]:
    """Why a fit that ended normally ended: ``(reason, detail, controller)``."""
    stops = [f for f in firings(trainer) if any(op.endswith("training_stop") for op in f["operations"])]
    if stops:
        last = stops[-1]
        controller = {"name": last["controller"], "step": int(last["step"])}
        detail = f"controller {last['controller']!r} stopped it at step {last['step']}"
        return "controller", detail, controller
    if 0 <= trainer.max_steps <= trainer.global_step:
        return "max_steps", f"max_steps={trainer.max_steps} reached", None
    max_epochs = trainer.max_epochs
    if max_epochs is not None and max_epochs >= 0 and trainer.current_epoch >= max_epochs:
        return "max_epochs", f"max_epochs={max_epochs} reached", None
    if trainer.should_stop:
        return "stopped", "a callback set trainer.should_stop", None
    return "max_epochs", "the training data ended", None


def refused(exception: BaseException) -> bool:
    """Whether ``exception`` is (or was caused by) a `ConfigError`: a refused input, not a failed run."""
    cause: BaseException | None = exception
    while cause is not None and not isinstance(cause, ConfigError):
        cause = cause.__cause__ or cause.__context__
    return cause is not None


def exception_reason(trainer: L.Trainer, exception: BaseException) -> tuple[EndReason, str, int | None]:
    """Why a fit that raised ended: ``(reason, detail, exit_code)``."""
    if isinstance(exception, Preempted):
        return "preempted", f"preempted (exit code {exception.code})", int(exception.code)
    preemption = [c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)]
    if preemption and preemption[0].exit_code is not None:
        code = preemption[0].exit_code
        return "preempted", f"preempted (exit code {code})", code
    if isinstance(exception, KeyboardInterrupt):
        return "interrupted", "interrupted (KeyboardInterrupt)", 1
    return "error", f"{type(exception).__name__}: {exception}".splitlines()[0][:500], None


def end_record(
    trainer: L.Trainer, *, reason: EndReason, detail: str, controller: dict[str, Any] | None
) -> dict[str, Any]:
    """The end record of the fit (see the module's docstring)."""
    metrics = trainer.callback_metrics
    return {
        "reason": reason,
        "detail": detail,
        "step": int(trainer.global_step),
        "epoch": int(trainer.current_epoch),
        "train_loss": _finite(metrics.get("train/loss_total")),
        "val_loss": _finite(metrics.get("val/loss")),
        "checkpoints": [str(p) for p in checkpoint_paths(trainer)],
        "log_dir": str(Path(trainer.log_dir or trainer.default_root_dir).resolve()),
        "controller": controller,
        "exit_code": None,
        "controller_firings": firings(trainer),
        "resume_command": None,
        "metrics": loss_metrics(trainer),
        "objective": objective_of(trainer.lightning_module),
    }


def objective_of(module: Any) -> dict[str, Any] | None:
    """What ``module`` optimizes after presets (`objective_summary`), or ``None`` for a module without an
    `Objective`."""
    objective = getattr(module, "objective", None)
    return objective_summary(objective) if isinstance(objective, Objective) else None


def loss_metrics(trainer: L.Trainer) -> dict[str, float | str | None]:
    """The last step's metrics of the loss (``RegularizedLM.telemetry["metrics"]``: the preference losses'
    ``rewards/accuracies``, ``rewards/margins``, …; the distillation's ``distillation/divergence``, …), empty
    for the other losses."""
    telemetry = getattr(trainer.lightning_module, "telemetry", None)
    metrics = telemetry.get("metrics") if isinstance(telemetry, dict) else None
    return {name: _finite(value) for name, value in (metrics or {}).items()}


def config_file(trainer: L.Trainer) -> Path | None:
    """The config file that ``lit-losses`` saved for this run (LightningCLI's `SaveConfigCallback`: its
    ``config_filename`` in ``trainer.log_dir``), if it was written."""
    for saver in (c for c in trainer.callbacks if isinstance(c, SaveConfigCallback)):
        if trainer.log_dir is not None:
            path = Path(trainer.log_dir) / saver.config_filename
            if path.is_file():
                return path.resolve()
    return None


def resume_command(trainer: L.Trainer, checkpoints: list[str]) -> str | None:
    """The whole command that resumes this run from its newest checkpoint: ``lit-losses fit --config
    <run>/config.yaml --ckpt_path <checkpoint>`` (the run's saved config holds every option it was given;
    ``--ckpt_path`` restores the weights, optimizer, schedule and data position). ``None`` without a
    checkpoint or a saved config (a fit started from Python)."""
    path = config_file(trainer)
    if path is None or not checkpoints:
        return None
    return f"lit-losses fit --config {shlex.quote(str(path))} --ckpt_path {shlex.quote(checkpoints[-1])}"


def checkpoint_paths(trainer: L.Trainer) -> list[Path]:
    """The checkpoints this fit wrote: the callbacks' last and best, the preemption checkpoint, and the
    files of the checkpoint folders (newest last)."""
    found: list[Path] = []
    for callback in trainer.checkpoint_callbacks:
        for attribute in ("best_model_path", "last_model_path", "checkpoint_path"):
            value = getattr(callback, attribute, None)
            if isinstance(value, str | Path) and value:
                found.append(Path(value))
        folder = getattr(callback, "dirpath", None)
        if isinstance(folder, str | Path) and Path(folder).is_dir():
            found += sorted(Path(folder).glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    unique = list(dict.fromkeys(p.resolve() for p in found if p.exists()))
    return sorted(unique, key=lambda p: p.stat().st_mtime)


def _finite(value: Any) -> float | str | None:
    """A logged value as JSON: a float, or ``"nan"``/``"inf"``/``"-inf"`` (strict JSON has none of them)."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else str(value)


def summary_text(record: dict[str, Any]) -> str:
    """The few lines printed when a fit ends.

    Example:
        >>> print(summary_text({"reason": "max_steps", "detail": "max_steps=6 reached", "step": 6,
        ...     "train_loss": 8.1834, "val_loss": None, "log_dir": "runs/x/version_0",
        ...     "checkpoints": ["runs/x/version_0/checkpoints/last.ckpt"]}))
        lit-losses: fit ended at step 6: max_steps=6 reached
          final losses: train/loss_total 8.1834, val/loss -
          run folder:   runs/x/version_0
          checkpoint:   runs/x/version_0/checkpoints/last.ckpt
          look at it:   tensorboard --logdir runs/x/version_0
                        lit-losses report runs/x/version_0  (writes runs/x/version_0/report.html)
    """

    def fmt(value: float | str | None, name: str = "") -> str:
        if value is None or isinstance(value, str):
            return "-" if value is None else value
        return f"{value:.0f}" if name.endswith("num_tokens") else f"{value:.4f}"  # a count

    log_dir = record["log_dir"]
    checkpoint = record["checkpoints"][-1] if record["checkpoints"] else "none written"
    resume = [f"  resume with:  {record['resume_command']}"] if record.get("resume_command") else []
    objective = record.get("objective")
    ran = [f"  objective:    {describe_objective(objective)}"] if objective else []
    metrics = ", ".join(f"{k} {fmt(v, k)}" for k, v in (record.get("metrics") or {}).items())
    return "\n".join(
        [
            f"lit-losses: fit ended at step {record['step']}: {record['detail']}",
            *ran,
            f"  final losses: train/loss_total {fmt(record['train_loss'])}, "
            f"val/loss {fmt(record['val_loss'])}",
            *([f"  last step:    {metrics}"] if metrics else []),
            f"  run folder:   {log_dir}",
            f"  checkpoint:   {checkpoint}",
            *resume,
            f"  look at it:   tensorboard --logdir {log_dir}",
            f"                lit-losses report {log_dir}  (writes {log_dir}/report.html)",
        ]
    )


def add_run_callbacks(trainer: L.Trainer) -> None:
    """What ``lit-losses fit`` adds to every fit: a `RunRecord` and, with a logger, Lightning's
    `LearningRateMonitor` (``lr-<optimizer>`` at every optimizer step), unless the config has them."""
    if not any(isinstance(c, RunRecord) for c in trainer.callbacks):
        trainer.callbacks.append(RunRecord())
    if trainer.loggers and not any(isinstance(c, LearningRateMonitor) for c in trainer.callbacks):
        trainer.callbacks.append(LearningRateMonitor(logging_interval="step"))
