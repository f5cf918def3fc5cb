"""Verifying a checkpoint before anything is restored from it.

A checkpoint that lit-losses wrote carries its manifest (`lit_losses.checkpoint.manifest`): every file's
size and SHA-256, and for a folder the commit marker written last. `verify_checkpoint` checks them: a
file that differs from its manifest, a shard or ``.metadata`` that is missing, a folder without its marker
(its write never finished) is one `ConfigError` line naming the checkpoint and the file. A checkpoint
without a manifest (plain Lightning's, or an older lit-losses') cannot be verified: it is accepted with a
warning, after the checks its structure allows (a folder's ``.metadata`` and every shard it names).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit_losses.checkpoint.manifest import (
    MANIFEST_NAME,
    MARKER_NAME,
    Manifest,
    describe_files,
    sha256_of,
    sidecar_of,
)
from lit_losses.errors import ConfigError

CheckpointState = Literal["verified", "unverifiable"]
SHARDED_METADATA = "meta.pt"
"""The non-tensor part of Lightning's sharded checkpoint folder."""
DCP_METADATA = ".metadata"
"""The index of a ``torch.distributed.checkpoint`` folder: which file holds which tensor."""


@dataclass(frozen=True)
class Verification:
    """The outcome of `verify_checkpoint` for a checkpoint that may be restored.

    Attributes:
        path: the checkpoint (a symbolic link resolved).
        state: ``verified`` (its manifest matched) or ``unverifiable`` (it has none).
        manifest: its manifest (``None`` when unverifiable).
    """

    path: Path
    state: CheckpointState
    manifest: Manifest | None = None


def verify_checkpoint(
    path: str | Path, where: str = "--ckpt_path", hash_content: bool = True, warn: bool = True
) -> Verification:
    """Check checkpoint ``path`` (a file or a folder) against its manifest before it is restored.

    Args:
        path: the checkpoint.
        where: what named it, for messages (``--ckpt_path``).
        hash_content: also compare every file's SHA-256 (else sizes and presence only: what a process
            that is not global rank 0 checks while rank 0 hashes).
        warn: warn about an ``unverifiable`` checkpoint (else the caller does, with
            `warn_unverifiable`, e.g. once it has read it).

    Returns:
        `Verification`.

    Raises:
        ConfigError: one line naming the checkpoint and what is wrong (a file whose size or content
            differs from the manifest, a missing file, a folder without its commit marker, an unreadable
            manifest, a plain folder without ``.metadata`` or with a missing shard).

    Example:
        >>> import tempfile
        >>> from lit_losses.checkpoint.manifest import write_file_manifest
        >>> path = Path(tempfile.mkdtemp()) / "step=1.ckpt"
        >>> _ = path.write_bytes(b"weights")
        >>> _ = write_file_manifest(path, global_step=1)
        >>> verify_checkpoint(path).state
        'verified'
        >>> _ = path.write_bytes(b"weighs!")  # same size, other bytes
        >>> verify_checkpoint(path)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: --ckpt_path .../step=1.ckpt: its content does not match ...
    """
    given = Path(path)
    if not given.exists():
        raise ConfigError(f"{where} {given}: no such checkpoint file or folder")
    label, real = f"{where} {given}", given.resolve()
    verification = (
        _verify_folder(real, label, hash_content)
        if real.is_dir()
        else _verify_file(real, label, hash_content)
    )
    if warn:
        warn_unverifiable(verification, where)
    return verification


def warn_unverifiable(verification: Verification, where: str = "--ckpt_path") -> None:
    """Warn that a checkpoint without a manifest cannot be verified (nothing for a verified one)."""
    if verification.state == "unverifiable":
        rank_zero_warn(
            f"{where} {verification.path} has no manifest (written by plain Lightning or an older "
            "lit-losses): it cannot be verified before it is restored"
        )


