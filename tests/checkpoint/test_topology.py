"""Resuming on another topology through ``lit-losses fit``, and ``--ckpt_path last`` after a ``SIGKILL``
while ``last.ckpt`` is rewritten (one process, FSDP2).

Every run trains the same global batch (4 micro-batches per optimizer step: 1 process × 4, or 2 × 2) and
checkpoints after every step, in processes of its own (the same threads everywhere: bit-for-bit
comparisons within a topology). A run resumed from another topology's step-2 checkpoint (2-process FSDP2's
sharded folder under 1 process and under 2-process DDP; 1 process's file under 2-process FSDP2) logs the
uninterrupted run of its own topology at steps 2 and 3 (the tolerance of the multi-process tests: the
topologies themselves agree to it). The data position is recounted per rank (`follow_topology`).
"""

from __future__ import annotations

import warnings

import pytest

from lit_losses.checkpoint import verify_checkpoint
from lit_losses.checkpoint.topology import TOPOLOGY_KEY, Topology, follow_topology
from tests.checkpoint.runs import STEPS, fit_process

CKPT_STEP = 2


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Per topology: its uninterrupted run's checkpoint folder and logged losses (run once, on demand)."""
    runs: dict[str, tuple] = {}

    def get(topology: str):
        if topology not in runs:
            root = tmp_path_factory.mktemp(topology) / "run"
            losses = fit_process(root, topology)[1]
            assert sorted(losses) == list(range(STEPS)), losses
            runs[topology] = root / "checkpoints", losses
        return runs[topology]

    return get


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize(("source", "target"), [("fsdp2", "single"), ("fsdp2", "ddp"), ("single", "fsdp2")])
def test_a_checkpoint_resumes_on_another_topology_as_that_topology_runs(
    source, target, uninterrupted, tmp_path
):
    source_dir, source_losses = uninterrupted(source)
    _, expected = uninterrupted(target)
    for step, value in source_losses.items():  # the same global batches: the two topologies agree
        assert value == pytest.approx(expected[step], rel=1e-6, abs=1e-6), (step, source_losses, expected)
    ckpt = source_dir / f"step={CKPT_STEP}.ckpt"
    assert ckpt.is_dir() == (source == "fsdp2")
    resumed = fit_process(tmp_path / "run", target, f"--ckpt_path={ckpt}")[1]
    assert sorted(resumed) == list(range(CKPT_STEP, STEPS))
    for step, value in resumed.items():
        assert value == pytest.approx(expected[step], rel=1e-6, abs=1e-6), (step, resumed, expected)


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("topology", ["single", "fsdp2"])
def test_sigkill_while_last_is_rewritten_then_last_resumes_from_the_newest_complete_one(
    topology, uninterrupted, tmp_path
):
    """Every process is killed inside the write of step 2's ``last.ckpt``: once its file is written, or
    under FSDP2 once ``torch.distributed.checkpoint`` wrote its shards and ``.metadata`` (before
    ``meta.pt``), in both cases before the manifest and the rename. ``last.ckpt`` is still step 1's, whole;
    ``--ckpt_path last`` takes ``step=2.ckpt``, the newest complete checkpoint."""
    _, expected = uninterrupted(topology)
    root = tmp_path / "run"
    kill = [
        "--trainer.callbacks+=tests.checkpoint.runs.KillInsideSave",
        f"--trainer.callbacks.step={CKPT_STEP}",
    ]
    fit_process(root, topology, *kill, expect=-9)
    folder = root / "checkpoints"
    assert verify_checkpoint(folder / "last.ckpt").manifest.global_step == 1
    partial = folder / ".last.ckpt.partial"
    if topology == "fsdp2":
        assert (partial / ".metadata").is_file() and not (partial / "COMMITTED").exists()
    else:
        assert partial.is_file() and not (folder / ".last.ckpt.partial.manifest.json").exists()
    proc, resumed = fit_process(root, topology, "--ckpt_path=last")
    assert f"--ckpt_path last: {folder / 'step=2.ckpt'}" in proc.stdout + proc.stderr
    assert resumed == {s: v for s, v in expected.items() if s >= CKPT_STEP}  # bit for bit


def loops(index: int, world: int, accumulate: int) -> dict:
    counts = {"ready": index, "started": index, "processed": index, "completed": index - 1}
    fit_loop = {
        "epoch_loop.batch_progress": {"total": {**counts}, "current": {**counts}},
        "state_dict": {"combined_loader": [{"epoch": 0, "index": index, "skipped": 0, "length": 50}]},
    }
    record = {"data_parallel_size": world, "accumulate_grad_batches": accumulate}
    return {TOPOLOGY_KEY: record, "loops": {"fit_loop": fit_loop}}


def test_another_global_batch_is_one_warning_and_the_position_is_kept_in_micro_batches():
    checkpoint = loops(index=6, world=2, accumulate=2)  # 12 micro-batches of the epoch trained
    with pytest.warns(UserWarning) as caught:
        assert follow_topology(checkpoint, Topology(data_parallel_size=3, accumulate_grad_batches=2))
    assert len(caught) == 1 and "global batch of 6 micro-batches" in str(caught[0].message)
    position = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert position["index"] == 4 and position["length"] is None  # 12 / 3 ranks
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    assert progress["current"] == {"ready": 4, "started": 4, "processed": 4, "completed": 3}


def test_a_position_that_does_not_split_over_the_ranks_restarts_earlier_with_a_warning():
    checkpoint = loops(index=5, world=2, accumulate=2)  # 10 micro-batches over 4 ranks: 2 each, 2 again
    with pytest.warns(UserWarning, match=r"starts at 8, training 2 of them again"):
        follow_topology(checkpoint, Topology(data_parallel_size=4, accumulate_grad_batches=1))
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["index"] == 2


def test_the_same_layout_changes_nothing_and_says_nothing():
    checkpoint = loops(index=6, world=2, accumulate=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not follow_topology(checkpoint, Topology(data_parallel_size=2, accumulate_grad_batches=2))
    assert checkpoint == loops(index=6, world=2, accumulate=2)
