"""Text data for Hugging Face models: a local tokenizer directory, local text or JSONL files, the packed
micro-batches of `lit_losses.data.packing` and `GlobalStatsLoader`; and Hugging Face collators made to
give next-token labels (`NextTokenCollator`). Needs the ``[hf]`` extra; nothing is downloaded (a Hub id
is read from the local Hugging Face cache).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from lit_losses.aggregation.stats import batch_segment_ids, shift_labels
from lit_losses.data.encoding import TokenEncoder
from lit_losses.data.text import TextDataModule
from lit_losses.data.tokenizer import MIN_VOCAB_SIZE
from lit_losses.errors import ConfigError
from lit_losses.models.pretrained import local_pretrained


class NextTokenCollator:
    """A Hugging Face collator whose batches carry next-token labels (`shift_labels`, documents of packed
    rows kept apart by ``segment_ids`` or restarting ``position_ids``).

    Use it as the ``collate_fn`` of a `GlobalStatsLoader`: the loader counts the labelled tokens of each
    micro-batch before the model sees it, so the labels must already be the targets
    (``HFCausalLM(label_format="next_token")``).

    Args:
        collator: e.g. ``DataCollatorForLanguageModeling(tokenizer, mlm=False)`` or
            ``DataCollatorWithFlattening()``; it returns a mapping with ``labels`` aligned with ``input_ids``.
        ignore_index: label value of positions without a target.

    Example:
        >>> import torch
        >>> def aligned(features):  # a collator with Hugging Face labels (the model would shift them)
        ...     ids = torch.tensor([f["input_ids"] for f in features])
        ...     return {"input_ids": ids, "labels": ids.clone()}
        >>> NextTokenCollator(aligned)([{"input_ids": [5, 6, 7]}])["labels"].tolist()
        [[6, 7, -100]]
    """

    def __init__(self, collator: Callable[[list[Any]], Mapping[str, Any]], ignore_index: int = -100) -> None:
        self.collator = collator
        self.ignore_index = ignore_index

    def __call__(self, features: list[Any]) -> dict[str, Any]:
        batch = dict(self.collator(features))
        batch["labels"] = shift_labels(
            batch["labels"], segments=batch_segment_ids(batch), ignore_index=self.ignore_index
        )
        return batch


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model")
"""Files of which a tokenizer directory written by ``save_pretrained`` holds at least one."""


def load_tokenizer(path: str) -> Any:
    """``AutoTokenizer.from_pretrained`` of a local directory, or of a Hub id whose files are in the local
    Hugging Face cache (`lit_losses.models.pretrained.local_pretrained`); nothing is downloaded.

    Raises:
        ConfigError: one line naming ``data.init_args.tokenizer`` and the directory (and the file, for a
            JSON file that does not parse) when it is neither a directory nor a cached Hub id, holds no
            tokenizer file, or ``transformers`` cannot load the tokenizer it holds.
    """
    where = f"data.init_args.tokenizer {path!r}"
    directory = local_pretrained(path, "data.init_args.tokenizer", saved_with="tokenizer.save_pretrained")
    try:
        from transformers import AutoTokenizer
    except ImportError as err:  # pragma: no cover - depends on the optional extra
        raise ConfigError("HFTextDataModule needs the optional extra: pip install 'lit_losses[hf]'") from err
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as err:  # any failure to load the files the user pointed at is a configuration error
        raise _tokenizer_error(directory, where=where, err=err) from err


def _tokenizer_error(path: str, where: str, err: Exception) -> ConfigError:
    """Why the tokenizer directory ``path`` did not load: no tokenizer file, a JSON file that does not
    parse (named with its line and column), or ``transformers``' own reason on one line."""
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        return ConfigError(
            f"{where} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save one there with "
            "tokenizer.save_pretrained(...)"
        )
    for name in sorted(os.listdir(path)):
        if name.endswith(".json") and os.path.isfile(os.path.join(path, name)):
            _check_json(os.path.join(path, name), where)
    reason = " ".join(str(err).split()) or "no message"
    return ConfigError(f"{where}: the tokenizer cannot be loaded ({type(err).__name__}: {reason})")


def _check_json(file: str, where: str) -> None:
    """A JSON file of the tokenizer directory that does not parse is named with its line and column."""
    try:
        with open(file, encoding="utf-8") as handle:
            json.load(handle)
    except UnicodeDecodeError as err:
        raise ConfigError(f"{where}: {file} is not UTF-8 text (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{where}: {file} is not valid JSON ({err.msg}, line {err.lineno} column {err.colno})"
        ) from None
    except OSError as err:
        raise ConfigError(f"{where}: {file} cannot be read ({err.strerror or err})") from None


