"""`verify_checkpoint` against each way a checkpoint goes wrong, on small checkpoints written here: the
manifest's sizes and SHA-256 (checked against ``hashlib`` on the whole bytes), the commit marker, and the
structure of a plain distributed-checkpoint folder (checked against the files its ``.metadata`` names)."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter, save

from lit_losses.checkpoint.manifest import (
    MANIFEST_NAME,
    MARKER_NAME,
    data_files,
    describe_files,
    sha256_of,
    sidecar_of,
    write_file_manifest,
    write_folder_manifest,
)
from lit_losses.checkpoint.verify import commit_record, verify_checkpoint
from lit_losses.errors import ConfigError


def distributed_folder(path: Path, manifest: bool = True) -> Path:
    """A folder of ``torch.distributed.checkpoint`` (one process) and a ``meta.pt``, as Lightning writes."""
    path.mkdir()
    state = {"state_dict": {"w": torch.arange(3000.0), "b": torch.ones(7)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save(state, storage_writer=FileSystemWriter(str(path)), no_dist=True)
    torch.save({"global_step": 3, "hyper_parameters": {}}, path / "meta.pt")
    if manifest:
        write_folder_manifest(path, describe_files(path, data_files(path)), global_step=3)
    return path


def test_the_manifest_holds_every_files_size_and_sha256(tmp_path):
    folder = distributed_folder(tmp_path / "x.ckpt")
    record = json.loads((folder / MANIFEST_NAME).read_text())
    assert sorted(record["files"]) == [".metadata", "__0_0.distcp", "meta.pt"]
    for name, entry in record["files"].items():
        data = (folder / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert (folder / MARKER_NAME).read_text().strip() == hashlib.sha256(
        (folder / MANIFEST_NAME).read_bytes()
    ).hexdigest()
    assert commit_record(folder).global_step == 3
    assert verify_checkpoint(folder).state == "verified"


def test_a_big_file_is_hashed_in_chunks_as_hashlib_hashes_it_whole(tmp_path):
    path = tmp_path / "big.bin"
    data = torch.randint(0, 256, (3 * (1 << 20) + 17,), dtype=torch.uint8).numpy().tobytes()
    path.write_bytes(data)
    assert sha256_of(path) == hashlib.sha256(data).hexdigest()


def file_checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "step=1.ckpt"
    torch.save({"state_dict": {"w": torch.arange(5000.0)}, "global_step": 1}, path)
    write_file_manifest(path, global_step=1)
    return path


def overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_a_file_that_differs_from_its_manifest_is_refused(tmp_path):
    path = file_checkpoint(tmp_path)
    assert verify_checkpoint(path).state == "verified"
    overwrite(path, path.stat().st_size // 2, b"\x00\x01garbage")
    with pytest.raises(ConfigError, match=r"step=1.ckpt: its content does not match its manifest \(SHA-256"):
        verify_checkpoint(path)
    assert verify_checkpoint(path, hash_content=False).state == "verified"  # sizes alone cannot tell
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ConfigError, match=r"the file has 100 bytes, its manifest says \d+: truncated"):
        verify_checkpoint(path, hash_content=False)


def test_an_unreadable_manifest_is_refused_and_a_missing_one_is_unverifiable(tmp_path):
    path = file_checkpoint(tmp_path)
    sidecar_of(path).write_text("{not json")
    with pytest.raises(ConfigError, match=r"its manifest step=1.ckpt.manifest.json is unreadable"):
        verify_checkpoint(path)
    sidecar_of(path).unlink()
    with pytest.warns(UserWarning, match="has no manifest"):
        assert verify_checkpoint(path).state == "unverifiable"


def _edit_manifest(folder: Path) -> None:
    (folder / MANIFEST_NAME).write_text((folder / MANIFEST_NAME).read_text().replace('"size": ', '"size": 1'))


def remove(name: str):
    return lambda folder: (folder / name).unlink()


def truncate(name: str):
    def cut(folder: Path) -> None:
        with open(folder / name, "r+b") as f:
            f.truncate(10)

    return cut


def garble(name: str):
    return lambda folder: overwrite(folder / name, 600, b"junk")


SHARD = "__0_0.distcp"
FOLDER_DAMAGE = {
    "garbled_shard": (garble(SHARD), f"the content of {SHARD} does not match"),
    "truncated_shard": (truncate(SHARD), f"{SHARD} has 10 bytes, its manifest says"),
    "missing_shard": (remove(SHARD), f"{SHARD} is missing (its manifest lists it)"),
    "missing_metadata": (remove(".metadata"), ".metadata is missing (its manifest lists it)"),
    "missing_meta_pt": (remove("meta.pt"), "meta.pt is missing (its manifest lists it)"),
    "missing_marker": (remove(MARKER_NAME), "no commit marker (COMMITTED)"),
    "missing_manifest": (remove(MANIFEST_NAME), "manifest.json is missing beside its commit marker"),
    "edited_manifest": (_edit_manifest, "manifest.json does not match its commit marker"),
}


@pytest.mark.parametrize("damage", sorted(FOLDER_DAMAGE))
def test_a_damaged_folder_is_refused_naming_the_file(damage, tmp_path):
    folder = distributed_folder(tmp_path / "x.ckpt")
    apply, message = FOLDER_DAMAGE[damage]
    apply(folder)
    with pytest.raises(ConfigError) as error:
        verify_checkpoint(folder, where="--ckpt_path")
    assert str(error.value).startswith(f"--ckpt_path {folder}: {message}")
    assert "\n" not in str(error.value)


PLAIN_DAMAGE = {
    "missing_shard": (remove(SHARD), f"{SHARD} is missing (.metadata names it)"),
    "truncated_shard": (truncate(SHARD), f"{SHARD} has 10 bytes, .metadata reads up to byte"),
    "missing_metadata": (remove(".metadata"), ".metadata is missing (the index of the distributed"),
    "garbled_metadata": (lambda f: (f / ".metadata").write_bytes(b"garbage"), ".metadata is unreadable"),
}


@pytest.mark.parametrize("damage", sorted(PLAIN_DAMAGE))
def test_a_plain_folder_is_checked_as_far_as_its_structure_allows(damage, tmp_path):
    folder = distributed_folder(tmp_path / "x.ckpt", manifest=False)
    with pytest.warns(UserWarning, match="cannot be verified"):
        assert verify_checkpoint(folder).state == "unverifiable"
    apply, message = PLAIN_DAMAGE[damage]
    apply(folder)
    with pytest.raises(ConfigError) as error:
        verify_checkpoint(folder)
    assert str(error.value).startswith(f"--ckpt_path {folder}: {message}")
