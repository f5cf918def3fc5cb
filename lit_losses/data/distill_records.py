"""Offline distillation records: token sequences with a teacher's top-k log-probabilities, one JSON object
per line, turned into next-token training rows carrying ``teacher_topk_ids`` and ``teacher_topk_logprobs``.

A record is token-aligned like the ``logprobs`` of the RL records (`lit_losses.data.rl_records`): entry
``i`` describes ``tokens[i]``, the teacher's ``k`` most probable tokens given ``tokens[:i]`` and their
log-probabilities (``null`` where the teacher gave none, e.g. the prompt)::

    {"tokens": [3, 9, 4, 7],
     "teacher_topk_ids":      [null, null, [4, 8, 1], [7, 2, 4]],
     "teacher_topk_logprobs": [null, null, [-0.2, -2.1, -3.0], [-0.1, -2.9, -3.5]],
     "completion_mask": [0, 0, 1, 1]}                     # optional; default: where the top-k are given

The row of a record is ``input_ids = tokens[:-1]`` and, at input position ``t``, the target
``tokens[t + 1]`` where the top-k of ``tokens[t + 1]`` are given (and ``completion_mask`` is 1), else
``-100``; the top-k shift the same way into ``[T, k]`` fields (zeros where there is no target). Every
record of a data set has the same ``k`` (`check_same_k`).

Every error names ``file:line`` (or ``records[i]``) and the field: lists of another length than
``tokens``, ids outside ``[0, vocab_size)`` or repeated, a ``k`` that differs from the record's first,
non-finite log-probabilities, a log-probability ``> 0`` or a mass ``Σ e^ℓ > 1`` (beyond
`lit_losses.heads.topk.TOPK_TOLERANCE`), a completion token without its top-k, a record
without a completion token or longer than ``seq_len``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from lit_losses.data.files import jsonl_values
from lit_losses.data.rl_records import IGNORE_INDEX, RLRow
from lit_losses.errors import ConfigError
from lit_losses.heads.topk import TOPK_TOLERANCE

IDS, LOGPROBS = "teacher_topk_ids", "teacher_topk_logprobs"
#: Fields a record may hold; any other one is ignored.
RECORD_KEYS = ("tokens", IDS, LOGPROBS, "completion_mask")


def _fail(where: str, message: str) -> ConfigError:
    return ConfigError(f"{where}: {message}")


def _tokens(record: Mapping[str, Any], where: str, vocab_size: int | None) -> list[int]:
    tokens = record.get("tokens")
    if tokens is None:
        raise _fail(
            where,
            f"missing field 'tokens' (a record holds token ids: {', '.join(RECORD_KEYS)}); it has "
            f"{sorted(record)}",
        )
    if not isinstance(tokens, list) or len(tokens) < 2:
        raise _fail(
            where, "field 'tokens' must be a list of at least 2 token ids (a prompt and a completion)"
        )
    for i, tok in enumerate(tokens):
        if type(tok) is not int or tok < 0 or (vocab_size is not None and tok >= vocab_size):
            raise _fail(
                where, f"tokens[{i}]={tok!r} is not a token id in [0, {vocab_size}) (data.vocab_size)"
            )
    return tokens


def _topk_entry(ids: Any, logprobs: Any, at: str, vocab_size: int | None) -> tuple[list[int], list[float]]:
    """One position's ``(ids, logprobs)``, checked (``at``: ``file:line`` and the index)."""
    if not isinstance(ids, list) or not isinstance(logprobs, list) or not ids or len(ids) != len(logprobs):
        raise ConfigError(f"{at}: {IDS} and {LOGPROBS} must be two lists of the same k >= 1 entries")
    if any(type(i) is not int or i < 0 or (vocab_size is not None and i >= vocab_size) for i in ids):
        raise ConfigError(f"{at}: {IDS}={ids} holds a value that is not a token id in [0, {vocab_size})")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{at}: {IDS}={ids} repeats an id")
    if any(type(v) not in (int, float) or not math.isfinite(v) for v in logprobs):
        raise ConfigError(f"{at}: {LOGPROBS}={logprobs} holds a value that is not a finite number")
    if max(logprobs) > TOPK_TOLERANCE:
        raise ConfigError(f"{at}: {LOGPROBS} holds {max(logprobs)} > 0, not a log-probability")
    mass = sum(math.exp(v) for v in logprobs)
    if mass > 1 + TOPK_TOLERANCE:
        raise ConfigError(f"{at}: {LOGPROBS} hold a mass Σ exp = {mass:.4f} > 1 (one distribution's top-k)")
    return ids, [float(v) for v in logprobs]


def _column(record: Mapping[str, Any], key: str, n: int, where: str) -> list:
    values = record.get(key)
    if not isinstance(values, list) or len(values) != n:
        got = f"{len(values)} entries" if isinstance(values, list) else type(values).__name__
        raise _fail(where, f"field {key!r} must be a list of {n} entries (one per token), got {got}")
    return values


