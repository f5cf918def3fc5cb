"""`VerifiedCheckpoints` writes every checkpoint aside with its manifest, then renames it: an interrupted
write never leaves a half-written checkpoint under a checkpoint's name, and `latest_checkpoint` finds the
newest complete one whatever moment the write stopped at."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_losses.checkpoint import VerifiedCheckpoints, latest_checkpoint, verify_checkpoint
from lit_losses.checkpoint.manifest import describe_files, write_folder_manifest
from lit_losses.checkpoint.verified import aside_path, swap_into_place
from tests.helpers import quiet_trainer, seed, tiny_setup


class Stopped(Exception):
    """Where a kill would have ended the process."""


class WriteStopsAt(L.Callback):
    """The process stops in the middle of writing the checkpoint ``name`` after step ``step``: half its
    bytes are on disk when the write raises (what a kill leaves)."""

    def __init__(self, step: int, name: str) -> None:
        self.step, self.name = step, name

    def setup(self, trainer, pl_module, stage) -> None:
        io = trainer.strategy.checkpoint_io
        save = io.save_checkpoint

        def half_then_stop(checkpoint, path, storage_options=None):
            if self.name in Path(path).name and trainer.global_step == self.step:
                save(checkpoint, path)
                data = Path(path).read_bytes()
                Path(path).write_bytes(data[: len(data) // 2])
                raise Stopped("the process stops here")
            save(checkpoint, path, storage_options)

        io.save_checkpoint = half_then_stop


def test_a_write_stopped_midway_leaves_the_previous_checkpoint_under_its_name(text_corpus, tmp_path):
    seed()
    model, data = tiny_setup(text_corpus)
    folder = tmp_path / "ckpts"
    saver = ModelCheckpoint(
        dirpath=folder, every_n_train_steps=1, save_top_k=-1, save_last=True, filename="{step}"
    )
    trainer = quiet_trainer(max_steps=4, callbacks=[VerifiedCheckpoints(), WriteStopsAt(3, "last"), saver])
    with pytest.raises(Stopped):
        trainer.fit(model, data)
    last = verify_checkpoint(folder / "last.ckpt")
    assert last.state == "verified" and last.manifest.global_step == 2  # the previous step's, whole
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 2
    assert (folder / ".last.ckpt.partial").is_file()  # the interrupted write, aside
    assert verify_checkpoint(folder / "step=3.ckpt").manifest.global_step == 3
    assert latest_checkpoint([folder]) == folder / "step=3.ckpt"


def committed_folder(path: Path, content: bytes, step: int) -> Path:
    path.mkdir()
    (path / "shard.bin").write_bytes(content)
    write_folder_manifest(path, describe_files(path, ["shard.bin"]), global_step=step)
    return path


def test_a_folder_is_replaced_by_renames_and_a_stop_between_them_loses_nothing(tmp_path, monkeypatch):
    final = committed_folder(tmp_path / "last.ckpt", b"step 2", step=2)
    swap_into_place(committed_folder(aside_path(final), b"step 3", step=3), final)
    assert (final / "shard.bin").read_bytes() == b"step 3" and os.listdir(tmp_path) == ["last.ckpt"]

    new = committed_folder(aside_path(final), b"step 4", step=4)

    def stop(*args):
        raise Stopped("the process stops between the two renames")

    monkeypatch.setattr(os, "replace", stop)
    with pytest.raises(Stopped):
        swap_into_place(new, final)
    assert sorted(os.listdir(tmp_path)) == [".last.ckpt.partial", ".last.ckpt.replaced"]
    assert latest_checkpoint([tmp_path]) == new  # complete, committed last: the newest checkpoint


def test_a_link_under_the_name_is_replaced_and_its_target_kept(tmp_path):
    """``save_last="link"`` leaves ``last.ckpt`` a link to a periodic checkpoint: a new ``last.ckpt``
    replaces the link, never the checkpoint it points to."""
    target = committed_folder(tmp_path / "step=2.ckpt", b"step 2", step=2)
    (tmp_path / "last.ckpt").symlink_to(target)
    swap_into_place(
        committed_folder(aside_path(tmp_path / "last.ckpt"), b"step 3", step=3), tmp_path / "last.ckpt"
    )
    assert not (tmp_path / "last.ckpt").is_symlink()
    assert verify_checkpoint(tmp_path / "last.ckpt").manifest.global_step == 3
    assert verify_checkpoint(target).manifest.global_step == 2
