"""Turning a sharded checkpoint folder into one checkpoint file, and back (``lit-losses checkpoint convert``).

A folder written by FSDP2 (``ModelParallelStrategy(save_distributed_checkpoint=True)``) becomes the file
that one process (or DDP) writes for the same state, e.g. to evaluate or publish a model on one device; a
file becomes a folder of ``torch.distributed.checkpoint`` that any number of FSDP2 processes read. Both
keep everything a resumed run needs (optimizer states, loops, callbacks, the data position): resuming
from the converted checkpoint is resuming from the original. Both directions verify the source first
and write the result aside with its manifest, then rename it (`lit_losses.checkpoint.verified`). The whole
state passes through this process's memory once.

``--ckpt_path`` does not need a converted checkpoint (`VerifiedCheckpoints` reads either layout under any
strategy); converting saves that work at every start, or hands one file to tools that read Lightning
checkpoints.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from lit_losses.checkpoint.manifest import (
    data_files,
    describe_files,
    write_file_manifest,
    write_folder_manifest,
)
from lit_losses.checkpoint.reshard import PARAM_NAMES_KEY, SHARDED_METADATA, name_keyed, read_sharded
from lit_losses.checkpoint.verified import aside_path, remove_path, swap_into_place
from lit_losses.checkpoint.verify import verify_checkpoint
from lit_losses.errors import ConfigError


def convert_checkpoint(source: str | Path, target: str | Path) -> Path:
    """Write checkpoint ``source`` in the other layout at ``target``: a sharded folder as one file, a file as
    a sharded folder.

    Raises:
        ConfigError: ``source`` fails verification or is no checkpoint; ``target`` exists; a file whose
            optimizer state does not name its parameters (plain Lightning's, of a model with an
            optimizer) cannot become a folder, which keys them by name.

    Example:
        >>> import tempfile
        >>> from lit_losses.checkpoint.manifest import write_file_manifest
        >>> folder = Path(tempfile.mkdtemp())
        >>> torch.save({"state_dict": {"w": torch.arange(4.0)}, "global_step": 2}, folder / "a.ckpt")
        >>> _ = write_file_manifest(folder / "a.ckpt", global_step=2)
        >>> sharded = convert_checkpoint(folder / "a.ckpt", folder / "a-sharded.ckpt")
        >>> sorted(p.name for p in sharded.iterdir())
        ['.metadata', 'COMMITTED', '__0_0.distcp', 'manifest.json', 'meta.pt']
        >>> whole = convert_checkpoint(sharded, folder / "b.ckpt")
        >>> torch.load(whole, weights_only=True)["state_dict"]["w"]
        tensor([0., 1., 2., 3.])
    """
    source, target = Path(source), Path(target)
    where = "lit-losses checkpoint convert:"
    verify_checkpoint(source, where=where)
    if target.exists() or target.is_symlink():
        raise ConfigError(f"{where} {target} already exists; give a new path")
    if not target.parent.is_dir():
        raise ConfigError(f"{where} {target}: no such folder {target.parent}")
    if source.resolve().is_dir():
        sharded_to_file(source, target)
    else:
        file_to_sharded(source, target)
    return target


def sharded_to_file(source: Path, target: Path) -> None:
    """A sharded checkpoint folder as one checkpoint file (`read_sharded`), with its manifest."""
    if not (source / SHARDED_METADATA).is_file():
        raise ConfigError(f"lit-losses checkpoint convert: {source} is a folder without {SHARDED_METADATA}")
    checkpoint = read_sharded(source)
    aside = aside_path(target)
    remove_path(aside)
    torch.save(checkpoint, aside)
    swap_into_place(aside, target)
    write_file_manifest(target, global_step=checkpoint.get("global_step"), epoch=checkpoint.get("epoch"))


def file_to_sharded(source: Path, target: Path) -> None:
    """A checkpoint file as a sharded checkpoint folder (Lightning's layout: ``state_dict`` and
    ``optimizer_<i>`` in a ``torch.distributed.checkpoint``, the rest in ``meta.pt``), with its manifest and
    commit marker."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    checkpoint = _load_file(source)
    tensors: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
    states = checkpoint.pop("optimizer_states", None) or []
    names = checkpoint.get(PARAM_NAMES_KEY) or []
    if len(names) < len(states):
        raise ConfigError(
            f"lit-losses checkpoint convert: {source} does not name the parameters of its optimizer state "
            "(written by plain Lightning or an older lit-losses): resume from it under the sharded strategy "
            "with --ckpt_path instead, which names them from the model"
        )
    for i, state in enumerate(states):
        tensors[f"optimizer_{i}"] = name_keyed(state, names[i])
    aside = aside_path(target)
    remove_path(aside)
    aside.mkdir()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist: as meant
        save(tensors, storage_writer=FileSystemWriter(str(aside)), no_dist=True)
    torch.save(checkpoint, aside / SHARDED_METADATA)
    files = describe_files(aside, data_files(aside))
    write_folder_manifest(
        aside, files, global_step=checkpoint.get("global_step"), epoch=checkpoint.get("epoch")
    )
    swap_into_place(aside, target)


def _load_file(source: Path) -> dict[str, Any]:
    try:
        checkpoint = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as err:  # EOFError, RuntimeError, UnpicklingError: all mean "not a checkpoint"
        raise ConfigError(
            f"lit-losses checkpoint convert: {source} is not a readable checkpoint ({err})"
        ) from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ConfigError(
            f"lit-losses checkpoint convert: {source} is not a Lightning checkpoint (no 'state_dict')"
        )
    return checkpoint