class HFTextDataModule(TextDataModule):
    """`TextDataModule` with a Hugging Face tokenizer (a local directory, or a Hub id in the local cache)
    instead of a trained BPE.

    Documents (whole text files, or the ``text_field`` of each ``.jsonl`` line; default: the standard
    library's sources) are tokenized with ``AutoTokenizer.from_pretrained(tokenizer)`` (its special tokens
    with ``add_special_tokens``, then the EOS token with ``append_eos``), split, packed into rows with
    ``segment_ids`` and restarting ``position_ids``, and grouped into micro-batches of a token budget
    (`lit_losses.data.packing`). Labels are next-token labels (``HFCausalLM(label_format="next_token")``);
    the training loader is a `GlobalStatsLoader`.

    Args:
        tokenizer: local tokenizer directory (``save_pretrained``), or a Hub id (``org/name``) already in
            the local Hugging Face cache; usually the model's own (its ``model_name_or_path``).
        paths: file globs (text files or ``.jsonl``); default: the standard library sources.
        vocab_size: the vocabulary size, linked to ``model.init_args.vocab_size`` by the CLI: at least the
            tokenizer's size; ``None`` (default): the tokenizer's size (``len(tokenizer)``), so that a
            pretrained model with its own tokenizer keeps its vocabulary. The hyper-parameters record the
            size given to the model.
        add_special_tokens: let the tokenizer add its special tokens (e.g. BOS) to each document.
        append_eos: end each document with the tokenizer's EOS token.
        **kwargs: the other `TextDataModule` options (``text_field``, ``seq_len``, ``tokens_per_batch``,
            ``packing``, ``val_fraction``, ``max_documents``, ``seed``, ``num_workers``, and for TRL's
            prompt-completion and conversational records ``completion_only_loss`` and
            ``assistant_only_loss``: conversations are rendered by this tokenizer's chat template).

    Example:
        >>> import pathlib, tempfile
        >>> from tokenizers import Tokenizer, models, pre_tokenizers, trainers
        >>> from transformers import PreTrainedTokenizerFast
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (folder / "a.jsonl").write_text('{"text": "the quick brown fox"}\\n{"text": "jumps over"}\\n')
        >>> bpe = Tokenizer(models.BPE(unk_token="<unk>"))
        >>> bpe.pre_tokenizer = pre_tokenizers.Whitespace()
        >>> bpe.train_from_iterator(["the quick brown fox jumps over"], trainers.BpeTrainer(
        ...     vocab_size=60, special_tokens=["<unk>", "</s>"], show_progress=False))
        >>> PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>").save_pretrained(folder / "tok")
        ('...
        >>> data = HFTextDataModule(str(folder / "tok"), paths=[str(folder / "*.jsonl")], seq_len=8,
        ...                         tokens_per_batch=16, val_fraction=0.0)
        >>> data.setup("fit")
        >>> loader = data.train_dataloader()  # a GlobalStatsLoader (a RegularizedLM configures it)
        >>> loader.configure(accumulate_grad_batches=1, mask_keys=["labels"], ignore_index=-100)
        >>> batch = next(iter(loader))
        >>> sorted(batch), batch["input_ids"].shape
        (['global_stats', 'input_ids', 'labels', 'position_ids', 'segment_ids'], torch.Size([1, 8]))
    """

    def __init__(
        self,
        tokenizer: str,
        paths: list[str] | None = None,
        vocab_size: int | None = None,
        add_special_tokens: bool = True,
        append_eos: bool = True,
        **kwargs: Any,
    ) -> None:
        # the cheap checks first (the options, the files of paths), then the tokenizer is loaded; the
        # parent's lower bound on vocab_size is its own byte-level BPE's (this tokenizer's size replaces it)
        super().__init__(paths=paths, vocab_size=MIN_VOCAB_SIZE, **kwargs)
        self.hf_tokenizer = load_tokenizer(tokenizer)
        size = len(self.hf_tokenizer)
        if vocab_size is not None and vocab_size < size:
            raise ConfigError(
                f"data.vocab_size={vocab_size} is smaller than the tokenizer's {size} tokens ({tokenizer!r})"
            )
        self.vocab_size = size if vocab_size is None else vocab_size
        # the hyper-parameters name the vocabulary given to the model (the CLI links it), as the model's do
        self.save_hyperparameters({**self.hparams, "vocab_size": self.vocab_size})
        self.tokenizer_path = tokenizer
        self.add_special_tokens = add_special_tokens
        self.append_eos = append_eos

    def prepare_data(self) -> None:
        """Nothing to prepare: the tokenizer is already trained."""

    def encode(self, documents: list[str]) -> list[list[int]]:
        """Token ids of each document (with the tokenizer's special tokens and EOS, as configured; a
        document whose text already ends with the EOS token's text gets no second one, as in TRL)."""
        tok = self.hf_tokenizer
        if self.append_eos and tok.eos_token_id is None:
            raise ConfigError("data.append_eos: the tokenizer has no eos_token; set data.append_eos: false")
        ids = tok(list(documents), add_special_tokens=self.add_special_tokens)["input_ids"]
        if not self.append_eos:
            return [list(doc) for doc in ids]
        ended = [text.endswith(tok.eos_token) for text in documents]
        return [list(doc) if end else [*doc, tok.eos_token_id] for doc, end in zip(ids, ended, strict=True)]

    def token_encoder(self, train_docs: list) -> TokenEncoder:
        """The Hugging Face tokenizer (already trained: ``train_docs`` are not read)."""
        return TokenEncoder(
            self.hf_tokenizer,
            f"data.tokenizer {self.tokenizer_path!r}",
            add_special_tokens=self.add_special_tokens,
        )
