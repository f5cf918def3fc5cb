"""SFT records in TRL's prompt-completion and conversational formats → next-token rows whose labels
leave out the prompt (``completion_only_loss``) or everything but the assistant's turns
(``assistant_only_loss``), as TRL's ``SFTConfig`` names the two options.

Formats (one JSON object per line; other fields are ignored; a conversation, or a conversational
completion, ends with the assistant's message)::

    {"prompt": "Translate to French: cat", "completion": " chat"}                  # prompt-completion
    {"prompt": [{"role": "user", "content": "Translate to French: cat"}],          # conversational
     "completion": [{"role": "assistant", "content": "chat"}]}                     #   prompt-completion
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}

A record is tokenized as TRL's ``SFTTrainer`` tokenizes it (`lit_losses.data.completions`): the row is
the prompt and completion encoded together (a standard completion ending with the EOS token), a
conversation rendered by the tokenizer's chat template. A token is trained on when it is in the
completion (with ``completion_only_loss``; TRL's default for prompt-completion records) and inside the
template's ``{% generation %}`` markers (with ``assistant_only_loss``); with neither, every token is. A
row is truncated to its first ``seq_len`` tokens (TRL's ``max_length``); one left without a target is an
error naming its ``file:line`` (TRL drops it silently).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lit_losses.data.completions import Split, Text, check_targets, next_token_row, split_completion
from lit_losses.data.encoding import Message, TokenEncoder
from lit_losses.data.record_fields import TEMPLATE_FIELDS, RecordFields
from lit_losses.errors import ConfigError

SFT_FIELDS = ("prompt", "completion", "messages")
KNOWN_FIELDS = (*SFT_FIELDS, *TEMPLATE_FIELDS)


@dataclass
class SFTRecord:
    """One SFT record: ``prompt`` and ``completion`` (text or messages), or a conversation
    ``messages``, and the chat template's keyword arguments ``template_kwargs`` (``tools``,
    ``chat_template_kwargs``); ``where`` names it (``file:line``)."""

    where: str
    prompt: Text | None = None
    completion: Text | None = None
    messages: list[Message] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def conversational(self) -> bool:
        return self.messages is not None or not isinstance(self.completion, str)

    @property
    def form(self) -> str:
        """``prompt-completion``, ``conversational prompt-completion`` or ``conversational (messages)``."""
        if self.messages is not None:
            return "conversational (messages)"
        return "conversational prompt-completion" if self.conversational else "prompt-completion"

    def texts(self) -> list[str]:
        """Its strings (message contents included), to train a tokenizer on."""
        fields = [self.messages] if self.messages is not None else [self.prompt, self.completion]
        out: list[str] = []
        for value in fields:
            out.extend([value] if isinstance(value, str) else [m["content"] for m in value])
        return out


def is_sft_record(record: Any) -> bool:
    """Whether a decoded JSON line holds the fields of an SFT record (``prompt``, ``completion`` or
    ``messages``).

    Example:
        >>> is_sft_record({"prompt": "Hi", "completion": " there"}), is_sft_record({"text": "Hi there"})
        (True, False)
    """
    return isinstance(record, Mapping) and any(key in record for key in SFT_FIELDS)


def parse_sft_record(record: Mapping[str, Any], where: str) -> SFTRecord:
    """The `SFTRecord` of a decoded JSON line (see the module docstring).

    Raises:
        ConfigError: naming ``where`` and the field (a missing ``completion``, a non-string field, ...).

    Example:
        >>> parse_sft_record({"prompt": "2 + 2 =", "completion": " 4"}, "sft.jsonl:1").form
        'prompt-completion'
        >>> parse_sft_record({"prompt": "2 + 2 ="}, "sft.jsonl:2")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: sft.jsonl:2: missing field 'completion' (a prompt-completion record ...
    """
    f = RecordFields(record, where, known=KNOWN_FIELDS)
    if "messages" in record:
        if "prompt" in record or "completion" in record:
            raise f.fail("a record has 'messages' (a conversation) or 'prompt' and 'completion', not both")
        messages = f.text("messages", "a conversational record")
        if isinstance(messages, str):
            raise f.fail("field 'messages' is a string, not a list of messages")
        f.ends_with_assistant("messages", messages)
        return SFTRecord(where, messages=messages, template_kwargs=f.template_kwargs())
    kind = "a prompt-completion record has 'prompt' and 'completion'"
    if "completion" not in record and {"chosen", "rejected"} <= set(record):
        raise f.fail(
            "a preference record (chosen/rejected): train it with data.class_path: PreferenceDataModule"
        )
    prompt, completion = f.text("prompt", kind), f.text("completion", kind)
    f.same_form(("prompt", "completion"))
    f.ends_with_assistant("completion", completion)
    return SFTRecord(where, prompt=prompt, completion=completion, template_kwargs=f.template_kwargs())


def check_sft_records(
    records: Sequence[SFTRecord], completion_only_loss: bool | None, assistant_only_loss: bool
) -> None:
    """One form per corpus, and the options the records allow.

    Raises:
        ConfigError: naming the first record and the one that differs, or the option and the record
            it does not apply to.

    Example:
        >>> check_sft_records([SFTRecord("a:1", "2 + 2 =", " 4")], None, assistant_only_loss=True)
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: data.assistant_only_loss=true needs conversational records ...
    """
    first = records[0]
    for record in records[1:]:
        if record.form != first.form:
            raise ConfigError(
                f"{record.where} is a {record.form} record but {first.where} is {first.form}; one format per "
                "corpus"
            )
    if completion_only_loss and first.messages is not None:
        raise ConfigError(
            f"data.completion_only_loss=true needs prompt-completion records ('prompt' and 'completion'); "
            f"{first.where} is a conversation ('messages': use data.assistant_only_loss to train on the "
            "assistant's turns only)"
        )
    if assistant_only_loss and not first.conversational:
        raise ConfigError(
            f"data.assistant_only_loss=true needs conversational records (message lists); {first.where} "
            "is standard text"
        )


def check_generation_markers(encoder: TokenEncoder, where: str) -> None:
    """Refuse ``assistant_only_loss`` with a chat template that does not mark the assistant's tokens
    (or no chat template: the error names ``where``, the first record).

    Example:
        >>> from lit_losses.data.tokenizer import train_tokenizer
        >>> check_generation_markers(TokenEncoder(train_tokenizer(["hi"], 262), "bpe"), "chat.jsonl:1")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: chat.jsonl:1: a conversational record (message lists) is rendered ...
    """
    encoder.check_chat(where)
    if not encoder.has_generation_markers:
        raise ConfigError(
            f"data.assistant_only_loss=true: the chat template of {encoder.name} has no {{% generation %}} "
            "markers around the assistant's turns, so their tokens cannot be told apart; give a tokenizer "
            "whose chat_template wraps each assistant message in {% generation %} ... {% endgeneration %}"
        )


def with_eos(completion: Text, encoder: TokenEncoder) -> Text:
    """A standard completion ending with the EOS token's text (TRL adds it when missing); a conversation
    as it is (its template ends the turns).

    Example:
        >>> from lit_losses.data.tokenizer import train_tokenizer
        >>> with_eos(" 4", TokenEncoder(train_tokenizer(["2 + 2 = 4"], 262), "bpe"))
        ' 4<|endoftext|>'
    """
    if not isinstance(completion, str):
        return completion
    if encoder.eos_token is None:
        raise ConfigError(f"data.append_eos: {encoder.name} has no eos_token; set data.append_eos: false")
    return completion if completion.endswith(encoder.eos_token) else completion + encoder.eos_token


def sft_row(
    record: SFTRecord,
    encoder: TokenEncoder,
    seq_len: int,
    completion_only_loss: bool,
    assistant_only_loss: bool,
    eos: bool = True,
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one record (see the module docstring); ``eos``: end a standard
    completion with the EOS token's text (TRL does).

    Example:
        >>> from lit_losses.data.tokenizer import train_tokenizer
        >>> encoder = TokenEncoder(train_tokenizer(["Q: hi A: hello"] * 4, vocab_size=262), "bpe")
        >>> record = SFTRecord("sft.jsonl:1", "Q: hi A:", " hello")
        >>> ids, labels = sft_row(record, encoder, seq_len=64, completion_only_loss=True,
        ...                       assistant_only_loss=False)
        >>> encoder.tokenizer.decode([t for t in labels if t != -100])  # the completion (EOS is special)
        ' hello'
    """
    if record.messages is not None:
        ids, assistant = encoder.chat(
            record.messages,
            record.where,
            assistant_mask=assistant_only_loss,
            template_kwargs=record.template_kwargs,
        )
        split = Split(prompt_ids=[], full_ids=ids, assistant_mask=assistant)
    else:
        completion = with_eos(record.completion, encoder) if eos else record.completion
        split = split_completion(
            encoder,
            prompt=record.prompt,
            completion=completion,
            where=record.where,
            assistant_mask=assistant_only_loss,
            template_kwargs=record.template_kwargs,
        )
    targets = [1] * len(split.full_ids)
    if completion_only_loss:
        targets = [0] * split.prompt_length + targets[split.prompt_length :]
    if assistant_only_loss:
        targets = [t and m for t, m in zip(targets, split.assistant_mask, strict=True)]
    ids, labels = next_token_row(split.full_ids, targets, max_length=seq_len)
    what = "the completion" if completion_only_loss else "the record"
    what = "its assistant turns" if assistant_only_loss else what
    check_targets(labels, where=record.where, what=what, max_length=seq_len, option="data.seq_len")
    return ids, labels
