"""One run, one folder: ``lit-losses`` claims its log folder and its config file atomically.

Lightning's `TensorBoardLogger` and `CSVLogger` pick ``version_N`` as one more than the largest version
folder they list, when first asked; two runs started together under the same ``save_dir`` list the same
folders and share ``version_N`` (events, ``config.yaml`` and checkpoints mixed). Here the process of
global rank 0 claims the folder with ``os.mkdir`` (which fails when it exists: the next number is tried)
before anything is written, and claims its config file with ``O_CREAT | O_EXCL``, so that no two runs
write into the same folder or config file unless told to (``--reuse_run_dir``, or ``--ckpt_path``).
The other ranks of a run started by Lightning's launcher take the claimed versions from their parent;
every rank, however started (``torchrun`` on several nodes), takes rank 0's once the processes are connected
(`SharedLoggerVersions`).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from lit_losses.errors import ConfigError

VERSIONS_ENV = "LIT_LOSSES_LOGGER_VERSIONS"
"""How global rank 0 hands the claimed logger versions to the processes it launches."""
MAX_TRIES = 10_000


def is_global_zero() -> bool:
    """Whether this process is global rank 0, known before the trainer launches or joins other processes
    (from the launchers' environment: ``RANK``, ``LOCAL_RANK``, ``SLURM_PROCID``, ``NODE_RANK``)."""
    node = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")) or 0)
    return rank_zero_only.rank == 0 and node == 0


def claim_folder(folder_of: Callable[[int], Path], start: int) -> int:
    """The first ``n >= start`` whose folder ``folder_of(n)`` this call created (``os.mkdir``: atomic, it
    fails when another process made the folder first).

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> (root / "version_0").mkdir()  # another run's
        >>> claim_folder(lambda n: root / f"version_{n}", 0), claim_folder(lambda n: root / f"version_{n}", 0)
        (1, 2)
    """
    for n in range(start, start + MAX_TRIES):
        folder = folder_of(n)
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        return n
    raise ConfigError(f"no free version folder next to {folder_of(start)} after {MAX_TRIES} tries")


def claim_file(folder: Path, name: str, reuse: bool, refuse: str | None) -> Path:
    """Create ``folder/name`` empty with ``O_EXCL``; when it exists: a `ConfigError` ending with ``refuse``
    unless ``reuse``, then the first free ``<stem>_1<suffix>``, ``<stem>_2<suffix>``, …

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> [claim_file(folder, "config.yaml", reuse=True, refuse=None).name for _ in range(3)]
        ['config.yaml', 'config_1.yaml', 'config_2.yaml']
        >>> claim_file(folder, "config.yaml", reuse=False, refuse="pass --reuse_run_dir=true")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: ... already holds another run's config.yaml; pass --reuse_run_dir=true
    """
    folder.mkdir(parents=True, exist_ok=True)
    stem, suffix = os.path.splitext(name)
    for n in range(MAX_TRIES):
        path = folder / (name if n == 0 else f"{stem}_{n}{suffix}")
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            if not reuse:
                raise ConfigError(f"{folder} already holds another run's {name}; {refuse}") from None
            continue
        return path
    raise ConfigError(f"no free config file name in {folder} after {MAX_TRIES} tries")


@dataclass
class RunClaim:
    """What this run created to claim its folder: released when it is refused before it started."""

    folders: list[Path] = field(default_factory=list)
    config_file: Path | None = None

    def release(self, refused: bool = False) -> None:
        """Remove the claimed config file while still empty, and the claimed version folders that are left
        empty. A run ``refused`` before it started (a `ConfigError`, Lightning refusing a trainer option) is
        no run: its config file goes in any case, and so do its version folders with what its loggers wrote
        there before the refusal (the hyper-parameters, an event file), which this run alone created."""
        config = self.config_file
        if config is not None and config.exists() and (refused or config.stat().st_size == 0):
            config.unlink()
        for folder in self.folders:
            if refused:
                shutil.rmtree(folder, ignore_errors=True)
            with contextlib.suppress(OSError):  # written to since: it stays, as a failed run's folder
                folder.rmdir()


def auto_versions(logger_config: Any, loggers: Sequence[Logger]) -> list[dict[str, Any] | None]:
    """For each of ``loggers``: the constructor arguments to build it again with another version when it
    is a `TensorBoardLogger` or `CSVLogger` left to pick its version, else ``None`` (another kind of
    logger, or a version the user gave: their choice). ``logger_config`` is ``trainer.logger`` as parsed."""
    entries = logger_config if isinstance(logger_config, list) else [logger_config]
    default = logger_config is None or logger_config is True
    out: list[dict[str, Any] | None] = []
    for i, logger in enumerate(loggers):
        if not isinstance(logger, TensorBoardLogger | CSVLogger):
            out.append(None)
        elif default:
            from lightning.pytorch.plugins.environments import SLURMEnvironment

            auto = SLURMEnvironment.job_id() is None  # Lightning's default logger: the job id, if any
            out.append({"save_dir": logger.save_dir, "name": logger.name} if auto else None)
        else:
            entry = entries[i] if i < len(entries) else None
            init_args = _as_dict(getattr(entry, "init_args", None) or {})
            kwargs = {**init_args, **_as_dict(getattr(entry, "dict_kwargs", None) or {})}
            accepts = "version" in inspect.signature(type(logger)).parameters
            out.append(kwargs if accepts and kwargs.get("version") is None else None)
    return out


def _as_dict(value: Any) -> dict[str, Any]:
    return value.as_dict() if hasattr(value, "as_dict") else dict(value)


def _version_folder(log_dir: str, version: int) -> Path | None:
    """The ``version_<version>`` folder in ``log_dir`` or among its parents (``None``: another layout)."""
    path = Path(log_dir)
    for folder in (path, *path.parents):
        if folder.name == f"version_{version}":
            return folder
    return None


def claim_logger_versions(
    loggers: list[Logger], rebuild: Sequence[dict[str, Any] | None], claim: RunClaim
) -> tuple[list[Logger], dict[int, int]]:
    """Global rank 0: give each auto-versioned logger a version folder that this run alone created. A
    logger keeps the version it picked when that folder is still free; otherwise it is built again (the
    same arguments) with the next free version. Loggers of this run under one root (TensorBoard and CSV
    in ``save_dir/name``) share its folder, as they would in Lightning. Returns the loggers and the
    claimed versions by index (handed to the ranks this process launches, `launched_logger_versions`)."""
    out, versions = list(loggers), {}
    for i, kwargs in enumerate(rebuild):
        logger = loggers[i]
        if kwargs is None or not isinstance(logger.version, int):
            continue
        if _version_folder(logger.log_dir, logger.version) is None:  # not a version_N layout: left alone
            continue

        def with_version(n: int, logger: Logger = logger, kwargs: dict[str, Any] = kwargs) -> Logger:
            return logger if n == logger.version else type(logger)(**{**kwargs, "version": n})

        def folder_of(n: int, with_version: Callable[[int], Logger] = with_version) -> Path:
            return _version_folder(with_version(n).log_dir, n) or Path(with_version(n).log_dir)

        ours = [v for v in versions.values() if folder_of(v) in claim.folders]
        version = ours[0] if ours else claim_folder(folder_of, logger.version)
        if not ours:
            claim.folders.append(folder_of(version))
        out[i], versions[i] = with_version(version), version
    os.environ[VERSIONS_ENV] = json.dumps({"pid": os.getpid(), "versions": versions})  # this run's, if any
    return out, versions


def launched_logger_versions(loggers: list[Logger], rebuild: Sequence[dict[str, Any] | None]) -> list[Logger]:
    """Another rank launched by global rank 0's process: the versions its parent claimed (none when it was
    not started by that process, e.g. by ``torchrun``: only rank 0 writes logs, and the trainer hands
    rank 0's folders to every rank)."""
    handed = json.loads(os.environ.get(VERSIONS_ENV) or "{}")
    if handed.get("pid") != os.getppid():
        return loggers
    out = list(loggers)
    for key, version in handed.get("versions", {}).items():
        i = int(key)
        if i < len(rebuild) and rebuild[i] is not None:
            out[i] = type(loggers[i])(**{**rebuild[i], "version": version})
    return out


class SharedLoggerVersions(Callback):
    """Every rank takes global rank 0's logger versions once the processes are connected (``setup``).

    Ranks that global rank 0's process launched get its claimed versions from the environment
    (`launched_logger_versions`); processes started otherwise (``torchrun`` on several nodes, SLURM) pick
    their own when first asked, and a rank that lists the log folder after rank 0 created its version
    picks the next one: ``trainer.logger.version`` and ``trainer.log_dir`` would name another folder than
    rank 0's on that rank. Here rank 0's versions are broadcast and the other ranks' loggers built again
    with them (``rebuild``: `auto_versions`).
    """

    def __init__(self, rebuild: Sequence[dict[str, Any] | None]) -> None:
        self.rebuild = list(rebuild)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.world_size < 2:
            return
        versions = trainer.strategy.broadcast([logger.version for logger in trainer.loggers], src=0)
        if trainer.is_global_zero:
            return
        loggers = list(trainer.loggers)
        for i, (logger, version) in enumerate(zip(loggers, versions, strict=True)):
            kwargs = self.rebuild[i] if i < len(self.rebuild) else None
            if kwargs is not None and logger.version != version:
                loggers[i] = type(logger)(**{**kwargs, "version": version})
        trainer.loggers = loggers
