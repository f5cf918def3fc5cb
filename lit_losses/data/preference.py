"""`PreferenceDataModule`: TRL-format preference JSONL → micro-batches of whole pairs (or unpaired KTO
records with their KL rows), tokenized with a Hugging Face tokenizer or the package's BPE."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit_losses.choices import check_choice
from lit_losses.data.completions import TruncationMode
from lit_losses.data.datamodule import FileDataModule, check_limit
from lit_losses.data.encoding import TokenEncoder
from lit_losses.data.hf_text import load_tokenizer
from lit_losses.data.preference_batches import PreferenceDataset, RowBuilder
from lit_losses.data.preference_records import (
    PairRecord,
    Record,
    UnpairedRecord,
    check_records,
    pair_kl_partners,
    read_preference_jsonl,
    same_completion,
)
from lit_losses.data.tokenizer import default_cache_dir, load_or_train_tokenizer, tokenizer_cache_file
from lit_losses.errors import ConfigError

BUILTIN = "the built-in BPE tokenizer"
BUILTIN_VOCAB_SIZE = 32768
"""The size of the built-in BPE when ``vocab_size`` is not given (`TextDataModule`'s default)."""


def record_texts(record: Record) -> list[str]:
    """The strings of a record (message contents included), to train the built-in tokenizer on."""
    fields = (
        (record.prompt, record.chosen, record.rejected)
        if isinstance(record, PairRecord)
        else (record.prompt, record.completion)
    )
    texts: list[str] = []
    for field in fields:
        texts.extend([field] if isinstance(field, str) else [message["content"] for message in field])
    return texts


class PreferenceDataModule(FileDataModule):
    """Preference data in TRL's formats (JSONL) → micro-batches for the DPO family, SimPO, CPO, ORPO and KTO.

    Paired records become micro-batches of whole pairs (the DPO family, SimPO, CPO, ORPO); unpaired records
    micro-batches with their KL rows (KTO).

    Records (`lit_losses.data.preference_records`): paired ``prompt``/``chosen``/``rejected`` (or
    ``chosen``/``rejected`` with an implicit prompt), unpaired ``prompt``/``completion``/``label``;
    standard text or conversational message lists (rendered by the tokenizer's chat template); optional
    precomputed reference log-probabilities (``ref_chosen_logps``/``ref_rejected_logps``, ``ref_logps``/
    ``ref_KL_logps``) in every record or in none. They are read and checked at ``setup`` (every error names
    ``file:line``), shuffled with ``seed``, split into train/validation, tokenized as TRL's trainers
    tokenize them (a standard completion ends with the EOS token; prompt positions have no target) and
    truncated to ``max_length`` tokens per sequence (``truncation_mode``). Unlike TRL, which drops a
    record whose prompt fills ``max_length``, a record left without a completion token is an error.

    Micro-batches follow the preference batch layout (`lit_losses.data.preference_batches`): the chosen
    rows of P pairs, then their rejected rows, with next-token ``labels``; a pair is never split over
    micro-batches. The training loader is a `GlobalStatsLoader` (it counts ``labels``: the number of
    pairs of a step is its number of counted sequences / 2) whose epoch order is a seeded permutation
    sharded over the data-parallel ranks. A subclass that overrides `read_records` (to filter the records,
    say) trains on the records it returns.

    Args:
        paths: JSONL file globs (required).
        tokenizer: a local Hugging Face tokenizer directory (``save_pretrained``) or a Hub id in the
            local Hugging Face cache, usually the model's own (needed for conversational records: its chat
            template renders them); ``None``: the package's byte-level BPE, trained on the training
            records (and cached in ``cache_dir``).
        vocab_size: the vocabulary size, linked to ``model.init_args.vocab_size`` by the CLI. With
            ``tokenizer``: at least its size; ``None`` (default): its size (``len(tokenizer)``), so that a
            pretrained model with its own tokenizer keeps its vocabulary. Without: the size of the
            built-in BPE; ``None``: `BUILTIN_VOCAB_SIZE`. The hyper-parameters record the size given to the
            model.
        max_length: longest sequence (prompt + completion), in tokens (TRL's ``max_length``); ``None``:
            no truncation.
        truncation_mode: ``keep_start`` (TRL's default) or ``keep_end``.
        tokens_per_batch: token budget of a micro-batch (``2 × records × longest row``, padding included;
            at least ``2 × max_length``, so that every pair fits).
        val_fraction: fraction of records held out for validation.
        max_records: use only the first records (after the seeded shuffle); ``None``: all.
        seed: seed of the record shuffle and of each epoch's micro-batch order.
        cache_dir: where the built-in tokenizer is cached (default ``$LIT_LOSSES_CACHE`` or
            ``~/.cache/lit_losses``).
        num_workers: DataLoader workers.

    Example:
        >>> import json, pathlib, tempfile
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> pairs = [{"prompt": f"Q{i}: what is {i} + {i}?", "chosen": f" {2 * i}.", "rejected": " No idea."}
        ...          for i in range(6)]
        >>> _ = (folder / "pairs.jsonl").write_text("".join(json.dumps(p) + "\\n" for p in pairs))
        >>> data = PreferenceDataModule(paths=[str(folder / "pairs.jsonl")], vocab_size=300, max_length=32,
        ...                             tokens_per_batch=256, cache_dir=str(folder))
        >>> data.setup("fit")
        >>> batch = data.train_set[0]
        >>> sorted(batch), batch["input_ids"].shape[0] % 2
        (['attention_mask', 'chosen_mask', 'chosen_sequence_mask', 'input_ids', 'labels'], 0)
    """

    paths_hint = "give the JSONL files of preference records"

    def __init__(
        self,
        paths: list[str] | None = None,
        tokenizer: str | None = None,
        vocab_size: int | None = None,
        max_length: int | None = 1024,
        truncation_mode: TruncationMode = "keep_start",
        tokens_per_batch: int = 4096,
        val_fraction: float = 0.0,
        max_records: int | None = None,
        seed: int = 0,
        cache_dir: str | None = None,
        num_workers: int = 0,
    ) -> None:
        self.check_paths(paths)
        check_choice(truncation_mode, choices=TruncationMode, where="data.truncation_mode")
        if max_length is not None and max_length < 2:
            raise ConfigError(f"data.max_length={max_length} must be >= 2 (a prompt token and a completion)")
        if max_length is not None and tokens_per_batch < 2 * max_length:
            raise ConfigError(
                f"data.tokens_per_batch={tokens_per_batch} is smaller than one pair (2 × data.max_length="
                f"{max_length})"
            )
        check_limit(max_records, "max_records")
        super().__init__(paths, val_fraction=val_fraction, seed=seed, num_workers=num_workers)
        self.save_hyperparameters()
        # the tokenizer loads last: every cheap check (the options, the files) comes first
        hf = load_tokenizer(tokenizer) if tokenizer is not None else None
        if hf is not None and vocab_size is not None and vocab_size < len(hf):
            raise ConfigError(
                f"data.vocab_size={vocab_size} is smaller than the tokenizer's {len(hf)} tokens "
                f"({tokenizer!r})"
            )
        size = vocab_size if vocab_size is not None else len(hf) if hf is not None else BUILTIN_VOCAB_SIZE
        # the hyper-parameters name the vocabulary given to the model (the CLI links it), as the model's do
        self.save_hyperparameters({**self.hparams, "vocab_size": size})
        self.hf_tokenizer = hf
        self.tokenizer_path = tokenizer
        self.vocab_size = size
        self.max_length = max_length
        self.seq_len = max_length  # the longest row (None: no truncation), checked against a model's context
        self.truncation_mode = truncation_mode
        self.tokens_per_batch = tokens_per_batch
        self.max_records = max_records
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.tokenizer = None
        self.encoder: TokenEncoder | None = None
        self.builder: RowBuilder | None = None

    # ---- records -----------------------------------------------------------------------------
    def read_records(self) -> list[Record]:
        """Every record of ``paths``, checked, KL partners paired (unpaired records, in file order),
        shuffled with ``seed`` and cut to ``max_records``.

        The records the module splits and tokenizes: a subclass may override it (to filter the records,
        say) and call ``super().read_records()``.
        """
        records = self.read_sources(read_preference_jsonl)
        check_records(records)
        if isinstance(records[0], UnpairedRecord):
            if len(records) < 2:
                raise ConfigError(
                    f"data.paths: {records[0].where} is the only unpaired record; KTO's KL estimate pairs "
                    "each prompt with another record's completion (give at least 2 records)"
                )
            pair_kl_partners(records)
        same = [r.where for r in records if same_completion(r)]
        if same:
            listed = ", ".join(same[:3]) + (f" and {len(same) - 3} more" if len(same) > 3 else "")
            rank_zero_warn(
                f"data.paths: {listed}: chosen and rejected are the same completion; the pair trains (with a "
                "margin of 0)"
            )
        return self.shuffled(records, limit=self.max_records)

    def read_items(self) -> list[Record]:
        """The records of `read_records`."""
        return self.read_records()

    # ---- tokenization ------------------------------------------------------------------------
    def token_encoder(self, train_records: list[Record]) -> TokenEncoder:
        """The Hugging Face tokenizer, or the built-in BPE trained on ``train_records`` (cached)."""
        if self.hf_tokenizer is not None:
            return TokenEncoder(self.hf_tokenizer, f"data.tokenizer {self.tokenizer_path!r}")
        texts = [text for record in train_records for text in record_texts(record)]
        cache_file = tokenizer_cache_file(
            cache_dir=self.cache_dir,
            sources=self.sources,
            vocab_size=self.vocab_size,
            seed=self.seed,
            limit=self.max_records,
        )
        bpe = load_or_train_tokenizer(texts, vocab_size=self.vocab_size, cache_file=cache_file)
        return TokenEncoder(bpe, BUILTIN)

    def prepare_encoding(self, train_items: list[Record]) -> None:
        """The tokenizer (`token_encoder`), its padding id and the builder of the records' rows."""
        self.encoder = self.token_encoder(train_items)
        self.tokenizer = self.encoder.tokenizer
        self.pad_id = self.encoder.pad_id
        self.builder = RowBuilder(
            self.encoder, max_length=self.max_length, truncation_mode=self.truncation_mode
        )

    def build_dataset(self, items: list[Record]) -> PreferenceDataset:
        """Micro-batches of whole records (`PreferenceDataset`)."""
        rows = [self.builder.rows(record) for record in items]
        return PreferenceDataset(rows, tokens_per_batch=self.tokens_per_batch, pad_id=self.pad_id)

    # ---- Lightning hooks ---------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Train and cache the built-in tokenizer once (rank 0); nothing with a Hugging Face tokenizer."""
        if self.hf_tokenizer is None:
            self.token_encoder(self.split(self.read_items())[0])
