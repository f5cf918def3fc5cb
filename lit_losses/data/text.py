"""`TextDataModule`: text files or JSONL (text, or TRL's prompt-completion and conversational SFT records) →
byte-level BPE → packed micro-batches of a token budget."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

from lit_losses.data.datamodule import FileDataModule, check_limit, check_val_fraction
from lit_losses.data.encoding import TokenEncoder
from lit_losses.data.files import jsonl_values, read_text_file
from lit_losses.data.packing import MicroBatchDataset, Pieces
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
    default_cache_dir,
    load_or_train_tokenizer,
    tokenizer_cache_file,
)
from lit_losses.errors import ConfigError

#: Folders of the standard library left out of the default corpus (tests and generated tables).
_STDLIB_EXCLUDED = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo"}


def stdlib_sources() -> list[str]:
    """The standard library's own ``.py`` files (sorted): real text shipped with every Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _STDLIB_EXCLUDED.intersection(p.relative_to(root).parts)]
    return sorted(str(p) for p in files)


def jsonl_text(record: Any, text_field: str, where: str) -> str | SFTRecord:
    """The ``text_field`` string of one decoded JSONL line, or the `SFTRecord` of a line with TRL's
    prompt-completion or conversational fields (``prompt``/``completion``, ``messages``) and no
    ``text_field``; ``where`` (``file:line``) names it in every error.

    Example:
        >>> jsonl_text({"text": "Hello."}, "text", "a.jsonl:1")
        'Hello.'
        >>> jsonl_text({"body": "Hello."}, "text", "a.jsonl:2")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: data.paths: a.jsonl:2 has no field data.text_field='text' (nor ...
    """
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


class TextDataModule(FileDataModule):
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
        check_val_fraction(val_fraction)  # before max_documents, as the options are listed
        check_limit(max_documents, "max_documents")
        super().__init__(paths, val_fraction=val_fraction, seed=seed, num_workers=num_workers)
        self.save_hyperparameters()
        self.text_field = text_field
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.tokens_per_batch = tokens_per_batch
        self.packing = packing
        self.max_documents = max_documents
        self.completion_only_loss = completion_only_loss
        self.assistant_only_loss = assistant_only_loss
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.tokenizer = None
        self.encoder: TokenEncoder | None = None

    paths_required = False  # no paths: the standard library's sources

    # ---- corpus ------------------------------------------------------------------------------
    def default_sources(self) -> list[str]:
        """The standard library's ``.py`` sources (`stdlib_sources`)."""
        return stdlib_sources()

    def read_file(self, src: str) -> list[str | SFTRecord]:
        """The documents of one file: the file's text, or each line's of a ``.jsonl`` file (`jsonl_text`)."""
        if src.endswith(".jsonl"):
            return [
                jsonl_text(record, text_field=self.text_field, where=where)
                for record, where in jsonl_values(src, prefix="data.paths: ")
            ]
        return [read_text_file(src)]

    def read_items(self) -> list[str | SFTRecord]:
        """The non-blank documents of every file, checked (`check_records`), shuffled with ``seed``, cut to
        ``max_documents``."""
        documents = [
            d for src in self.sources for d in self.read_file(src) if not isinstance(d, str) or d.strip()
        ]
        if not documents:
            named = ", ".join(self.sources[:3]) + (
                f" and {len(self.sources) - 3} more" if len(self.sources) > 3 else ""
            )
            raise ConfigError(f"data.paths: the corpus is empty: no non-blank document in {named}")
        self.check_records(documents)
        return self.shuffled(documents, limit=self.max_documents)

    def check_records(self, documents: list[str | SFTRecord]) -> None:
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
                records,
                completion_only_loss=self.completion_only_loss,
                assistant_only_loss=self.assistant_only_loss,
            )

    # ---- tokenization ------------------------------------------------------------------------
    def token_encoder(self, train_docs: list[str | SFTRecord]) -> TokenEncoder:
        """The byte-level BPE trained on ``train_docs`` (or loaded from the cache)."""
        texts = [t for d in train_docs for t in ([d] if isinstance(d, str) else d.texts())]
        cache_file = tokenizer_cache_file(
            cache_dir=self.cache_dir,
            sources=self.sources,
            vocab_size=self.vocab_size,
            seed=self.seed,
            limit=self.max_documents,
        )
        self.tokenizer = load_or_train_tokenizer(texts, vocab_size=self.vocab_size, cache_file=cache_file)
        return TokenEncoder(self.tokenizer, "the built-in BPE tokenizer")

    def prepare_encoding(self, train_items: list[str | SFTRecord]) -> None:
        """The tokenizer of the training documents (`token_encoder`) and its padding id."""
        self.encoder = self.token_encoder(train_items)
        self.pad_id = self.encoder.pad_id

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
                encoder=self.encoder,
                seq_len=self.seq_len,
                completion_only_loss=completion_only,
                assistant_only_loss=self.assistant_only_loss,
                eos=self.append_eos,
            )
            for record in records
        ]
        return Pieces.from_sequences(
            [ids for ids, _ in rows], labels=[labels for _, labels in rows], fields={}
        )

    def build_dataset(self, documents: list[str | SFTRecord]) -> MicroBatchDataset:
        """Packed micro-batches of ``documents`` (text documents, or SFT records)."""
        if documents and isinstance(documents[0], SFTRecord):
            pieces = self.sft_pieces(documents)
        else:
            pieces = Pieces.from_documents(self.encode(documents), seq_len=self.seq_len)
        return MicroBatchDataset(
            pieces,
            seq_len=self.seq_len,
            tokens_per_batch=self.tokens_per_batch,
            packing=self.packing,
            pad_id=self.pad_id,
        )

    # ---- Lightning hooks ---------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Train and cache the tokenizer once (rank 0)."""
        train_docs, _ = self.split(self.read_items())
        self.token_encoder(train_docs)

    append_eos: bool = True
    """Documents, and the completions of standard prompt-completion records, end with the EOS token."""
