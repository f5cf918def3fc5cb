"""Typed access to the fields of a JSON record (text or chat messages, log-probability sums), each error
naming the record's ``file:line`` and the field."""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Mapping
from typing import Any

from lit_losses.data.completions import Text
from lit_losses.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")
"""The roles of a chat message."""

TEMPLATE_FIELDS = ("tools", "chat_template_kwargs")
"""Fields of a conversational record that its chat template reads (TRL's)."""


class RecordFields:
    """Typed access to a record's fields; each error names ``where`` (``file:line``) and the field.

    A field that is not in ``known`` but looks like a misspelling of one of them is refused, as is a field
    of ``foreign`` (field → why it does not belong in this record); other fields are ignored.

    Example:
        >>> fields = RecordFields({"prompt": "Hi", "chosen": 3}, "a.jsonl:7", known=("prompt", "chosen"))
        >>> fields.text("prompt", "a record")
        'Hi'
        >>> fields.text("chosen", "a record")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: a.jsonl:7: field 'chosen' is a int, not a string or a list of messages
    """

    def __init__(
        self,
        record: Mapping[str, Any],
        where: str,
        known: tuple[str, ...],
        foreign: Mapping[str, str] | None = None,
    ) -> None:
        self.record = record
        self.where = where
        for key in record:
            if foreign and key in foreign:
                raise self.fail(f"field {key!r} does not belong here: {foreign[key]}")
            close = difflib.get_close_matches(str(key), [k for k in known if k not in record], 1, 0.85)
            if key not in known and close:
                raise self.fail(f"unknown field {key!r}; did you mean {close[0]!r}?")

    def fail(self, message: str) -> ConfigError:
        return ConfigError(f"{self.where}: {message}")

    def text(self, key: str, kind: str) -> Text:
        """The required field ``key``: a string or a non-empty list of messages (``kind`` says what
        record needs it)."""
        if key not in self.record:
            raise self.fail(f"missing field {key!r} ({kind})")
        value = self.record[key]
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise self.fail(f"field {key!r} is a {type(value).__name__}, not a string or a list of messages")
        if not value:
            raise self.fail(f"field {key!r} is an empty list of messages")
        for i, message in enumerate(value):
            self.message(message, f"{key}[{i}]")
        return value

    def message(self, message: Any, name: str) -> None:
        """Refuse a message that is not ``{"role": one of ROLES, "content": str}``."""
        if not isinstance(message, Mapping):
            kind = type(message).__name__
            raise self.fail(f"{name} is a {kind}, not a message {{'role': ..., 'content': ...}}")
        for key in ("role", "content"):
            if key not in message:
                raise self.fail(f"{name} has no {key!r}")
        if message["role"] not in ROLES:
            raise self.fail(f"{name} has role {message['role']!r}; a role is one of {ROLES}")
        if not isinstance(message["content"], str):
            raise self.fail(f"{name}['content'] is a {type(message['content']).__name__}, not a string")

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's keyword arguments that the record carries, as TRL's trainers pass them to
        ``apply_chat_template``: ``tools`` (a list of function schemas, or its JSON text) and the
        mapping ``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``); empty when neither.

        Example:
            >>> record = {"tools": '[{"name": "add"}]', "chat_template_kwargs": {"brief": True}}
            >>> RecordFields(record, "a.jsonl:2", known=TEMPLATE_FIELDS).template_kwargs()
            {'tools': [{'name': 'add'}], 'brief': True}
        """
        kwargs: dict[str, Any] = {}
        tools = self.record.get("tools")
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError as err:
                raise self.fail(
                    f"field 'tools' is a string that is not JSON ({err.msg}, column {err.colno})"
                ) from None
        if tools is not None and not isinstance(tools, list):
            raise self.fail(
                f"field 'tools' is a {type(tools).__name__}, not a list of function schemas (or their "
                "JSON text)"
            )
        if tools is not None:
            kwargs["tools"] = tools
        extra = self.record.get("chat_template_kwargs")
        if extra is not None and not isinstance(extra, Mapping):
            raise self.fail(
                f"field 'chat_template_kwargs' is a {type(extra).__name__}, not a mapping of the chat "
                "template's keyword arguments"
            )
        return kwargs | dict(extra or {})

    def ends_with_assistant(self, key: str, value: Text) -> None:
        """Refuse a conversation ``value`` (the field ``key``, or what is left of it after an implicit
        prompt) whose last message is not the assistant's: the completion a record trains on is the
        assistant's turn. Text passes.

        Example:
            >>> fields = RecordFields({}, "a.jsonl:3", known=())
            >>> fields.ends_with_assistant("chosen", [{"role": "user", "content": "And?"}])
            Traceback (most recent call last):
            ...
            lit_losses.errors.ConfigError: a.jsonl:3: field 'chosen' ends with a 'user' message, not the ...
        """
        if isinstance(value, str) or not value or value[-1]["role"] == "assistant":
            return
        raise self.fail(
            f"field {key!r} ends with a {value[-1]['role']!r} message, not the assistant's: the completion "
            "trained on is the assistant's turn (drop the trailing messages, or the record)"
        )

    def same_form(self, keys: tuple[str, ...]) -> None:
        """All text fields strings, or all message lists (a field of another type is named as such)."""
        for key in keys:
            value = self.record.get(key, "")
            if not isinstance(value, str | list):
                raise self.fail(
                    f"field {key!r} is a {type(value).__name__}, not a string or a list of messages"
                )
        forms = {key: isinstance(self.record[key], str) for key in keys if key in self.record}
        if len(set(forms.values())) > 1:
            text = next(k for k, is_str in forms.items() if is_str)
            chat = next(k for k, is_str in forms.items() if not is_str)
            raise self.fail(
                f"field {text!r} is a string but {chat!r} is a list of messages; give every field as text "
                "(standard) or every one as messages (conversational)"
            )

    def refs(self, names: tuple[str, ...]) -> dict[str, float]:
        """The fields ``names`` that the record holds: finite sums of log-probabilities (≤ 0)."""
        values = {}
        for name in names:
            value = self.record.get(name)
            if value is None:
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise self.fail(f"field {name!r}={value!r} must be a finite number")
            if value > 0:
                raise self.fail(f"field {name!r}={value} is > 0, not a sum of log-probabilities")
            values[name] = float(value)
        return values
