"""Text, preference, offline RL and offline distillation data: tokenizer, records, packing into
token-budget micro-batches with loss masks.

`lit_losses.data.rollouts` (the RL example's generator) imports the models and is not imported here.
"""

from lit_losses.data.datamodule import FileDataModule
from lit_losses.data.distillation import DistillationDataModule
from lit_losses.data.packing import (
    EpochShuffleSampler,
    MicroBatchDataset,
    Pieces,
    batch_rows,
    collate_rows,
    pack_rows,
)
from lit_losses.data.preference import PreferenceDataModule
from lit_losses.data.rl import RLDataModule, rl_dataset
from lit_losses.data.rl_records import parse_record, read_jsonl, write_jsonl
from lit_losses.data.text import TextDataModule, stdlib_sources

__all__ = [
    "DistillationDataModule",
    "EpochShuffleSampler",
    "FileDataModule",
    "MicroBatchDataset",
    "Pieces",
    "PreferenceDataModule",
    "RLDataModule",
    "TextDataModule",
    "batch_rows",
    "collate_rows",
    "pack_rows",
    "parse_record",
    "read_jsonl",
    "rl_dataset",
    "stdlib_sources",
    "write_jsonl",
]
