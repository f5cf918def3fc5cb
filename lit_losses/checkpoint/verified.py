"""`VerifiedCheckpoints`: every checkpoint a fit writes can be verified and is never half-written under
its name; every checkpoint it reads may come from another layout.

Lightning writes every checkpoint (`ModelCheckpoint`'s periodic and ``last`` ones, `PreemptionCheckpoint`'s,
``trainer.save_checkpoint``) through its strategy's ``save_checkpoint``, removes them through
``remove_checkpoint`` and reads them through ``load_checkpoint``, under one process, DDP and FSDP2 alike.
For the length of a ``Trainer`` call this callback puts its own versions of those three methods on the
strategy object (its class is untouched, and they go back at ``teardown``):

- **save**: the checkpoint is written aside (``.<name>.partial`` in the same folder), its manifest is
  written (`lit_losses.checkpoint.manifest`; a folder's shards are hashed by all ranks, each its share,
  and its commit marker comes last), then it is renamed to its name. A folder that already has the name
  (the ``last.ckpt`` rewritten at every save) is first renamed to ``.<name>.replaced``, then deleted: a
  kill at any moment leaves the previous checkpoint or the new one under the name, and the other one
  complete beside it, never a mix (Lightning rewrites a folder in place).
- **remove**: a checkpoint file's manifest goes with it.
- **load**: every rank reads global rank 0's choice of checkpoint; a sharded folder loads under a
  strategy without sharded parameters (one process, DDP) and a file under FSDP2 / tensor parallelism
  (`lit_losses.checkpoint.reshard`).
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from lit_losses.checkpoint.manifest import (
    data_files,
    describe_files,
    sidecar_of,
    sync_folder,
    write_file_manifest,
    write_folder_manifest,
)
from lit_losses.checkpoint.reshard import PARAM_NAMES_KEY, SHARDED_METADATA, load_into_sharded, read_sharded
from lit_losses.checkpoint.topology import TOPOLOGY_KEY, Topology, has_sharded_parameters

ASIDE_SUFFIX = ".partial"
"""``.<name>`` + this: where a checkpoint is written before it is renamed to ``<name>``."""
REPLACED_SUFFIX = ".replaced"
"""``.<name>`` + this: the folder a new checkpoint replaces, until it is deleted."""
_WRAPPED = ("save_checkpoint", "remove_checkpoint", "load_checkpoint")


def aside_path(path: str | Path, suffix: str = ASIDE_SUFFIX) -> Path:
    """Where checkpoint ``path`` is written before it is renamed to its name.

    Example:
        >>> aside_path("ckpts/last.ckpt").as_posix()
        'ckpts/.last.ckpt.partial'
    """
    path = Path(path)
    return path.with_name(f".{path.name}{suffix}")


class VerifiedCheckpoints(L.Callback):
    """Write every checkpoint with its manifest, aside then renamed; read checkpoints of any layout.

    ``lit-losses`` adds it to every run; add it to a ``Trainer`` of your own in Python (and verify a
    checkpoint before you resume from it with `lit_losses.checkpoint.verify_checkpoint`).

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[VerifiedCheckpoints()], logger=False, enable_progress_bar=False)
        >>> any(isinstance(c, VerifiedCheckpoints) for c in trainer.callbacks)
        True
    """

    def __init__(self) -> None:
        super().__init__()
        self._strategy: Any = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if self._strategy is strategy:
            return
        own = {
            "save_checkpoint": save_verified,
            "remove_checkpoint": remove_with_manifest,
            "load_checkpoint": load_any_layout,
        }
        for name in _WRAPPED:
            original = getattr(strategy, name)
            setattr(strategy, name, functools.partial(own[name], strategy=strategy, original=original))
        self._strategy = strategy

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy, self._strategy = self._strategy, None
        for name in _WRAPPED if strategy is not None else ():
            strategy.__dict__.pop(name, None)  # the class's own method again


def save_verified(
    checkpoint: dict[str, Any],
    filepath: str | Path,
    storage_options: Any = None,
    *,
    strategy: Any,
    original: Any,
) -> None:
    """``strategy.save_checkpoint``: written aside, manifest (and commit marker), renamed into place.
    Every rank calls it (as Lightning calls the strategy's)."""
    final = Path(strategy.broadcast(str(filepath)))
    aside = aside_path(final)
    step, epoch = checkpoint.get("global_step"), checkpoint.get("epoch")
    if strategy.is_global_zero:
        remove_path(aside)  # a write that a kill interrupted
    strategy.barrier("lit_losses.checkpoint.aside")
    if storage_options is None:
        original(checkpoint, aside)
    else:
        original(checkpoint, aside, storage_options)
    strategy.barrier("lit_losses.checkpoint.written")
    folder = strategy.broadcast(aside.is_dir())
    files = hash_shares(strategy, aside) if folder else {}
    if strategy.is_global_zero:
        if folder:
            write_folder_manifest(aside, files, global_step=step, epoch=epoch)
        swap_into_place(aside, final)
        if not folder:
            write_file_manifest(final, global_step=step, epoch=epoch)
    strategy.barrier("lit_losses.checkpoint.committed")


def hash_shares(strategy: Any, folder: Path) -> dict[str, dict[str, Any]]:
    """The size and SHA-256 of every file of ``folder``: rank ``r`` of ``W`` hashes files ``r, r + W, …``,
    global rank 0 gets them all."""
    names = strategy.broadcast(data_files(folder) if strategy.is_global_zero else None)
    rank, world = getattr(strategy, "global_rank", 0), getattr(strategy, "world_size", 1)
    mine = describe_files(folder, names[rank::world])
    if world == 1 or not dist.is_initialized():
        return mine
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    return {name: entry for part in gathered for name, entry in part.items()}


def swap_into_place(aside: Path, final: Path) -> None:
    """Rename ``aside`` to ``final``; an old checkpoint there goes (a folder: renamed, then deleted)."""
    sidecar_of(final).unlink(missing_ok=True)  # the old file's manifest never describes the new file
    replaced = aside_path(final, REPLACED_SUFFIX)
    remove_path(replaced)
    if final.is_symlink() and aside.is_dir():
        final.unlink()  # a link (``save_last="link"``): its target stays
    elif final.exists() and (final.is_dir() or aside.is_dir()):
        os.rename(final, replaced)  # a folder cannot be replaced in one rename
    os.replace(aside, final)
    sync_folder(final.parent)
    remove_path(replaced)


def remove_path(path: Path) -> None:
    """Delete a file, link or folder (nothing if absent)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def remove_with_manifest(filepath: str | Path, *, strategy: Any, original: Any) -> None:
    """``strategy.remove_checkpoint``: the checkpoint, and a checkpoint file's manifest."""
    original(filepath)
    if strategy.is_global_zero:
        sidecar_of(filepath).unlink(missing_ok=True)


def load_any_layout(
    checkpoint_path: str | Path, weights_only: bool | None = None, *, strategy: Any, original: Any
) -> dict[str, Any]:
    """``strategy.load_checkpoint``: global rank 0's checkpoint, whichever layout wrote it."""
    path = Path(strategy.broadcast(str(checkpoint_path)))
    sharded_model = has_sharded_parameters(strategy.lightning_module)
    folder = path.is_dir() and (path / SHARDED_METADATA).is_file()
    if folder and not sharded_model and isinstance(strategy, SingleDeviceStrategy | DDPStrategy):
        return read_sharded(path, weights_only=weights_only)
    if path.is_file() and sharded_model:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        writer = Topology.from_record(checkpoint.get(TOPOLOGY_KEY))
        if PARAM_NAMES_KEY not in checkpoint and writer is not None and writer.sharded_model:
            return original(path, weights_only=weights_only)  # Lightning's own file: its own order
        strict = strategy.lightning_module.strict_loading
        return load_into_sharded(checkpoint, strategy.model, strategy.optimizers, strict=strict)
    return original(path, weights_only=weights_only)
