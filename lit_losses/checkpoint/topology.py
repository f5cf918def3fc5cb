"""Resuming on another topology: the data position of a checkpoint taken with another number of
data-parallel ranks.

Every checkpoint of a `RegularizedLM` records how its run was laid out (`record_topology`: the
data-parallel size ``D``, ``accumulate_grad_batches`` ``A``, the strategy). Each optimizer step trains a
global batch of ``D × A`` micro-batches, and rank ``r`` of ``D`` takes micro-batches ``r, r + D, …`` of the
epoch's permutation (`lit_losses.data.packing.EpochShuffleSampler`): after ``g`` micro-batches of the epoch
(all ranks together) each rank has taken ``g / D``. A checkpoint counts per rank (Lightning's batch
progress, the loader's `LoaderPosition`); `follow_topology` recounts them for this run's ``D``, so that a
run resumed with another number of processes continues with the next micro-batch of the same epoch. With
the same global batch (``D × A`` unchanged: 2 processes × 2 → 1 process × 4) the resumed run's steps are
those of an uninterrupted run of the new layout; with another global batch it cannot be (one warning).

The weights themselves move between layouts in `lit_losses.checkpoint.reshard`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

TOPOLOGY_KEY = "lit_losses_topology"
"""Checkpoint key: the layout of the run that wrote it (`Topology` as a dict)."""


@dataclass(frozen=True)
class Topology:
    """How a run is laid out, as far as its data position depends on it.

    Attributes:
        data_parallel_size: ranks that train on different micro-batches (DDP's world; FSDP2's data-parallel
            mesh dimension).
        accumulate_grad_batches: micro-batches per rank and optimizer step.
        world_size: processes.
        strategy: the strategy's class name (for messages).
        sharded_model: whether the parameters were sharded (FSDP2, tensor parallel: DTensors).

    Example:
        >>> Topology(2, 2, 2, "ModelParallelStrategy").global_batch
        4
    """

    data_parallel_size: int
    accumulate_grad_batches: int
    world_size: int = 1
    strategy: str = ""
    sharded_model: bool = False

    @property
    def global_batch(self) -> int:
        """Micro-batches per optimizer step, all ranks together."""
        return self.data_parallel_size * self.accumulate_grad_batches

    def __str__(self) -> str:
        return (
            f"{self.data_parallel_size} data-parallel rank(s) × accumulate_grad_batches="
            f"{self.accumulate_grad_batches}"
        )

    @classmethod
    def of(cls, trainer: Any) -> Topology:
        """The layout of ``trainer``'s run."""
        shards = trainer.distributed_sampler_kwargs
        return cls(
            data_parallel_size=int(shards["num_replicas"]) if shards else 1,
            accumulate_grad_batches=int(trainer.accumulate_grad_batches),
            world_size=int(trainer.world_size),
            strategy=type(trainer.strategy).__name__,
            sharded_model=has_sharded_parameters(trainer.lightning_module),
        )

    @classmethod
    def from_record(cls, record: Any) -> Topology | None:
        if not isinstance(record, dict) or "data_parallel_size" not in record:
            return None
        names = ("data_parallel_size", "accumulate_grad_batches", "world_size", "strategy", "sharded_model")
        return cls(**{k: record[k] for k in names if k in record})


def has_sharded_parameters(module: Any) -> bool:
    """Whether ``module`` has DTensor parameters (sharded by FSDP2 or tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    return module is not None and any(isinstance(p, DTensor) for p in module.parameters())


def record_topology(checkpoint: dict[str, Any], trainer: Any) -> None:
    """Write ``trainer``'s `Topology` into ``checkpoint`` (`TOPOLOGY_KEY`)."""
    checkpoint[TOPOLOGY_KEY] = vars(Topology.of(trainer))


def follow_topology(checkpoint: dict[str, Any], now: Topology) -> bool:
    """Recount ``checkpoint``'s per-rank data position for the layout ``now`` (before Lightning restores its
    loops); warn when the global batch changes.

    Returns:
        Whether the checkpoint was changed (another data-parallel size).

    Example:
        >>> counts = {"ready": 4, "started": 4, "processed": 4, "completed": 3}
        >>> progress = {"total": dict(counts), "current": dict(counts)}
        >>> position = {"epoch": 0, "index": 4, "length": 10}  # the loader's, per rank
        >>> fit_loop = {"epoch_loop.batch_progress": progress, "state_dict": {"combined_loader": [position]}}
        >>> ckpt = {TOPOLOGY_KEY: {"data_parallel_size": 2, "accumulate_grad_batches": 2},
        ...         "loops": {"fit_loop": fit_loop}}
        >>> follow_topology(ckpt, Topology(1, 4))  # 2 ranks × 4 micro-batches = 8 on one process
        True
        >>> position["index"], progress["current"]
        (8, {'ready': 8, 'started': 8, 'processed': 8, 'completed': 7})
    """
    saved = Topology.from_record(checkpoint.get(TOPOLOGY_KEY))
    fit_loop = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    positions = [s for s in (fit_loop.get("state_dict") or {}).get("combined_loader") or [] if "index" in s]
    if saved is None:
        if positions and any(p.get("index") for p in positions) and now.data_parallel_size > 1:
            rank_zero_warn(
                "the checkpoint does not record how many data-parallel ranks wrote it (an older lit-losses "
                f"or plain Lightning); resuming as if they were {now.data_parallel_size}, as now"
            )
        return False
    if saved.global_batch != now.global_batch:
        rank_zero_warn(
            f"resuming with a global batch of {now.global_batch} micro-batches ({now}); the checkpoint's run "
            f"had {saved.global_batch} ({saved}): the resumed steps are not those the checkpoint's run "
            "would have taken"
        )
    if saved.data_parallel_size == now.data_parallel_size:
        return False
    ratio = (saved.data_parallel_size, now.data_parallel_size)
    delta = 0
    for position in positions:
        before = int(position["index"])
        position["index"] = _recount(before, ratio, what="micro-batch")
        position["skipped"] = _recount(int(position.get("skipped") or 0), ratio, what="skipped micro-batch")
        position["length"] = None  # per rank, under the old layout; this run's loader knows its own
        delta = position["index"] - before
    _shift_progress(fit_loop.get("epoch_loop.batch_progress") or {}, delta, ratio)
    return True


def _recount(per_rank: int, ratio: tuple[int, int], what: str) -> int:
    """``per_rank`` micro-batches of each of ``ratio[0]`` ranks, as a count per rank of ``ratio[1]``."""
    total = per_rank * ratio[0]
    count, left = divmod(total, ratio[1])
    if left:
        rank_zero_warn(
            f"the checkpoint's data position ({total} {what}(es) of the epoch over {ratio[0]} rank(s)) is no "
            f"whole number per rank over {ratio[1]}: the resumed run starts at {count * ratio[1]}, training "
            f"{left} of them again"
        )
    return count


def _shift_progress(progress: dict[str, Any], delta: int, ratio: tuple[int, int]) -> None:
    """Lightning's batch progress: this epoch's counters move with the loader's index; the earlier
    epochs' part of the totals is recounted."""
    current, total = progress.get("current"), progress.get("total")
    if not current or not total:
        return
    for key in ("ready", "started", "processed", "completed"):
        earlier = int(total[key]) - int(current[key])
        current[key] = int(current[key]) + delta
        total[key] = earlier * ratio[0] // ratio[1] + current[key]
