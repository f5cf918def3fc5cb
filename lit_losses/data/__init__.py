"""Text data: tokenizer, packing into token-budget micro-batches with loss masks."""

from lit_losses.data.packing import (
    EpochShuffleSampler,
    MicroBatchDataset,
    Pieces,
    batch_rows,
    collate_rows,
    pack_rows,
)
from lit_losses.data.text import TextDataModule, stdlib_sources

__all__ = [
    "EpochShuffleSampler",
    "MicroBatchDataset",
    "Pieces",
    "TextDataModule",
    "batch_rows",
    "collate_rows",
    "pack_rows",
    "stdlib_sources",
]