def commit_record(path: str | Path) -> Manifest | None:
    """The manifest of a committed checkpoint, read without hashing its data (cheap: which checkpoint
    is the newest); ``None`` for a checkpoint without a manifest, a folder without its commit marker or
    whose marker does not match, an unreadable manifest."""
    path = Path(path).resolve()
    try:
        if path.is_dir():
            manifest_path, marker = path / MANIFEST_NAME, path / MARKER_NAME
            if not marker.is_file() or marker.read_text().strip() != sha256_of(manifest_path):
                return None
            return Manifest.from_json(manifest_path.read_text(encoding="utf-8"))
        return Manifest.from_json(sidecar_of(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _read_manifest(path: Path, label: str) -> Manifest:
    try:
        return Manifest.from_json(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{label}: its manifest {path.name} is unreadable ({err})") from None


def _verify_file(path: Path, label: str, hash_content: bool) -> Verification:
    sidecar = sidecar_of(path)
    if not sidecar.is_file():
        return Verification(path, "unverifiable")
    manifest = _read_manifest(sidecar, label)
    if len(manifest.files) != 1:
        raise ConfigError(f"{label}: its manifest {sidecar.name} lists {len(manifest.files)} files, not one")
    (entry,) = manifest.files.values()
    _check_files(path.parent, {path.name: entry}, label, hash_content=hash_content, own=True)
    return Verification(path, "verified", manifest)


def _verify_folder(folder: Path, label: str, hash_content: bool) -> Verification:
    manifest_path, marker = folder / MANIFEST_NAME, folder / MARKER_NAME
    if not manifest_path.exists() and not marker.exists():
        if (folder / SHARDED_METADATA).is_file():  # else no checkpoint at all: `read_checkpoint` says so
            check_plain_folder(folder, label)
        return Verification(folder, "unverifiable")
    if not marker.is_file():
        raise ConfigError(
            f"{label}: no commit marker ({MARKER_NAME}): the checkpoint was still being written when its "
            "run stopped; resume from an earlier checkpoint"
        )
    if not manifest_path.is_file():
        raise ConfigError(f"{label}: {MANIFEST_NAME} is missing beside its commit marker {MARKER_NAME}")
    if marker.read_text(encoding="utf-8", errors="replace").strip() != sha256_of(manifest_path):
        raise ConfigError(f"{label}: {MANIFEST_NAME} does not match its commit marker {MARKER_NAME}")
    manifest = _read_manifest(manifest_path, label)
    _check_files(folder, manifest.files, label, hash_content=hash_content, own=False)
    return Verification(folder, "verified", manifest)


def _check_files(folder: Path, files: dict, label: str, hash_content: bool, own: bool) -> None:
    """Sizes first (cheap: a truncated or missing file is named at once), then content."""
    what = (lambda name: "the file") if own else (lambda name: name)
    for name, entry in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            raise ConfigError(f"{label}: {name} is missing (its manifest lists it)")
        size = path.stat().st_size
        if size != entry.get("size"):
            raise ConfigError(
                f"{label}: {what(name)} has {size} bytes, its manifest says {entry.get('size')}: truncated "
                "or changed after it was written"
            )
    if not hash_content:
        return
    found = describe_files(folder, list(files))
    for name, entry in sorted(files.items()):
        if found[name]["sha256"] != entry.get("sha256"):
            subject = "its content does not" if own else f"the content of {name} does not"
            raise ConfigError(
                f"{label}: {subject} match its manifest (SHA-256 {found[name]['sha256'][:12]}…, expected "
                f"{str(entry.get('sha256'))[:12]}…): corrupt or changed after it was written"
            )


def check_plain_folder(folder: Path, label: str) -> None:
    """The checks a distributed-checkpoint folder without a manifest allows: its ``.metadata`` is readable
    and every file it names is there, at least as long as the bytes it reads from it.

    Raises:
        ConfigError: ``.metadata`` missing or unreadable, a shard missing or too short.
    """
    from torch.distributed.checkpoint import FileSystemReader

    if not (folder / DCP_METADATA).is_file():
        raise ConfigError(
            f"{label}: {DCP_METADATA} is missing (the index of the distributed checkpoint's shards): the "
            "folder is incomplete"
        )
    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as err:  # an unpickling error of any kind: the index is damaged
        raise ConfigError(f"{label}: {DCP_METADATA} is unreadable ({type(err).__name__}: {err})") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        path = folder / name
        if not path.is_file():
            raise ConfigError(f"{label}: {name} is missing ({DCP_METADATA} names it)")
        if path.stat().st_size < end:
            raise ConfigError(
                f"{label}: {name} has {path.stat().st_size} bytes, {DCP_METADATA} reads up to byte {end}: "
                "truncated"
            )
