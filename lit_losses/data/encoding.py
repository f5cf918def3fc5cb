"""One interface over the two tokenizers that records are encoded with: the package's byte-level BPE
(`lit_losses.data.tokenizer`) and a Hugging Face tokenizer (``[hf]`` extra), with conversations rendered
through the Hugging Face tokenizer's chat template (``apply_chat_template``), as TRL renders them.

Text is encoded as TRL's trainers encode it: ``tokenizer(text)`` (a Hugging Face tokenizer adds its
special tokens, e.g. BOS, with ``add_special_tokens``); a conversation is ``apply_chat_template(messages,
tokenize=True)``, optionally with the mask of the assistant's tokens that the template's
``{% generation %}`` … ``{% endgeneration %}`` markers delimit (``return_assistant_tokens_mask``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer

from lit_losses.data.tokenizer import EOS_TOKEN, PAD_TOKEN
from lit_losses.errors import ConfigError

Message = dict[str, Any]
"""A chat message: ``{"role": "user" | "assistant" | "system" | "tool", "content": str}``."""

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""A chat template's ``{% generation %}`` marker (whitespace-trim variants included)."""


class TokenEncoder:
    """Text and conversations → token ids, with the package's BPE or a Hugging Face tokenizer.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` (the package's BPE: its ``<|endoftext|>`` ends completions
            and ``<|pad|>`` pads) or a Hugging Face ``PreTrainedTokenizerBase``.
        name: how messages name it (``"the built-in BPE tokenizer"``, ``"data.tokenizer '/path'"``).
        add_special_tokens: let a Hugging Face tokenizer add its special tokens (e.g. BOS) to text.

    Example:
        >>> from lit_losses.data.tokenizer import train_tokenizer
        >>> encoder = TokenEncoder(train_tokenizer(["the cat sat"] * 4, vocab_size=270), "the built-in BPE")
        >>> ids = encoder.encode("the cat" + encoder.eos_token)
        >>> ids[-1] == encoder.eos_id, encoder.has_chat_template
        (True, False)
    """

    def __init__(self, tokenizer: Any, name: str, add_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.name = name
        self.add_special_tokens = add_special_tokens
        self.builtin = isinstance(tokenizer, Tokenizer)

    # ---- special tokens ------------------------------------------------------------------------
    @property
    def eos_token(self) -> str | None:
        """The end-of-sequence token's text (appended to standard completions), ``None`` if there is none."""
        return EOS_TOKEN if self.builtin else self.tokenizer.eos_token

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.token_to_id(EOS_TOKEN) if self.builtin else self.tokenizer.eos_token_id

    @property
    def pad_id(self) -> int:
        """The input id of padding positions: the pad token, else EOS, else 0."""
        if self.builtin:
            return self.tokenizer.token_to_id(PAD_TOKEN)
        tok = self.tokenizer
        return next(i for i in (tok.pad_token_id, tok.eos_token_id, 0) if i is not None)

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size() if self.builtin else len(self.tokenizer)

    # ---- text --------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (a Hugging Face tokenizer's special tokens with ``add_special_tokens``)."""
        if self.builtin:
            return self.tokenizer.encode(text).ids
        return list(self.tokenizer(text, add_special_tokens=self.add_special_tokens)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens included), for messages."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    # ---- conversations -----------------------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        return None if self.builtin else getattr(self.tokenizer, "chat_template", None)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    @property
    def has_generation_markers(self) -> bool:
        """Whether the chat template marks the assistant's tokens with ``{% generation %}``."""
        return bool(self.chat_template) and GENERATION_MARKER.search(str(self.chat_template)) is not None

    def check_chat(self, where: str) -> None:
        """Refuse a conversational record (named by ``where``) when the tokenizer has no chat template."""
        if self.builtin:
            raise ConfigError(
                f"{where}: a conversational record (message lists) is rendered with a chat template, and "
                f"{self.name} has none; give data.tokenizer a Hugging Face tokenizer directory whose "
                "tokenizer_config.json holds a chat_template"
            )
        if not self.has_chat_template:
            raise ConfigError(
                f"{where}: a conversational record (message lists) is rendered with a chat template, and "
                f"{self.name} has none (no chat_template in its tokenizer_config.json)"
            )

    def chat(
        self,
        messages: Sequence[Message],
        where: str,
        add_generation_prompt: bool = False,
        assistant_mask: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], list[int] | None]:
        """Token ids of ``messages`` rendered by the chat template, and (with ``assistant_mask``) a 0/1
        mask of the tokens inside the template's ``{% generation %}`` markers; ``template_kwargs`` (a
        record's ``tools``, ``chat_template_kwargs``) go to ``apply_chat_template``.

        Raises:
            ConfigError: naming ``where`` when there is no chat template or rendering fails.
        """
        self.check_chat(where)
        try:
            out = self.tokenizer.apply_chat_template(
                list(messages),
                tokenize=True,
                return_dict=True,
                add_generation_prompt=add_generation_prompt,
                return_assistant_tokens_mask=assistant_mask,
                **(template_kwargs or {}),
            )
        except Exception as err:  # a template that raises on this record (role order, missing key, ...)
            reason = " ".join(str(err).split()) or "no message"
            raise ConfigError(
                f"{where}: the chat template of {self.name} cannot render this record "
                f"({type(err).__name__}: {reason})"
            ) from err
        ids = list(out["input_ids"])
        return ids, list(out["assistant_masks"]) if assistant_mask else None
