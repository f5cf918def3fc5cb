"""`FileDataModule`: the base of the data modules that read their items (documents, records) from the files
of ``data.paths``: the files, the seeded shuffle, the train/validation split and the loaders of whole
micro-batches."""

from __future__ import annotations

import abc
import random
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import lightning as L
from torch.utils.data import DataLoader, Dataset

from lit_losses.aggregation.loader import GlobalStatsLoader
from lit_losses.data.files import matching_files
from lit_losses.data.packing import EpochShuffleSampler
from lit_losses.errors import ConfigError
from lit_losses.validation import check_names

Item = TypeVar("Item")


def check_val_fraction(value: float) -> None:
    """Refuse a validation fraction outside ``[0, 1)`` (``data.val_fraction``).

    Example:
        >>> check_val_fraction(1.5)
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: data.val_fraction=1.5 must be in [0, 1)
    """
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"data.val_fraction={value} must be in [0, 1)")


def check_limit(value: int | None, option: str) -> None:
    """Refuse a bound on the number of items (``max_records``, ``max_documents``) below 1.

    Example:
        >>> check_limit(0, "max_records")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: data.max_records=0 must be >= 1
    """
    if value is not None and value < 1:
        raise ConfigError(f"data.{option}={value} must be >= 1")


class FileDataModule(L.LightningDataModule, abc.ABC):
    """Items read from the files that ``paths`` (globs) match, split into train/validation micro-batches.

    A subclass reads every item (`read_items`: a document or a record per item, each error naming its
    ``file:line`` and the field; `read_sources` reads them file by file), which this class shuffles with
    ``seed`` and cuts to the subclass's bound (`shuffled`), splits (`split`: the first ``val_fraction`` of
    them are the validation items), and hands to the subclass: `prepare_encoding` sees the training items
    (to train or load a tokenizer), `build_dataset` turns items into a dataset whose item ``i`` is
    micro-batch ``i``. The training loader is a `GlobalStatsLoader` whose epoch order is a seeded
    permutation of the micro-batches sharded over the data-parallel ranks (resumable mid-epoch: Lightning
    saves its position in checkpoints); the validation loader serves them in order.

    The subclass's constructor arguments are the config fields (``data.init_args.*``); the checks here
    name them ``data.<option>``. A constructor refuses bad options cheapest first: an empty ``paths``
    (`check_paths`, unless the module reads `default_sources` then), then the option values (the
    subclass's, ``val_fraction``, ``num_workers``), then the globs of ``paths`` (the files must exist);
    anything costlier (loading a tokenizer) comes after, so that the first error is the most basic one.

    Args:
        paths: file globs; ``None`` or empty: an error whose hint is the subclass's ``paths_hint``, or the
            subclass's `default_sources` where ``paths_required`` is false.
        val_fraction: fraction of the items held out for validation, in ``[0, 1)``.
        seed: seed of the item shuffle and of each epoch's micro-batch order.
        num_workers: DataLoader workers (0: load in the main process).

    Example:
        >>> import json, pathlib, tempfile, torch
        >>> from lit_losses.data.files import jsonl_values
        >>> class Numbers(FileDataModule):
        ...     paths_hint = "give the JSONL files of numbers"
        ...     def read_items(self):
        ...         return self.shuffled(self.read_sources(jsonl_values), limit=None)
        ...     def build_dataset(self, items):
        ...         return [{"input_ids": torch.tensor([[value for value, _ in items]])}]
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "numbers.jsonl"
        >>> _ = path.write_text("".join(f"{i}\\n" for i in range(8)))
        >>> data = Numbers(paths=[str(path)], val_fraction=0.25, seed=0, num_workers=0)
        >>> data.setup("fit")
        >>> sorted(data.train_set[0]["input_ids"][0].tolist() + data.val_set[0]["input_ids"][0].tolist())
        [0, 1, 2, 3, 4, 5, 6, 7]
        >>> data.val_set[0]["input_ids"].shape
        torch.Size([1, 2])
        >>> Numbers(paths=None, val_fraction=0.0, seed=0, num_workers=0)
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: data.paths: give the JSONL files of numbers
    """

    paths_hint: ClassVar[str] = "give the files to read"
    """What ``data.paths`` should name, for the error when it is empty."""

    paths_required: ClassVar[bool] = True
    """Whether an empty ``paths`` is an error (else the module reads its `default_sources`)."""

    ignore_index: int = -100
    """The label value of positions without a target in this module's micro-batches."""

    def __init__(self, paths: list[str] | None, *, val_fraction: float, seed: int, num_workers: int) -> None:
        super().__init__()
        self.check_paths(paths)
        check_val_fraction(val_fraction)
        if num_workers < 0:
            raise ConfigError(f"data.num_workers={num_workers} must be >= 0 (0: load in the main process)")
        self.paths = paths
        self.val_fraction = val_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.sources = self.resolve_sources()
        self.train_set: Dataset | Sequence | None = None
        self.val_set: Dataset | Sequence | None = None

    # ---- items -------------------------------------------------------------------------------
    @classmethod
    def check_paths(cls, paths: list[str] | None) -> None:
        """Refuse an empty ``paths`` when the module has no default files (``paths_required``): the first
        check of a constructor, before the subclass's options (it may run before ``super().__init__``).

        Raises:
            ConfigError: ``data.paths: <paths_hint>``.

        Example:
            >>> FileDataModule.check_paths([])
            Traceback (most recent call last):
            ...
            lit_losses.errors.ConfigError: data.paths: give the files to read
        """
        if not paths and cls.paths_required:
            raise ConfigError(f"data.paths: {cls.paths_hint}")

    def default_sources(self) -> list[str]:
        """The files read when ``paths`` is empty and ``paths_required`` is false: none here (an error
        naming ``data.paths``)."""
        raise ConfigError(f"data.paths: {self.paths_hint}")

    def resolve_sources(self) -> list[str]:
        """The files that ``paths`` match, in the order of the globs (each glob's files sorted)."""
        if not self.paths:
            return self.default_sources()
        sources: list[str] = []
        for pattern in check_names(self.paths, where="data.paths", what="file globs"):
            sources.extend(matching_files(pattern))
        return sources

    def read_sources(self, read: Callable[[str], list[Item]]) -> list[Item]:
        """The records of every source file (``read(file)``: one file's, in file order).

        Raises:
            ConfigError: no file holds a record, naming ``data.paths`` and the files.
        """
        records = [record for src in self.sources for record in read(src)]
        if not records:
            raise ConfigError(
                f"data.paths: no record in {len(self.sources)} file(s) ({', '.join(self.sources)})"
            )
        return records

    def shuffled(self, items: list[Item], limit: int | None) -> list[Item]:
        """``items`` shuffled with ``seed``, cut to the first ``limit`` (``None``: all)."""
        random.Random(self.seed).shuffle(items)
        return items[:limit] if limit else items

    def split(self, items: list[Item]) -> tuple[list[Item], list[Item]]:
        """``(train, validation)``: the first ``round(len(items) × val_fraction)`` items (at least one when
        ``val_fraction > 0`` and there are two items or more) are the validation items; `setup` refuses a
        ``val_fraction > 0`` that leaves none (`check_validation`)."""
        n_val = round(len(items) * self.val_fraction)
        if self.val_fraction > 0 and len(items) > 1:
            n_val = max(1, n_val)
        return items[n_val:], items[:n_val]

    @abc.abstractmethod
    def read_items(self) -> list[Any]:
        """Every item of the files, checked, shuffled with ``seed`` and cut to the module's bound."""

    def prepare_encoding(self, train_items: list[Any]) -> None:
        """Set up tokenization from the training items before any dataset is built (here: nothing)."""

    @abc.abstractmethod
    def build_dataset(self, items: list[Any]) -> Dataset | Sequence:
        """The dataset of ``items``: item ``i`` is micro-batch ``i`` (a dict of tensors)."""

    # ---- Lightning hooks ---------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        """Read, split and build the training and validation datasets (once)."""
        if self.train_set is not None:
            return
        items = self.read_items()
        train_items, val_items = self.split(items)
        self.prepare_encoding(train_items)
        train_set = self.build_dataset(train_items)
        val_set = self.build_dataset(val_items) if val_items else None
        self.check_validation(read=len(items), held_out=len(val_items), val_set=val_set)
        self.train_set = train_set
        self.val_set = val_set

    def check_validation(self, *, read: int, held_out: int, val_set: Dataset | Sequence | None) -> None:
        """Refuse a ``val_fraction`` above 0 that leaves no validation micro-batch (too few items read, or
        held-out items that make no micro-batch), which Lightning would only warn about.

        Raises:
            ConfigError: naming ``data.val_fraction``, the items read and held out.

        Example:
            >>> class Few(FileDataModule):
            ...     paths_required = False
            ...     def default_sources(self):
            ...         return []
            ...     def read_items(self):
            ...         return ["only"]
            ...     def build_dataset(self, items):
            ...         return list(items)
            >>> Few(paths=None, val_fraction=0.1, seed=0, num_workers=0).setup("fit")
            Traceback (most recent call last):
            ...
            lit_losses.errors.ConfigError: data.val_fraction=0.1 leaves no validation micro-batch: 1 item(s)
            read, 0 held out; give more data (data.paths), or data.val_fraction=0 to train without validation
        """
        if self.val_fraction > 0 and (val_set is None or len(val_set) == 0):
            raise ConfigError(
                f"data.val_fraction={self.val_fraction} leaves no validation micro-batch: {read} item(s) "
                f"read, {held_out} held out; give more data (data.paths), or data.val_fraction=0 to train "
                "without validation"
            )

    def batch_keys(self) -> tuple[str, ...]:
        """The keys of this module's training micro-batches (after `setup`; empty before), so that a
        model can refuse, before training, a loss term that reads a key the data never provides."""
        if not self.train_set:
            return ()
        return tuple(sorted(self.train_set[0]))

    def train_dataloader(self) -> GlobalStatsLoader:
        """Micro-batches carrying the global counts of their optimizer step (`GlobalStatsLoader`).

        The loader is resumable (Lightning saves its position in checkpoints and restores it, so that a
        run resumed mid-epoch trains on exactly the micro-batches the uninterrupted run would); the
        sampler shards this epoch's seeded permutation over the trainer's data-parallel ranks.
        """
        # the data-parallel ranks: the world under DDP, the data-parallel mesh dimension under
        # ModelParallelStrategy (tensor-parallel peers must see the same micro-batches)
        shards = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        world, rank = (shards["num_replicas"], shards["rank"]) if shards else (1, 0)
        return GlobalStatsLoader(
            self.train_set,
            batch_size=None,
            sampler=EpochShuffleSampler(len(self.train_set), seed=self.seed, num_replicas=world, rank=rank),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader | list:
        """The validation micro-batches in order (none without validation items)."""
        if self.val_set is None:
            return []
        return DataLoader(self.val_set, batch_size=None, shuffle=False, num_workers=self.num_workers)

    def predict_dataloader(self) -> DataLoader | list:
        """The validation micro-batches."""
        return self.val_dataloader()
