"""A byte-level BPE tokenizer trained with HF `tokenizers`, cached on disk by corpus and vocab size."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lit_losses.errors import ConfigError

#: Special tokens, in id order: end of document, padding.
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)
#: The byte-level alphabet every vocabulary must hold, plus the special tokens.
MIN_VOCAB_SIZE = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)


def corpus_fingerprint(sources: Sequence[str], extra: str = "") -> str:
    """A short hash of the source names and their sizes and mtimes (cheap; no file is read)."""
    digest = hashlib.sha256(extra.encode())
    for src in sources:
        path = Path(src)
        stat = path.stat() if path.exists() else None
        digest.update(f"{src}|{stat.st_size if stat else 0}|{stat.st_mtime_ns if stat else 0}\n".encode())
    return digest.hexdigest()[:16]


def default_cache_dir() -> Path:
    """Where the trained tokenizers are cached: ``$LIT_LOSSES_CACHE``, else ``~/.cache/lit_losses``."""
    return Path(os.environ.get("LIT_LOSSES_CACHE", Path.home() / ".cache" / "lit_losses"))


def tokenizer_cache_file(
    cache_dir: Path, sources: Sequence[str], vocab_size: int, *, seed: int, limit: int | None
) -> Path:
    """The cache file of the tokenizer trained on the documents of ``sources`` (shuffled with ``seed``, cut
    to ``limit``) with ``vocab_size`` entries, under ``cache_dir/tokenizers``.

    Example:
        >>> tokenizer_cache_file(Path("/cache"), [], 300, seed=0, limit=None).name
        'bpe-300-a837b1ea58b7f45f.json'
    """
    key = corpus_fingerprint(sources, f"{vocab_size}|{seed}|{limit}")
    return cache_dir / "tokenizers" / f"bpe-{vocab_size}-{key}.json"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer of ``vocab_size`` entries (special tokens included)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(
            f"data.vocab_size={vocab_size} is smaller than the byte-level alphabet plus special tokens "
            f"({MIN_VOCAB_SIZE})"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def load_or_train_tokenizer(texts: Sequence[str], vocab_size: int, cache_file: Path) -> Tokenizer:
    """Load the tokenizer cached at ``cache_file``, or train it on ``texts`` and save it there."""
    if cache_file.exists():
        tokenizer = Tokenizer.from_file(str(cache_file))
        if tokenizer.get_vocab_size() <= vocab_size:
            return tokenizer
    tokenizer = train_tokenizer(texts, vocab_size)
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
    tokenizer.save(str(tmp))
    tmp.replace(cache_file)  # atomic: concurrent ranks never read a half-written file
    return tokenizer
