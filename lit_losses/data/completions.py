"""A prompt and its completion → token ids and a completion mask, as TRL's trainers tokenize them, and
the next-token row (``input_ids``, ``labels``) of a sequence after TRL's truncation.

TRL tokenizes the prompt alone and the prompt followed by the completion: standard text with
``tokenizer(prompt)`` and ``tokenizer(prompt + completion)`` (the completion ending with the EOS token's
text), message lists with ``apply_chat_template(prompt, add_generation_prompt=True)`` and
``apply_chat_template(prompt + completion)``. The sequence trained on is the second encoding; its
completion starts where the two encodings diverge (their common prefix, `common_prefix_length`), which
is the prompt's length unless the tokenizer merges tokens across the boundary (``"Sky is "`` +
``"blue"``: the space joins ``" blue"``) or the chat template renders the prompt alone differently. TRL
then warns and leaves the prompt's diverging end out of the sequence; so does `split_completion`
(`Split.prefix_matches`). For a pair, the prompt is the shorter of the two common prefixes, so that
chosen and rejected share it (`shared_prompt_length`).

A row's labels are next-token labels: ``labels[t]`` is the token at ``t + 1`` where that token is a
completion token, ``-100`` elsewhere (prompt, the last position). Every completion token but one at
position 0 (no token precedes it) is a target.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lit_losses.data.encoding import Message, TokenEncoder
from lit_losses.errors import ConfigError

IGNORE_INDEX = -100
TruncationMode = Literal["keep_start", "keep_end"]
"""TRL's ``truncation_mode``: keep the first ``max_length`` tokens of a sequence, or its last ones."""

Text = str | list[Message]
"""A record's field: standard text, or a conversation (a list of messages)."""


@dataclass
class Split:
    """One (prompt, completion) tokenized: ``prompt_ids``, the ``full_ids`` of prompt and completion
    together, and (for a conversation with ``assistant_mask``) the template's assistant mask of
    ``full_ids``."""

    prompt_ids: list[int]
    full_ids: list[int]
    assistant_mask: list[int] | None = None

    @property
    def prompt_length(self) -> int:
        """Where the completion starts in ``full_ids``: the length of its common prefix with
        ``prompt_ids``."""
        return common_prefix_length(self.prompt_ids, self.full_ids)

    @property
    def completion_ids(self) -> list[int]:
        """The completion's tokens: ``full_ids`` after `prompt_length`."""
        return self.full_ids[self.prompt_length :]

    @property
    def prefix_matches(self) -> bool:
        """Whether ``full_ids`` starts with ``prompt_ids`` (TRL warns when it does not)."""
        return self.prompt_length == len(self.prompt_ids)


def common_prefix_length(ids: Sequence[int], other: Sequence[int]) -> int:
    """The number of leading tokens ``ids`` and ``other`` share.

    Example:
        >>> common_prefix_length([5, 6, 7], [5, 6, 9, 10]), common_prefix_length([5], [5, 6])
        (2, 1)
    """
    length = 0
    for token, other_token in zip(ids, other, strict=False):
        if token != other_token:
            break
        length += 1
    return length


def shared_prompt_length(splits: Sequence[Split]) -> int:
    """The prompt length that the completions of one prompt share: the shortest `Split.prompt_length`
    (TRL's for a pair's chosen and rejected).

    Example:
        >>> shared_prompt_length([Split([5, 6], [5, 6, 7]), Split([5, 6], [5, 8])])
        1
    """
    return min(split.prompt_length for split in splits)


def split_completion(
    encoder: TokenEncoder,
    prompt: Text,
    completion: Text,
    where: str,
    assistant_mask: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> Split:
    """Tokenize ``prompt`` and ``prompt + completion`` as TRL does (see the module docstring).

    Standard text is concatenated as given: append the EOS token's text to ``completion`` first where
    TRL does (its trainers do for standard records). A conversation's ``template_kwargs`` (the record's
    ``tools`` and ``chat_template_kwargs``) go to the chat template.

    Example:
        >>> from lit_losses.data.tokenizer import train_tokenizer
        >>> encoder = TokenEncoder(train_tokenizer(["Q: 2+2? A: 4"] * 4, vocab_size=262), "bpe")
        >>> split = split_completion(encoder, "Q: 2+2? A:", " 4" + encoder.eos_token, "records[0]")
        >>> split.prefix_matches, len(split.completion_ids) >= 2
        (True, True)
    """
    if isinstance(prompt, str):
        return Split(prompt_ids=encoder.encode(prompt), full_ids=encoder.encode(prompt + completion))
    prompt_ids, _ = encoder.chat(prompt, where, add_generation_prompt=True, template_kwargs=template_kwargs)
    full_ids, mask = encoder.chat(
        [*prompt, *completion], where, assistant_mask=assistant_mask, template_kwargs=template_kwargs
    )
    return Split(prompt_ids=prompt_ids, full_ids=full_ids, assistant_mask=mask)


def truncate(values: Sequence[int], max_length: int | None, mode: TruncationMode) -> list[int]:
    """The first (``keep_start``) or last (``keep_end``) ``max_length`` values; all with ``None``.

    Example:
        >>> truncate([1, 2, 3, 4], 3, "keep_start"), truncate([1, 2, 3, 4], 3, "keep_end")
        ([1, 2, 3], [2, 3, 4])
    """
    if max_length is None or len(values) <= max_length:
        return list(values)
    return list(values[:max_length] if mode == "keep_start" else values[-max_length:])


def next_token_row(
    ids: Sequence[int], targets: Sequence[int], max_length: int | None, mode: TruncationMode = "keep_start"
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of a sequence whose tokens with ``targets[i] == 1`` are trained on,
    truncated to ``max_length`` tokens first.

    Example:
        >>> next_token_row([5, 6, 7, 8], [0, 0, 1, 1], max_length=None)
        ([5, 6, 7, 8], [-100, 7, 8, -100])
        >>> next_token_row([5, 6, 7, 8], [0, 0, 1, 1], max_length=3)
        ([5, 6, 7], [-100, 7, -100])
    """
    ids = truncate(ids, max_length=max_length, mode=mode)
    targets = truncate(targets, max_length=max_length, mode=mode)
    labels = [tok if target else IGNORE_INDEX for tok, target in zip(ids[1:], targets[1:], strict=True)]
    return ids, [*labels, IGNORE_INDEX]


def check_targets(
    labels: Sequence[int], where: str, what: str, max_length: int | None, option: str = "data.max_length"
) -> None:
    """Refuse a row without a target: its completion is empty, or truncation to ``max_length`` (the
    option named ``option``) left none of it.

    Example:
        >>> check_targets([-100, -100], "data.jsonl:3", "the rejected completion", max_length=2)
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: data.jsonl:3: the rejected completion has no token left to train on ...
    """
    if any(label != IGNORE_INDEX for label in labels):
        return
    hint = (
        f" after truncation to {option}={max_length} (the prompt fills it); raise {option} or shorten "
        "the prompt"
        if max_length is not None and len(labels) >= max_length
        else " (it is empty, or only its first token, which no token precedes)"
    )
    raise ConfigError(f"{where}: {what} has no token left to train on{hint}")
