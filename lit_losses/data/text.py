"""`TextDataModule`: text files or JSONL (text, or TRL's prompt-completion and conversational SFT records) →
byte-level BPE → packed micro-batches of a token budget."""

from __future__ import annotations

import glob
import json
import os
import random
import re
import sysconfig
from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader

from lit_losses.aggregation.loader import GlobalStatsLoader
from lit_losses.data.encoding import TokenEncoder
from lit_losses.data.packing import EpochShuffleSampler, MicroBatchDataset, Pieces
from lit_losses.data.sft_records import (
    SFTRecord,
    check_generation_markers,
    check_sft_records,
    is_sft_record,
    parse_sft_record,
    sft_row,
)
from lit_losses.data.tokenizer import (
    EOS_TOKEN,
    MIN_VOCAB_SIZE,
    corpus_fingerprint,
    load_or_train_tokenizer,
)
from lit_losses.errors import ConfigError
from lit_losses.validation import check_names

#: Folders of the standard library left out of the default corpus (tests and generated tables).
_STDLIB_EXCLUDED = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo"}


def stdlib_sources() -> list[str]:
    """The standard library's own ``.py`` files (sorted): real text shipped with every Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _STDLIB_EXCLUDED.intersection(p.relative_to(root).parts)]
    return sorted(str(p) for p in files)


def default_cache_dir() -> Path:
    return Path(os.environ.get("LIT_LOSSES_CACHE", Path.home() / ".cache" / "lit_losses"))


def read_text_file(src: str) -> str:
    """The UTF-8 text of a corpus file; an unreadable, binary or undecodable file is a `ConfigError` naming
    it."""
    try:
        data = Path(src).read_bytes()
    except OSError as err:  # e.g. permission denied, or removed since the paths were resolved
        raise ConfigError(f"data.paths: {src} cannot be read ({err.strerror or err})") from None
    if b"\x00" in data[:8192]:
        raise ConfigError(f"data.paths: {src} is a binary file (it holds NUL bytes), not UTF-8 text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"data.paths: {src} is not UTF-8 text (byte {err.start}: {err.reason})") from None


def jsonl_text(line: str, text_field: str, where: str) -> str | SFTRecord:
    """The ``text_field`` string of one JSONL line, or the `SFTRecord` of a line with TRL's
    prompt-completion or conversational fields (``prompt``/``completion``, ``messages``) and no
    ``text_field``; ``where`` (``file:line``) names it in every error."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ConfigError(f"data.paths: {where} is not valid JSON ({err.msg}, column {err.colno})") from None
    if is_sft_record(record) and text_field not in record:
        return parse_sft_record(record, where)
    if not isinstance(record, dict) or text_field not in record:
        raise ConfigError(
            f"data.paths: {where} has no field data.text_field={text_field!r} (nor 'prompt' and "
            "'completion', nor 'messages')"
        )
    if not isinstance(record[text_field], str):
        kind = type(record[text_field]).__name__
        raise ConfigError(f"data.paths: {where} field {text_field!r} is a {kind}, not a string")
    return record[text_field]


def matching_files(pattern: str) -> list[str]:
    """The files that the glob ``pattern`` of ``data.paths`` matches (``~`` expanded, ``**`` recursive).

    Raises:
        ConfigError: it matches no file, naming the folder it matches instead and globs for its files.

    Example:
        >>> import tempfile
        >>> matching_files(tempfile.mkdtemp())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: data.paths entry '/...' is a folder; name its files with a glob: ...
    """
    matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
    files = [p for p in matches if os.path.isfile(p)]
    if files:
        return files
    folders = [p.rstrip(os.sep) for p in matches if os.path.isdir(p)]
    if not folders:
        hub = re.fullmatch(r"[\w.-]+/[\w.-]+", pattern) and not os.path.splitext(pattern)[1]
        hint = (
            " (a Hugging Face Hub dataset name? nothing is downloaded: save it as JSONL first, e.g. "
            f"datasets.load_dataset({pattern!r}, split='train').to_json('train.jsonl'))"
            if hub
            else ""
        )
        raise ConfigError(f"data.paths entry {pattern!r} matches no file{hint}")
    globs = f"'{folders[0]}/*.txt' or '{folders[0]}/**/*.jsonl'"
    if len(matches) == 1 and not glob.has_magic(pattern):
        raise ConfigError(f"data.paths entry {pattern!r} is a folder; name its files with a glob: {globs}")
    raise ConfigError(
        f"data.paths entry {pattern!r} matches only folders ({', '.join(folders[:3])}), no file; name their "
        f"files with a glob: {globs}"
    )


