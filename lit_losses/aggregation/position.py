"""Where a `GlobalStatsLoader` is in its pass over the data: what checkpoints save and how a resumed run
starts from it (the ``state_dict`` / ``load_state_dict`` that makes the loader resumable for Lightning)."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from dataclasses import asdict, dataclass, fields
from itertools import islice
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, Sampler

from lit_losses.aggregation.stats import GlobalStats


@dataclass
class LoaderStats(GlobalStats):
    """`GlobalStats` as `GlobalStatsLoader` attaches them: plus where the micro-batch is in the pass.

    `check_window` compares these with Lightning's own batch index and accumulation window, so that a
    loader and a trainer that disagree (a checkpoint without the loader's position, a loader shorter
    than its length) raise instead of training a wrong step.
    """

    index: int = 0
    """Index of the micro-batch in the loader's pass (Lightning's ``batch_idx`` in the epoch)."""
    ends_window: bool = True
    """Whether the loader's accumulation window ends with this micro-batch."""


@dataclass
class LoaderPosition:
    """The position of a `GlobalStatsLoader` in its current pass (saved in checkpoints).

    Attributes:
        epoch: the sampler's epoch when the pass started (``None`` without ``set_epoch``).
        index: micro-batches yielded in this pass (the next one has Lightning's ``batch_idx == index``).
        skipped: micro-batches dropped from the data by `GlobalStatsLoader.skip` in this pass.
        length: micro-batches Lightning takes from this pass (``None``: until the data ends).
        accumulate_grad_batches: the accumulation the windows followed.
        done: the data of the pass ran out (e.g. after skipped micro-batches).
    """

    epoch: int | None = None
    index: int = 0
    skipped: int = 0
    length: int | None = None
    accumulate_grad_batches: int | None = None
    done: bool = False

    @property
    def finished(self) -> bool:
        """Whether the pass is over (a resumed run starts a new one)."""
        return self.done or (self.length is not None and self.index >= self.length)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> LoaderPosition:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in state.items() if k in names})

    def resume_point(self, epoch: int | None, length: int | None, accumulate: int) -> int:
        """The index at which the pass of a run resumed from this (saved) position starts.

        Args:
            epoch: the sampler's epoch in the resumed run (set by Lightning).
            length: micro-batches Lightning takes from the resumed pass.
            accumulate: the resumed run's ``accumulate_grad_batches``.

        Raises:
            RuntimeError: the saved position belongs to another epoch or to data of another length
                (resuming from it would train on other micro-batches than the uninterrupted run).
        """
        if self.finished or self.index == 0:
            return 0
        if self.epoch is not None and epoch is not None and self.epoch < epoch:
            return 0  # Lightning resumes a later epoch: the saved pass ended early (an epoch stop)
        if self.epoch is not None and epoch is not None and self.epoch != epoch:
            raise RuntimeError(
                f"GlobalStatsLoader: the checkpoint's data position is micro-batch {self.index} of epoch "
                f"{self.epoch}, but the resumed run starts epoch {epoch}; the loader and Lightning disagree"
            )
        if self.length is not None and length is not None and self.length != length:
            raise RuntimeError(
                f"GlobalStatsLoader: the checkpoint was taken at micro-batch {self.index} of an epoch of "
                f"{self.length} micro-batches, but this run's epoch has {length}: the data (or "
                "limit_train_batches) changed, so the saved position cannot be restored; resume from an "
                "epoch-end checkpoint or with the same data options"
            )
        if self.index % accumulate:
            from lightning.pytorch.utilities.rank_zero import rank_zero_warn  # Lightning only when it warns

            rank_zero_warn(
                f"GlobalStatsLoader: the checkpoint was taken after micro-batch {self.index % accumulate} of "
                f"an accumulation window of {accumulate}; its partial gradient is not in the checkpoint, so "
                "the resumed run's first step trains only the window's remaining micro-batches"
            )
        return self.index


class SkipSampler(Sampler[Any]):
    """``sampler`` without its first ``start`` items (indices only: nothing is loaded to skip them)."""

    def __init__(self, sampler: Any, start: int) -> None:
        self.sampler = sampler
        self.start = start

    def __iter__(self) -> Iterator[Any]:
        return islice(iter(self.sampler), self.start, None)

    def __len__(self) -> int:
        return max(len(self.sampler) - self.start, 0)


def iterate_from(loader: DataLoader, start: int) -> Iterator[Any]:
    """``loader``'s items from item ``start`` on, loading none of the first ``start``.

    A map-style dataset skips in its sampler (or batch sampler) through a one-off ``DataLoader`` with
    the same settings (workers included, not persistent); an iterable dataset has to produce and drop
    the first ``start`` items.
    """
    if start == 0:
        return DataLoader.__iter__(loader)
    if isinstance(loader.dataset, IterableDataset) or not isinstance(loader.sampler, Sized):
        iterator = DataLoader.__iter__(loader)
        for _ in islice(iterator, start):
            pass
        return iterator
    if loader.batch_sampler is not None:
        index_kwargs: dict[str, Any] = {"batch_sampler": SkipSampler(loader.batch_sampler, start)}
    else:
        index_kwargs = {"sampler": SkipSampler(loader.sampler, start), "batch_size": None}
    settings = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "pin_memory_device": loader.pin_memory_device,
    }
    if loader.num_workers > 0:
        settings["prefetch_factor"] = loader.prefetch_factor
    if hasattr(loader, "in_order"):  # torch >= 2.6
        settings["in_order"] = loader.in_order
    return iter(DataLoader(loader.dataset, **index_kwargs, **settings))
