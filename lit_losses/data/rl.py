"""`RLDataModule`: offline RL records (JSONL) → packed micro-batches carrying the RL batch keys."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lit_losses.data.datamodule import FileDataModule, check_limit
from lit_losses.data.packing import MicroBatchDataset, Pieces
from lit_losses.data.rl_records import RLRow, complete_fields, parse_records, read_jsonl
from lit_losses.errors import ConfigError


def _check_integer(value: Any, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be >= {minimum} (an integer)")


def check_rl_options(seq_len: Any, tokens_per_batch: Any, vocab_size: Any, pad_id: Any) -> None:
    """The sizes of RL micro-batches, checked the same way for `rl_dataset` and `RLDataModule`.

    Raises:
        ConfigError: one line naming the option (``data.<option>``) and its value.

    Example:
        >>> check_rl_options(seq_len=8, tokens_per_batch=4, vocab_size=None, pad_id=0)
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: data.tokens_per_batch=4 is smaller than one sequence (seq_len=8)
    """
    _check_integer(seq_len, name="data.seq_len", minimum=2)
    _check_integer(tokens_per_batch, name="data.tokens_per_batch", minimum=1)
    if tokens_per_batch < seq_len:
        raise ConfigError(
            f"data.tokens_per_batch={tokens_per_batch} is smaller than one sequence (seq_len={seq_len})"
        )
    _check_integer(pad_id, name="data.pad_id", minimum=0)
    if vocab_size is None:
        return
    _check_integer(vocab_size, name="data.vocab_size", minimum=1)
    if pad_id >= vocab_size:
        raise ConfigError(f"data.pad_id={pad_id} must be a token id in [0, {vocab_size}) (data.vocab_size)")


def rows_dataset(
    rows: list[RLRow], seq_len: int, tokens_per_batch: int, packing: bool = True, pad_id: int = 0
) -> MicroBatchDataset:
    """Micro-batches of RL rows: each row one piece (never split), packed and batched as text is."""
    pieces = Pieces.from_sequences(
        [row.input_ids for row in rows],
        labels=[row.labels for row in rows],
        fields={name: [row.fields[name] for row in rows] for name in (rows[0].fields if rows else {})},
    )
    return MicroBatchDataset(
        pieces, seq_len=seq_len, tokens_per_batch=tokens_per_batch, packing=packing, pad_id=pad_id
    )


def rl_dataset(
    records: Iterable[Mapping[str, Any]],
    seq_len: int,
    tokens_per_batch: int,
    vocab_size: int | None = None,
    packing: bool = True,
    pad_id: int = 0,
) -> MicroBatchDataset:
    """Micro-batches of in-memory records (`lit_losses.data.rl_records` forms), in the order given.

    Item ``i`` is a whole micro-batch: serve it with ``GlobalStatsLoader(dataset, batch_size=None)``.
    Errors name ``records[i]`` and the field.

    Example:
        >>> records = [{"tokens": [1, 2, 3], "logprobs": [None, -0.5, -1.0], "advantage": 1.0},
        ...            {"tokens": [4, 5], "logprobs": [None, -2.0], "advantage": -1.0, "sample_weight": 0.5}]
        >>> batch = rl_dataset(records, seq_len=4, tokens_per_batch=8)[0]
        >>> batch["labels"].tolist(), batch["segment_ids"].tolist()
        ([[2, 3, 5]], [[1, 1, 2]])
        >>> batch["advantages"].tolist(), batch["sample_weights"].tolist()
        ([[1.0, 1.0, -1.0]], [[1.0, 1.0, 0.5]])
    """
    check_rl_options(seq_len=seq_len, tokens_per_batch=tokens_per_batch, vocab_size=vocab_size, pad_id=pad_id)
    rows = complete_fields(parse_records(records, vocab_size=vocab_size, seq_len=seq_len))
    if not rows:
        raise ConfigError("rl_dataset: records holds no record (give at least one)")
    return rows_dataset(
        rows, seq_len=seq_len, tokens_per_batch=tokens_per_batch, packing=packing, pad_id=pad_id
    )


class RLDataModule(FileDataModule):
    """Offline RL data: JSONL records of sampled completions → packed micro-batches of the RL batch contract.

    Each line of the ``paths`` files is one record, in the flat form (``tokens``, ``logprobs``,
    ``advantage``/``advantages``, optional ``completion_mask``/``weights``, ``ref_logprobs``,
    ``sample_weight``) or Tinker's Datum form (``model_input``, ``loss_fn_inputs``); see
    `lit_losses.data.rl_records`. A record becomes one next-token row (inputs ``tokens[:-1]``, targets
    ``tokens[1:]``, ``-100`` where there is no completion token) with the float ``[B, T]`` keys
    ``sampling_logprobs``, ``advantages`` and, when the data has them, ``loss_weights``,
    ``sample_weights``, ``ref_logprobs`` (0.0 where there is no target). Records are read and checked
    at ``setup`` (every error names ``file:line`` and the field), shuffled with ``seed``, split into
    train/validation, then packed (a record is never split: one longer than ``seq_len`` is an error) into
    micro-batches of at most ``tokens_per_batch`` tokens. The training loader is a `GlobalStatsLoader`
    whose epoch order is a seeded permutation sharded over the data-parallel ranks (`FileDataModule`).
    A subclass that overrides `read_rows` (to filter the records, say) trains on the rows it returns.

    Args:
        paths: JSONL file globs (required; e.g. ``data/rollouts.jsonl``, which
            ``python -m lit_losses.data.rollouts`` writes).
        vocab_size: the model's vocabulary size (linked to ``model.init_args.vocab_size`` by the CLI);
            every token id must be below it.
        seq_len: longest row, in tokens: a record holds at most ``seq_len + 1`` tokens.
        tokens_per_batch: token budget of a micro-batch (rows × longest row, ≥ ``seq_len``).
        packing: pack several records per row (else one record per row).
        val_fraction: fraction of records held out for validation.
        max_records: use only the first records (after the seeded shuffle); ``None``: all.
        seed: seed of the record shuffle and of each epoch's micro-batch order.
        pad_id: input token id at padding positions (no target, segment 0).
        num_workers: DataLoader workers.

    Example:
        >>> import json, pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "rollouts.jsonl"
        >>> records = [{"tokens": [2, 5, 6, 1], "logprobs": [None, None, -1.5, -0.25], "advantage": 0.5},
        ...            {"tokens": [2, 7, 1], "logprobs": [None, -2.5, -0.125], "advantage": -0.5}]
        >>> _ = path.write_text("".join(json.dumps(r) + "\\n" for r in records))
        >>> data = RLDataModule(paths=[str(path)], vocab_size=8, seq_len=5, tokens_per_batch=10)
        >>> data.setup("fit")
        >>> batch = data.train_set[0]
        >>> sorted(batch)
        ['advantages', 'input_ids', 'labels', 'position_ids', 'sampling_logprobs', 'segment_ids']
        >>> batch["labels"].tolist(), batch["sampling_logprobs"].tolist()
        ([[-100, 6, 1, 7, 1]], [[0.0, -1.5, -0.25, -2.5, -0.125]])
    """

    paths_hint = (
        "give the JSONL files of RL records (e.g. data/rollouts.jsonl, written by python -m "
        "lit_losses.data.rollouts)"
    )

    def __init__(
        self,
        paths: list[str] | None = None,
        vocab_size: int = 32,
        seq_len: int = 128,
        tokens_per_batch: int = 1024,
        packing: bool = True,
        val_fraction: float = 0.0,
        max_records: int | None = None,
        seed: int = 0,
        pad_id: int = 0,
        num_workers: int = 0,
    ) -> None:
        self.check_paths(paths)
        check_rl_options(
            seq_len=seq_len, tokens_per_batch=tokens_per_batch, vocab_size=vocab_size, pad_id=pad_id
        )
        check_limit(max_records, "max_records")
        super().__init__(paths, val_fraction=val_fraction, seed=seed, num_workers=num_workers)
        self.save_hyperparameters()
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.tokens_per_batch = tokens_per_batch
        self.packing = packing
        self.max_records = max_records
        self.pad_id = pad_id

    def read_file(self, src: str) -> list[tuple[RLRow, str]]:
        """The rows of one JSONL file, each with its ``file:line`` (`read_jsonl`)."""
        return read_jsonl(src, vocab_size=self.vocab_size, seq_len=self.seq_len)

    def check_rows(self, rows: list[tuple[RLRow, str]]) -> list[RLRow]:
        """The rows of the whole data, with the same fields (`complete_fields`)."""
        return complete_fields(rows)

    def read_rows(self) -> list[RLRow]:
        """Every record of ``paths`` as a row, checked, shuffled with ``seed``, cut to ``max_records``.

        The rows the module splits and packs: a subclass may override it (to filter or reorder the
        records, say) and call ``super().read_rows()``.
        """
        return self.shuffled(self.check_rows(self.read_sources(self.read_file)), limit=self.max_records)

    def read_items(self) -> list[RLRow]:
        """The rows of `read_rows`."""
        return self.read_rows()

    def build_dataset(self, items: list[RLRow]) -> MicroBatchDataset:
        """Packed micro-batches of the rows (`rows_dataset`)."""
        return rows_dataset(
            items,
            seq_len=self.seq_len,
            tokens_per_batch=self.tokens_per_batch,
            packing=self.packing,
            pad_id=self.pad_id,
        )
