"""Through ``lit-losses fit`` (one process): a checkpoint is verified before anything is restored from it,
``--ckpt_path last`` is the newest complete checkpoint, a checkpoint without a manifest loads with a
warning, and a sharded folder made by ``lit-losses checkpoint convert`` resumes; every resumed run logs
the uninterrupted run's losses bit for bit."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from lit_losses.checkpoint.manifest import sidecar_of
from lit_losses.cli import cli_main
from lit_losses.cli.checkpoint import checkpoint_main
from tests.checkpoint.runs import STEPS, fit_args, fit_here


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The uninterrupted run (a checkpoint file and its manifest after every step) and its losses."""
    root = tmp_path_factory.mktemp("full") / "run"
    losses = fit_here(root)
    assert sorted(losses) == list(range(STEPS))
    return root / "checkpoints", losses


@pytest.fixture(scope="module")
def sharded(full, tmp_path_factory):
    """The step-2 checkpoint as a sharded folder, written by ``lit-losses checkpoint convert``."""
    folder = tmp_path_factory.mktemp("sharded") / "step=2.ckpt"
    checkpoint_main(["convert", str(full[0] / "step=2.ckpt"), str(folder)])
    return folder


def copy_checkpoint(source: Path, folder: Path, manifest: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / source.name
    if source.is_dir():
        shutil.copytree(source, target)
    else:
        shutil.copy2(source, target)
        if manifest:
            shutil.copy2(sidecar_of(source), sidecar_of(target))
    return target


def garble(path: Path, n: int = 4096) -> None:
    """``n`` random bytes in the middle of ``path`` (its size unchanged)."""
    data = bytearray(path.read_bytes())
    start = len(data) // 2 - n // 2
    data[start : start + n] = os.urandom(n)
    path.write_bytes(bytes(data))


def refused(root: Path, ckpt: Path, capsys) -> str:
    """Resume from ``ckpt``: exit code 2 and one line on stderr (returned), before any training step."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(fit_args(root, "single", f"--ckpt_path={ckpt}"))
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert not (root / "checkpoints").exists()  # no step taken, nothing written
    return lines[0]


def test_a_garbled_checkpoint_file_is_refused_in_one_line(full, tmp_path, capsys):
    ckpt = copy_checkpoint(full[0] / "step=2.ckpt", tmp_path / "ckpts")
    garble(ckpt)
    line = refused(tmp_path / "run", ckpt, capsys)
    assert line.startswith(f"lit-losses: error: --ckpt_path {ckpt}: its content does not match its manifest")


def _garble_shard(folder: Path) -> None:
    garble(folder / "__0_0.distcp")


def _remove(name: str):
    return lambda folder: (folder / name).unlink()


SHARDED_DAMAGE = {
    "garbled_shard": (_garble_shard, "the content of __0_0.distcp does not match its manifest"),
    "missing_shard": (_remove("__0_0.distcp"), "__0_0.distcp is missing (its manifest lists it)"),
    "missing_metadata": (_remove(".metadata"), ".metadata is missing (its manifest lists it)"),
    "missing_marker": (_remove("COMMITTED"), "no commit marker (COMMITTED): the checkpoint was still being"),
}


@pytest.mark.parametrize("damage", sorted(SHARDED_DAMAGE))
def test_a_damaged_sharded_checkpoint_is_refused_in_one_line(damage, sharded, tmp_path, capsys):
    ckpt = copy_checkpoint(sharded, tmp_path / "ckpts")
    apply, message = SHARDED_DAMAGE[damage]
    apply(ckpt)
    assert refused(tmp_path / "run", ckpt, capsys).startswith(
        f"lit-losses: error: --ckpt_path {ckpt}: {message}"
    )


def test_a_checkpoint_without_manifest_loads_with_a_warning_and_resumes_exactly(full, tmp_path):
    ckpt = copy_checkpoint(full[0] / "step=2.ckpt", tmp_path / "plain", manifest=False)  # plain Lightning's
    with pytest.warns(UserWarning, match=r"has no manifest .*: it cannot be verified before it is restored"):
        resumed = fit_here(tmp_path / "run", f"--ckpt_path={ckpt}")
    assert resumed == {s: v for s, v in full[1].items() if s >= 2}


def test_a_sharded_folder_resumes_under_one_process_and_converts_back(full, sharded, tmp_path, capsys):
    checkpoint_main(["verify", str(sharded)])
    assert capsys.readouterr().out.strip() == f"lit-losses: {sharded}: verified (step 2)"
    resumed = fit_here(tmp_path / "run", f"--ckpt_path={sharded}")
    assert resumed == {s: v for s, v in full[1].items() if s >= 2}
    back = tmp_path / "back.ckpt"
    checkpoint_main(["convert", str(sharded), str(back)])
    original, converted = (torch.load(p, weights_only=True) for p in (full[0] / "step=2.ckpt", back))
    assert original["state_dict"].keys() == converted["state_dict"].keys()
    assert all(torch.equal(v, converted["state_dict"][k]) for k, v in original["state_dict"].items())
    assert original["optimizer_states"][0]["param_groups"] == converted["optimizer_states"][0]["param_groups"]
    for index, state in original["optimizer_states"][0]["state"].items():
        assert all(
            torch.equal(v, converted["optimizer_states"][0]["state"][index][k]) for k, v in state.items()
        )
    with pytest.raises(SystemExit) as exit_info:
        checkpoint_main(["convert", str(sharded), str(back)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"{back} already exists; give a new path")


def test_last_resumes_from_the_newest_complete_checkpoint(full, tmp_path, caplog):
    """The state a kill leaves while step 3's ``last.ckpt`` is being written and step 4's file was renamed
    but not yet given its manifest: ``last.ckpt`` still step 2's, ``.last.ckpt.partial`` half a file,
    ``step=4.ckpt`` without manifest. ``last`` is ``step=3.ckpt``, the newest committed."""
    source, root = full[0], tmp_path / "run"
    folder = root / "checkpoints"
    for name in ("step=1.ckpt", "step=2.ckpt", "step=3.ckpt"):
        copy_checkpoint(source / name, folder)
    shutil.copy2(source / "step=2.ckpt", folder / "last.ckpt")
    shutil.copy2(sidecar_of(source / "step=2.ckpt"), sidecar_of(folder / "last.ckpt"))
    half = (source / "step=3.ckpt").read_bytes()
    (folder / ".last.ckpt.partial").write_bytes(half[: len(half) // 2])
    shutil.copy2(source / "step=4.ckpt", folder / "step=4.ckpt")
    with caplog.at_level(logging.INFO):
        resumed = fit_here(root, "--ckpt_path=last")
    assert f"--ckpt_path last: {folder / 'step=3.ckpt'}" in caplog.text
    assert resumed == {3: full[1][3]}