def _completion(record: Mapping[str, Any], ids: list, n: int, where: str) -> list[bool]:
    mask = record.get("completion_mask")
    if mask is None:
        logprobs = record[LOGPROBS]
        for i, (entry, values) in enumerate(zip(ids, logprobs, strict=True)):
            if (entry is None) != (values is None):
                null, given = (IDS, LOGPROBS) if entry is None else (LOGPROBS, IDS)
                raise _fail(where, f"{null}[{i}] is null but {given}[{i}] is not; give both or neither")
        return [entry is not None for entry in ids]
    mask = _column(record, "completion_mask", n=n, where=where)
    if any(m not in (0, 1) for m in mask):
        raise _fail(where, "completion_mask entries must be 0 or 1")
    for i, (m, entry) in enumerate(zip(mask, ids, strict=True)):
        if m and entry is None:
            raise _fail(where, f"{IDS}[{i}] is null at a completion token")
    return [bool(m) for m in mask]


def parse_distill_record(
    record: Any, where: str, vocab_size: int | None = None, seq_len: int | None = None
) -> RLRow:
    """The training row of one record (the module docstring): ``input_ids``, ``labels`` and the fields
    ``teacher_topk_ids`` / ``teacher_topk_logprobs`` (``k`` values per position).

    Raises:
        ConfigError: naming ``where`` and the field.

    Example:
        >>> row = parse_distill_record({"tokens": [3, 9, 4], "teacher_topk_ids": [None, [9, 1], [4, 2]],
        ...     "teacher_topk_logprobs": [None, [-0.1, -3.0], [-0.5, -1.0]]}, "records[0]")
        >>> row.input_ids, row.labels, row.fields["teacher_topk_ids"]
        ([3, 9], [9, 4], [[9, 1], [4, 2]])
    """
    if not isinstance(record, Mapping):
        raise _fail(where, f"a record must be a JSON object, got {type(record).__name__}")
    tokens = _tokens(record, where=where, vocab_size=vocab_size)
    n = len(tokens)
    ids = _column(record, IDS, n=n, where=where)
    logprobs = _column(record, LOGPROBS, n=n, where=where)
    completion = _completion(record, ids, n=n, where=where)
    if completion[0]:
        raise _fail(where, "tokens[0] has no preceding token and cannot be a completion token")
    if seq_len is not None and n - 1 > seq_len:
        raise _fail(
            where, f"{n - 1} input positions do not fit data.seq_len={seq_len} (a record is never split)"
        )
    k, labels, row_ids, row_logprobs = None, [], [], []
    for i in range(1, n):
        if not completion[i]:
            labels.append(IGNORE_INDEX)
            row_ids.append(None)
            row_logprobs.append(None)
            continue
        pair = _topk_entry(ids[i], logprobs[i], at=f"{where} position {i}", vocab_size=vocab_size)
        if k is not None and len(pair[0]) != k:
            raise _fail(where, f"{IDS}[{i}] has k={len(pair[0])} entries, the record's first {k}")
        k = len(pair[0])
        labels.append(tokens[i])
        row_ids.append(pair[0])
        row_logprobs.append(pair[1])
    if k is None:
        raise _fail(where, "has no completion token (no position with its teacher top-k)")
    fields = {
        IDS: [[0] * k if v is None else v for v in row_ids],
        LOGPROBS: [[0.0] * k if v is None else v for v in row_logprobs],
    }
    return RLRow(input_ids=tokens[:-1], labels=labels, fields=fields)


def topk_size(row: RLRow) -> int:
    """The ``k`` of a row's top-k fields."""
    return len(row.fields[IDS][0])


def check_same_k(rows: Iterable[tuple[RLRow, str]]) -> list[RLRow]:
    """The rows, when every one has the ``k`` of the first.

    Raises:
        ConfigError: naming the first record whose ``k`` differs and the first record's.
    """
    rows = list(rows)
    if rows:
        first, first_where = rows[0]
        for row, where in rows[1:]:
            if topk_size(row) != topk_size(first):
                raise ConfigError(
                    f"{where}: {IDS} has k={topk_size(row)} entries per position, {first_where} has "
                    f"{topk_size(first)}: every record of the data gives the same k"
                )
    return [row for row, _ in rows]


def read_distill_jsonl(
    path: str, vocab_size: int | None = None, seq_len: int | None = None
) -> list[tuple[RLRow, str]]:
    """The rows of a JSONL file of records (blank lines skipped), each with its ``file:line``."""
    return [
        (parse_distill_record(value, where=where, vocab_size=vocab_size, seq_len=seq_len), where)
        for value, where in jsonl_values(path)
    ]


__all__ = ["IDS", "LOGPROBS", "check_same_k", "parse_distill_record", "read_distill_jsonl", "topk_size"]
