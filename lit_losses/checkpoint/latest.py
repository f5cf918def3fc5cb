"""``--ckpt_path last``: the newest complete checkpoint of a run, never one that a kill left half-written.

Lightning's ``last`` is the newest ``last*.ckpt`` by modification time, whatever state it is in. Here it is
the checkpoint whose manifest was committed last (`lit_losses.checkpoint.manifest`: its ``written_at_ns``),
among every checkpoint of the run's checkpoint folders: periodic, ``last``, preempted, and one that a kill
left complete under its temporary name while it was being renamed (`VerifiedCheckpoints`). A checkpoint
without a committed manifest is skipped when one with it exists; a run whose checkpoints have none
(plain Lightning's) gets Lightning's choice, verified as far as its structure allows.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

from lit_losses.checkpoint.manifest import MANIFEST_NAME, MARKER_NAME, sidecar_of
from lit_losses.checkpoint.verify import commit_record, verify_checkpoint

_NAME = re.compile(r"^(?:\.(?P<inner>.+\.ckpt)\.(?:partial|replaced)|.+\.ckpt)$")
_LAST = re.compile(r"^last(-v\d+)?\.ckpt$")


def checkpoint_folders(trainer: Any) -> list[Path]:
    """The folders ``trainer``'s checkpoints go to: each `ModelCheckpoint`'s ``dirpath``, and the run's
    ``checkpoints`` folder (where a `ModelCheckpoint` without ``dirpath`` and `PreemptionCheckpoint`
    write: ``<save_dir>/<name>/<version>/checkpoints`` with a logger, else
    ``<default_root_dir>/checkpoints``)."""
    folders = [
        Path(cb.dirpath)
        for cb in trainer.checkpoint_callbacks
        if isinstance(cb, ModelCheckpoint) and cb.dirpath
    ]
    if trainer.loggers:
        logger = trainer.loggers[0]
        version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
        folders.append(
            Path(logger.save_dir or trainer.default_root_dir) / str(logger.name) / version / "checkpoints"
        )
    else:
        folders.append(Path(trainer.default_root_dir) / "checkpoints")
    return list(dict.fromkeys(folders))


def _has_manifest(path: Path) -> bool:
    if path.is_dir():
        return (path / MANIFEST_NAME).exists() or (path / MARKER_NAME).exists()
    return sidecar_of(path).exists()


def latest_checkpoint(
    folders: Iterable[str | Path], where: str = "--ckpt_path last:", hash_content: bool = True
) -> Path | None:
    """The newest committed checkpoint in ``folders``, verified (`verify_checkpoint`); else, when none has a
    manifest, the newest ``last*.ckpt`` (Lightning's choice); ``None`` when there is no checkpoint.

    Raises:
        ConfigError: the newest committed checkpoint does not match its manifest (corrupt: the message
            names it; give an earlier one to ``--ckpt_path``).

    Example:
        >>> import tempfile
        >>> from lit_losses.checkpoint.manifest import write_file_manifest
        >>> folder = Path(tempfile.mkdtemp())
        >>> for name in ("step=2.ckpt", "last.ckpt", "step=4.ckpt"):
        ...     _ = (folder / name).write_bytes(name.encode())
        >>> _ = write_file_manifest(folder / "step=2.ckpt", global_step=2)
        >>> _ = write_file_manifest(folder / "last.ckpt", global_step=2)  # step=4.ckpt: never committed
        >>> latest_checkpoint([folder]).name
        'last.ckpt'
    """
    candidates = [
        path
        for folder in map(Path, folders)
        if folder.is_dir()
        for path in sorted(folder.iterdir())
        if _NAME.match(path.name)
    ]
    committed = []
    for path in candidates:
        record = commit_record(path)
        if record is not None:
            committed.append((record.written_at_ns, not path.name.startswith("."), str(path), path))
    if committed:
        newest = max(committed)[-1]
        verify_checkpoint(newest, where=where, hash_content=hash_content)
        return newest
    plain = [p for p in candidates if _LAST.match(p.name) and not _has_manifest(p)]
    if not plain:
        return None
    newest = max(plain, key=lambda p: (p.stat().st_mtime_ns, str(p)))
    verify_checkpoint(newest, where=where, hash_content=hash_content)
    return newest