class TextDataModule(L.LightningDataModule):
    """Train/validation micro-batches of packed, tokenized text.

    Documents are whole text files, or the ``text_field`` of each line of ``.jsonl`` files; with no
    ``paths``, the standard library's ``.py`` sources. A byte-level BPE tokenizer is trained on the
    training documents (or loaded from ``cache_dir``). Documents (each followed by an end-of-text
    token) are shuffled with ``seed``, split into train/validation, cut into pieces of at most
    ``seq_len`` tokens, packed into rows and grouped into micro-batches of at most ``tokens_per_batch``
    tokens (padding included). See `lit_losses.data.packing` for the row layout.

    **Supervised fine-tuning on prompt-completion data**: JSONL lines in TRL's prompt-completion
    (``prompt``/``completion``) or conversational (``messages``, or ``prompt``/``completion`` as message
    lists) formats are records, one row piece each, truncated to ``seq_len`` tokens (never cut into
    several pieces), whose labels leave out the prompt with ``completion_only_loss`` (TRL's default for
    prompt-completion records) and keep only the assistant's turns with ``assistant_only_loss`` (the
    chat template's ``{% generation %}`` markers; conversations need a Hugging Face tokenizer with a
    chat template, `HFTextDataModule`). See `lit_losses.data.sft_records`.

    Args:
        paths: file globs (text files or ``.jsonl``); default: the standard library sources.
        text_field: JSONL field holding the text.
        vocab_size: tokenizer vocabulary size (special tokens included).
        seq_len: longest row, in tokens (≥ 2).
        tokens_per_batch: token budget of a micro-batch (rows × longest row, ≥ ``seq_len``).
        packing: pack several documents per row (else one document piece per row).
        val_fraction: fraction of documents held out for validation.
        max_documents: use only the first documents (after the seeded shuffle); ``None``: all.
        seed: seed of the document shuffle.
        cache_dir: where the tokenizer is cached (default ``$LIT_LOSSES_CACHE`` or
            ``~/.cache/lit_losses``).
        num_workers: DataLoader workers.
        completion_only_loss: train prompt-completion records on their completion tokens only; ``None``
            (TRL's default): ``true`` for prompt-completion records.
        assistant_only_loss: train conversational records on the assistant's turns only.

    Example:
        >>> import pathlib, tempfile
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> for i in range(4):
        ...     _ = (folder / f"doc{i}.txt").write_text(f"document {i}: the quick brown fox. " * 20)
        >>> data = TextDataModule(paths=[str(folder / "*.txt")], vocab_size=300, seq_len=32,
        ...                       tokens_per_batch=64, val_fraction=0.25, cache_dir=str(folder))
        >>> data.setup("fit")
        >>> batch = next(iter(data.val_dataloader()))
        >>> sorted(batch), tuple(batch["input_ids"].shape)
        (['input_ids', 'labels', 'position_ids', 'segment_ids'], (2, 32))
    """

    def __init__(
        self,
        paths: list[str] | None = None,
        text_field: str = "text",
        vocab_size: int = 32768,
        seq_len: int = 256,
        tokens_per_batch: int = 4096,
        packing: bool = True,
        val_fraction: float = 0.02,
        max_documents: int | None = None,
        seed: int = 0,
        cache_dir: str | None = None,
        num_workers: int = 0,
        completion_only_loss: bool | None = None,
        assistant_only_loss: bool = False,
    ) -> None:
        super().__init__()
        if vocab_size < MIN_VOCAB_SIZE:
            raise ConfigError(
                f"data.vocab_size={vocab_size} is smaller than the byte-level alphabet plus special "
                f"tokens ({MIN_VOCAB_SIZE})"
            )
        if seq_len < 2:
            raise ConfigError(f"data.seq_len={seq_len} must be >= 2 (a label needs a next token)")
        if tokens_per_batch < seq_len:
            raise ConfigError(
                f"data.tokens_per_batch={tokens_per_batch} is smaller than one sequence (seq_len={seq_len})"
            )
        if not 0.0 <= val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={val_fraction} must be in [0, 1)")
        if max_documents is not None and max_documents < 1:
            raise ConfigError(f"data.max_documents={max_documents} must be >= 1")
        if num_workers < 0:
            raise ConfigError(f"data.num_workers={num_workers} must be >= 0 (0: load in the main process)")
        self.save_hyperparameters()
        self.paths = paths
        self.text_field = text_field
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.tokens_per_batch = tokens_per_batch
        self.packing = packing
        self.val_fraction = val_fraction
        self.max_documents = max_documents
        self.seed = seed
        self.num_workers = num_workers
        self.completion_only_loss = completion_only_loss
        self.assistant_only_loss = assistant_only_loss
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.sources = self._resolve_sources()
        self.tokenizer = None
        self.encoder: TokenEncoder | None = None
        self.train_set: MicroBatchDataset | None = None
        self.val_set: MicroBatchDataset | None = None

    # ---- corpus ------------------------------------------------------------------------------
    def _resolve_sources(self) -> list[str]:
        if not self.paths:
            return stdlib_sources()
        sources: list[str] = []
        for pattern in check_names(self.paths, "data.paths", "file globs"):
            sources.extend(matching_files(pattern))
        return sources

    def _read_documents(self) -> list[str | SFTRecord]:
        documents: list[str | SFTRecord] = []
        for src in self.sources:
            text = read_text_file(src)
            if src.endswith(".jsonl"):
                for lineno, line in enumerate(text.splitlines(), start=1):
                    if line.strip():
                        documents.append(jsonl_text(line, self.text_field, f"{src}:{lineno}"))
            else:
                documents.append(text)
        documents = [d for d in documents if not isinstance(d, str) or d.strip()]
        if not documents:
            named = ", ".join(self.sources[:3]) + (
                f" and {len(self.sources) - 3} more" if len(self.sources) > 3 else ""
            )
            raise ConfigError(f"data.paths: the corpus is empty: no non-blank document in {named}")
        self._check_records(documents)
        random.Random(self.seed).shuffle(documents)
        return documents[: self.max_documents] if self.max_documents else documents

    def _check_records(self, documents: list[str | SFTRecord]) -> None:
        """SFT records are not mixed with text documents, and take the loss options they allow."""
        records = [d for d in documents if isinstance(d, SFTRecord)]
        if records and len(records) < len(documents):
            raise ConfigError(
                f"data.paths: {records[0].where} is a {records[0].form} record, but the corpus also holds "
                f"text documents (data.text_field={self.text_field!r}, or text files); one format per corpus"
            )
        if not records and (self.completion_only_loss or self.assistant_only_loss):
            option = "completion_only_loss" if self.completion_only_loss else "assistant_only_loss"
            raise ConfigError(
                f"data.{option}=true needs prompt-completion or conversational JSONL records; the corpus is "
                f"text documents ({self.sources[0]}, ...)"
            )
        if records:
            check_sft_records(
                records, self.completion_only_loss, assistant_only_loss=self.assistant_only_loss
            )

    def _split(self, documents: list) -> tuple[list, list]:
        n_val = round(len(documents) * self.val_fraction)
        if self.val_fraction > 0 and len(documents) > 1:
            n_val = max(1, n_val)
        return documents[n_val:], documents[:n_val]

    def _tokenizer_cache_file(self) -> Path:
        key = corpus_fingerprint(self.sources, f"{self.vocab_size}|{self.seed}|{self.max_documents}")
        return self.cache_dir / "tokenizers" / f"bpe-{self.vocab_size}-{key}.json"

    # ---- Lightning hooks ---------------------------------------------------------------------
    # ---- tokenization ------------------------------------------------------------------------
    def token_encoder(self, train_docs: list[str | SFTRecord]) -> TokenEncoder:
        """The byte-level BPE trained on ``train_docs`` (or loaded from the cache)."""
        texts = [t for d in train_docs for t in ([d] if isinstance(d, str) else d.texts())]
        self.tokenizer = load_or_train_tokenizer(texts, self.vocab_size, self._tokenizer_cache_file())
        return TokenEncoder(self.tokenizer, "the built-in BPE tokenizer")

    def encode(self, documents: list[str]) -> list[list[int]]:
        """Token ids of each document, followed by the end-of-text token."""
        eos = self.tokenizer.token_to_id(EOS_TOKEN)
        return [[*enc.ids, eos] for enc in self.tokenizer.encode_batch(documents)]

    def sft_pieces(self, records: list[SFTRecord]) -> Pieces:
        """One piece per record, with the labels of `lit_losses.data.sft_records.sft_row`."""
        if self.assistant_only_loss:
            check_generation_markers(self.encoder, records[0].where)
        completion_only = self.completion_only_loss
        if completion_only is None:  # TRL's default: the completion of prompt-completion records
            completion_only = records[0].messages is None
        rows = [
            sft_row(
                record,
                self.encoder,
                self.seq_len,
                completion_only_loss=completion_only,
                assistant_only_loss=self.assistant_only_loss,
                eos=self.append_eos,
            )
            for record in records
        ]
        return Pieces.from_sequences([ids for ids, _ in rows], [labels for _, labels in rows], {})

    def build_dataset(self, documents: list[str | SFTRecord]) -> MicroBatchDataset:
        """Packed micro-batches of ``documents`` (text documents, or SFT records)."""
        if documents and isinstance(documents[0], SFTRecord):
            pieces = self.sft_pieces(documents)
        else:
            pieces = Pieces.from_documents(self.encode(documents), self.seq_len)
        return MicroBatchDataset(
            pieces, self.seq_len, self.tokens_per_batch, packing=self.packing, pad_id=self.pad_id
        )

    # ---- Lightning hooks ---------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Train and cache the tokenizer once (rank 0)."""
        train_docs, _ = self._split(self._read_documents())
        self.token_encoder(train_docs)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        train_docs, val_docs = self._split(self._read_documents())
        self.encoder = self.token_encoder(train_docs)
        self.pad_id = self.encoder.pad_id
        self.train_set = self.build_dataset(train_docs)
        self.val_set = self.build_dataset(val_docs) if val_docs else None

    ignore_index: int = -100
    """The label value of positions without a target in this module's micro-batches."""

    append_eos: bool = True
    """Documents, and the completions of standard prompt-completion records, end with the EOS token."""

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
            sampler=EpochShuffleSampler(len(self.train_set), self.seed, num_replicas=world, rank=rank),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader | list:
        if self.val_set is None:
            return []
        return DataLoader(self.val_set, batch_size=None, shuffle=False, num_workers=self.num_workers)

    def predict_dataloader(self) -> DataLoader | list:
        return self.val_dataloader()
