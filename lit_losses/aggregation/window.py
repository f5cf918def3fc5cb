"""Lightning's accumulation window as the aggregation sees it: ``A × D``, where a window ends, and the
`GlobalStatsLoader` windows kept in step with it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
from lightning_utilities.core.apply_func import apply_to_collection

from lit_losses.aggregation.loader import (
    GLOBAL_STATS_KEY,
    BatchTransform,
    GlobalStatsLoader,
    data_parallel_group,
)
from lit_losses.aggregation.position import LoaderStats
from lit_losses.aggregation.stats import GlobalStats, LabelFormat


def accumulation_factor(trainer: L.Trainer | None) -> int:
    """``A × D``: what Lightning (``accumulate_grad_batches``) and DDP (world size) divide a
    micro-batch's gradient by (1 without a trainer)."""
    if trainer is None:
        return 1
    return int(trainer.accumulate_grad_batches) * int(trainer.world_size)


def window_ends(trainer: L.Trainer | None, batch_idx: int) -> bool:
    """Whether Lightning steps the optimizer after micro-batch ``batch_idx`` (always without a trainer)."""
    if trainer is None:
        return True
    accumulate = trainer.accumulate_grad_batches
    return (batch_idx + 1) % accumulate == 0 or batch_idx + 1 >= trainer.num_training_batches


def check_window(batch: Mapping[str, Any], batch_idx: int, trainer: L.Trainer | None) -> None:
    """Raise when the statistics attached to ``batch`` place it elsewhere than Lightning does: another
    index in the epoch, another position in its accumulation window, or a window that ends where
    Lightning's does not (or the reverse). A wrong step would otherwise be normalized by another
    window's counts, or train a window cut in two.

    Example:
        >>> from lit_losses.aggregation.position import LoaderStats
        >>> check_window({"global_stats": LoaderStats(position=0, index=4)}, 4, None)
        >>> check_window({"global_stats": LoaderStats(position=0, index=0)}, 4, None)
        Traceback (most recent call last):
        ...
        RuntimeError: GlobalStatsLoader yields micro-batch 0 of its pass where Lightning is at batch 4...
    """
    stats = batch.get(GLOBAL_STATS_KEY)
    if not isinstance(stats, GlobalStats):
        return
    if isinstance(stats, LoaderStats) and stats.index != batch_idx:
        raise RuntimeError(
            f"GlobalStatsLoader yields micro-batch {stats.index} of its pass where Lightning is at batch "
            f"{batch_idx} of the epoch: the loader and Lightning disagree on the position in the epoch "
            "(e.g. a checkpoint saved without the loader's position: resume from an epoch-end checkpoint)"
        )
    accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
    if batch_idx % accumulate != stats.position:
        raise RuntimeError(
            f"GlobalStatsLoader window out of step with Lightning's accumulation: batch {batch_idx} is "
            f"micro-batch {stats.position} of its window, Lightning expects {batch_idx % accumulate}"
        )
    if isinstance(stats, LoaderStats) and trainer is not None:
        lightning_ends = window_ends(trainer, batch_idx)
        if stats.ends_window != lightning_ends:
            says = ("ends", "does not") if stats.ends_window else ("does not end", "does")
            raise RuntimeError(
                f"GlobalStatsLoader {says[0]} the accumulation window at batch {batch_idx}, Lightning "
                f"{says[1]} (its epoch has {trainer.num_training_batches} batches, accumulate_grad_batches="
                f"{accumulate}): the step would train another window than the one its loss is normalized by"
            )


def train_loaders(trainer: L.Trainer) -> list[GlobalStatsLoader]:
    """The `GlobalStatsLoader` s of ``trainer``'s training data (empty before the fit sets them up)."""
    found: list[GlobalStatsLoader] = []
    apply_to_collection(trainer.train_dataloader, GlobalStatsLoader, found.append)
    return found


def configure_train_loaders(
    trainer: L.Trainer,
    mask_keys: Sequence[str],
    ignore_index: int,
    label_format: LabelFormat = "next_token",
    transform: BatchTransform | None = None,
) -> None:
    """Configure every `GlobalStatsLoader` of ``trainer``'s fit (``A``, mask keys, batches per epoch, the
    model's label format, the transform of its micro-batches before they are counted)."""

    for loader in train_loaders(trainer):
        loader.configure(
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            mask_keys=mask_keys,
            ignore_index=ignore_index,
            max_batches=trainer.num_training_batches,
            label_format=label_format,
            transform=transform,
        )
        if loader.process_group is None:  # counts are summed over the data-parallel ranks only
            loader.process_group = data_parallel_group(trainer)
