"""Lightning's accumulation window as the aggregation sees it: ``A × D``, where a window ends, and the
`GlobalStatsLoader` windows kept in step with it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
from lightning_utilities.core.apply_func import apply_to_collection

from lit_losses.aggregation.loader import GLOBAL_STATS_KEY, GlobalStatsLoader
from lit_losses.aggregation.stats import GlobalStats


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
    """Raise when the `GlobalStats` attached to ``batch`` place it elsewhere in its accumulation window
    than Lightning does (a wrong step would otherwise be normalized by another window's counts)."""
    stats = batch.get(GLOBAL_STATS_KEY)
    accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
    if isinstance(stats, GlobalStats) and batch_idx % accumulate != stats.position:
        raise RuntimeError(
            f"GlobalStatsLoader window out of step with Lightning's accumulation: batch {batch_idx} is "
            f"micro-batch {stats.position} of its window, Lightning expects {batch_idx % accumulate}"
        )


def configure_train_loaders(trainer: L.Trainer, mask_keys: Sequence[str], ignore_index: int) -> None:
    """Configure every `GlobalStatsLoader` of ``trainer``'s fit (``A``, mask keys, batches per epoch)."""

    def configure(loader: GlobalStatsLoader) -> None:
        loader.configure(
            trainer.accumulate_grad_batches, mask_keys, ignore_index, trainer.num_training_batches
        )

    apply_to_collection(trainer.train_dataloader, GlobalStatsLoader, configure)
