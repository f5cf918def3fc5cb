"""Checkpoint manifests: the size and SHA-256 of every file of a checkpoint, written after its data.

A checkpoint file ``<name>.ckpt`` gets a sidecar ``<name>.ckpt.manifest.json``; a checkpoint folder (the
shards, ``.metadata`` and ``meta.pt`` of a distributed checkpoint) gets ``manifest.json`` inside it and then,
last, the commit marker ``COMMITTED``, which holds the manifest's own SHA-256. A folder with a manifest
and no marker was being written when the run stopped. Both are written to a temporary name, flushed to
disk and renamed, so that a kill leaves them whole or absent.

The manifest (JSON)::

    {"format": "lit-losses checkpoint manifest", "version": 1,
     "global_step": 40, "epoch": 0, "written_at_ns": 1732690000000000000,
     "files": {"__0_0.distcp": {"size": 198168, "sha256": "9f2c…"}, …}}

Hashing streams each file in 1 MiB reads (``hashlib``), up to 8 files at a time on threads: about one read
of the checkpoint, at a few hundred MB/s per core (1–2 GB/s with SHA instructions) or the disk's speed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "lit-losses checkpoint manifest"
VERSION = 1
MANIFEST_NAME = "manifest.json"
"""The manifest inside a checkpoint folder."""
MARKER_NAME = "COMMITTED"
"""The commit marker inside a checkpoint folder, written last: the manifest's SHA-256."""
SIDECAR_SUFFIX = ".manifest.json"
"""``<name>.ckpt`` + this: the manifest of a checkpoint file, beside it."""
CHUNK_BYTES = 1 << 20
HASH_THREADS = 8


def sha256_of(path: str | Path) -> str:
    """The SHA-256 of a file's content, read in 1 MiB chunks (memory stays flat whatever its size).

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "x.bin"
        >>> _ = path.write_bytes(b"abc")
        >>> sha256_of(path)[:16]
        'ba7816bf8f01cfea'
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def describe_files(folder: str | Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"size", "sha256"}}`` of the files ``names`` (relative to ``folder``), hashed on up to
    `HASH_THREADS` threads (``hashlib`` releases the GIL on large reads)."""
    folder, names = Path(folder), sorted(names)
    with ThreadPoolExecutor(max_workers=max(1, min(HASH_THREADS, len(names)))) as pool:
        digests = list(pool.map(lambda name: sha256_of(folder / name), names))
    return {
        name: {"size": (folder / name).stat().st_size, "sha256": digest}
        for name, digest in zip(names, digests, strict=True)
    }


def data_files(folder: str | Path) -> list[str]:
    """The files of a checkpoint folder that its manifest covers (all but the manifest and the marker),
    as paths relative to it."""
    folder = Path(folder)
    skip = {MANIFEST_NAME, MARKER_NAME}
    return sorted(
        p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name not in skip
    )


@dataclass(frozen=True)
class Manifest:
    """What a checkpoint's manifest records.

    Attributes:
        files: ``{relative name: {"size": bytes, "sha256": hex}}`` (for a checkpoint file: its own name).
        global_step: the trainer's ``global_step`` at the save (``None`` if unknown).
        epoch: the trainer's epoch at the save.
        written_at_ns: when the manifest was written (``time.time_ns``): which checkpoint is the newest.

    Example:
        >>> m = Manifest({"a.ckpt": {"size": 3, "sha256": "ab"}}, global_step=4, epoch=0, written_at_ns=7)
        >>> Manifest.from_json(m.to_json()) == m
        True
    """

    files: dict[str, dict[str, Any]]
    global_step: int | None = None
    epoch: int | None = None
    written_at_ns: int = field(default_factory=time.time_ns)

    def to_json(self) -> str:
        body = {"format": FORMAT, "version": VERSION, "global_step": self.global_step, "epoch": self.epoch}
        return json.dumps({**body, "written_at_ns": self.written_at_ns, "files": self.files}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse a manifest; ``ValueError`` when it is not one (not JSON, another format, no files)."""
        data = json.loads(text)
        if (
            not isinstance(data, dict)
            or data.get("format") != FORMAT
            or not isinstance(data.get("files"), dict)
        ):
            raise ValueError("not a lit-losses checkpoint manifest")
        return cls(
            data["files"], data.get("global_step"), data.get("epoch"), int(data.get("written_at_ns", 0))
        )


def write_durably(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file that is flushed to disk and renamed (the folder
    flushed too): a kill or a power loss leaves the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    sync_folder(path.parent)


def sync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename into it) to disk, where the platform allows it."""
    if os.name != "posix":
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def sidecar_of(path: str | Path) -> Path:
    """The manifest of checkpoint file ``path``: ``<path>.manifest.json``."""
    path = Path(path)
    return path.with_name(path.name + SIDECAR_SUFFIX)


def write_file_manifest(
    path: str | Path, global_step: int | None = None, epoch: int | None = None, name: str | None = None
) -> Manifest:
    """Hash checkpoint file ``path`` and write its sidecar manifest (for the file's final ``name``,
    default its own, when it is written aside and renamed after).

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "step=1.ckpt"
        >>> _ = path.write_bytes(b"abc")
        >>> write_file_manifest(path, global_step=1).files["step=1.ckpt"]["size"], sidecar_of(path).name
        (3, 'step=1.ckpt.manifest.json')
    """
    path = Path(path)
    files = {name or path.name: describe_files(path.parent, [path.name])[path.name]}
    manifest = Manifest(files, global_step=global_step, epoch=epoch)
    write_durably(sidecar_of(path.with_name(name or path.name)), manifest.to_json())
    return manifest


def write_folder_manifest(
    folder: str | Path,
    files: dict[str, dict[str, Any]],
    global_step: int | None = None,
    epoch: int | None = None,
) -> Manifest:
    """Write ``manifest.json`` (``files`` as `describe_files` gives them) into a checkpoint folder, then the
    commit marker ``COMMITTED`` holding the manifest's SHA-256."""
    folder = Path(folder)
    manifest = Manifest(files, global_step=global_step, epoch=epoch)
    write_durably(folder / MANIFEST_NAME, manifest.to_json())
    write_durably(folder / MARKER_NAME, sha256_of(folder / MANIFEST_NAME) + "\n")
    return manifest
