"""Offline RL records: one sampled completion per JSON object, turned into a next-token training row.

A record takes one of two forms.

**Flat form** (token-aligned: entry ``i`` describes ``tokens[i]``)::

    {"tokens": [3, 9, 4, 7, 1],                      # prompt + completion token ids
     "logprobs": [null, null, -2.1, -0.4, -1.3],     # log π_sample(tokens[i] | tokens[:i]); null: not sampled
     "advantage": 0.8,                               # or "advantages": one per token (null where none)
     "completion_mask": [0, 0, 1, 1, 1],             # optional; default: where "logprobs" is not null
     "weights": [0, 0, 1.0, 1.0, 0.5],               # optional, Tinker's per-token weights
     "ref_logprobs": [null, null, -2.0, -0.5, -1.2], # optional: a reference policy's log-probabilities
     "old_logprobs": [null, null, -2.0, -0.4, -1.4], # optional: the trainer's, when "logprobs" are an
                                                     # inference engine's (π_old beside π_rollout)
     "sample_weight": 1.0}                           # optional: the sequence's weight (ROLL's weights=)

**Tinker's Datum form** (target-aligned, as `tinker.Datum`: position ``t`` of ``model_input`` predicts
``target_tokens[t]``; a ``TensorData`` may be written ``{"data": [...], ...}``)::

    {"model_input": [3, 9, 4, 7],    # or {"chunks": [{"tokens": [...]}, ...]}
     "loss_fn_inputs": {"target_tokens": [9, 4, 7, 1], "logprobs": [0, -2.1, -0.4, -1.3],
                        "advantages": [0, 0.8, 0.8, 0.8], "weights": [0, 1, 1, 1],  # and/or "mask"
                        "ref_logprobs": [...], "old_logprobs": [...]},             # optional
     "sample_weight": 1.0}                                                          # optional

The row of a record (`RLRow`) is ``input_ids = tokens[:-1]`` and, at input position ``t``, the target
``tokens[t + 1]`` if it is a completion token (``completion_mask`` 1 and weight ≠ 0), else ``-100``
(Datum form: ``model_input`` and ``target_tokens[t]`` where ``mask``/``weights`` are ≠ 0); the per-token
fields of the RL batch contract are shifted the same way and are 0.0 where there is no target:
``sampling_logprobs`` (from ``logprobs``), ``advantages``, ``loss_weights`` (from ``weights``),
``sample_weights`` (``sample_weight`` at every target), ``ref_logprobs`` and ``old_logprobs``. A position
with weight 0 has no target: it is neither trained on nor counted by the aggregation's denominators.

Every error names where the record came from (``file:line`` or ``records[i]``) and the field: a missing
field, lengths that differ, a token id outside ``[0, vocab_size)``, a non-finite value, a log-probability
> 0, a completion token without a log-probability, a record without a completion token or longer than
``seq_len``, a misspelt optional field, a field of the other form (``mask`` in the flat form, ...),
``old_logprobs`` of another length than ``logprobs``; and, naming the first record with and the first
without, ``ref_logprobs`` or ``old_logprobs`` in some records only. Other fields (``reward``, ids, text)
are ignored.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lit_losses.data.files import jsonl_values
from lit_losses.data.record_fields import RecordFields
from lit_losses.errors import ConfigError

IGNORE_INDEX = -100
#: The batch keys an RL row carries besides ``input_ids`` and ``labels``, in this order.
RL_FIELDS = (
    "sampling_logprobs",
    "advantages",
    "loss_weights",
    "sample_weights",
    "ref_logprobs",
    "old_logprobs",
)
#: The optional per-token log-probability fields: in every record of a data set or in none.
ALL_OR_NONE = ("ref_logprobs", "old_logprobs")
#: Fields a record may hold (flat form, then the Datum form); any other field is ignored unless it looks
#: like a misspelling of one of these.
FLAT_KEYS = (
    "tokens",
    "logprobs",
    "advantage",
    "advantages",
    "completion_mask",
    "weights",
    "ref_logprobs",
    "old_logprobs",
    "sample_weight",
)
DATUM_KEYS = ("model_input", "loss_fn_inputs", "sample_weight")
DATUM_INPUTS = ("target_tokens", "logprobs", "advantages", "weights", "mask", "ref_logprobs", "old_logprobs")
#: Fields of the other form, refused with a hint rather than ignored.
FLAT_FOREIGN = {
    "mask": "the flat form's mask is 'completion_mask'",
    "target_tokens": "the flat form's targets are tokens[1:]",
    "model_input": "a record with 'tokens' is in the flat form; use one form",
    "loss_fn_inputs": "a record with 'tokens' is in the flat form; use one form",
}
DATUM_FOREIGN = {key: "it belongs in 'loss_fn_inputs'" for key in DATUM_INPUTS}
INPUTS_FOREIGN = {
    "completion_mask": "the Datum form's mask is 'mask'",
    "advantage": "the Datum form takes per-token 'advantages'",
    "sample_weight": "it belongs at the record's top level",
}

Columns = dict[str, tuple[str, list]]
"""Batch key → (the record's field name, its list)."""
Converted = tuple[list[int], list[int], dict[str, list]]
"""A record's input ids, labels and target-aligned fields."""


@dataclass
class RLRow:
    """One record as a training row: ``input_ids``, ``labels`` (``-100``: no target) and the per-token
    float ``fields`` it holds (a subset of `RL_FIELDS`, each as long as ``input_ids``)."""

    input_ids: list[int]
    labels: list[int]
    fields: dict[str, list[float]]

    @property
    def num_targets(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


class _Fields(RecordFields):
    """`RecordFields` with the typed numeric fields of RL records (a Tinker ``TensorData`` read as its
    ``data``)."""

    def get(self, key: str, required: bool = True) -> Any:
        if key not in self.record or self.record[key] is None:
            if required:
                raise self.fail(f"missing field {key!r}")
            return None
        value = self.record[key]
        return value["data"] if isinstance(value, Mapping) and "data" in value else value  # TensorData

    def ints(self, key: str, vocab_size: int | None, length: int | None = None) -> list[int]:
        values = self.sequence(key, length)
        for i, v in enumerate(values):
            if not isinstance(v, int) or isinstance(v, bool):
                raise self.fail(f"{key}[{i}]={v!r} is not an integer token id")
            if v < 0 or (vocab_size is not None and v >= vocab_size):
                bound = f"[0, {vocab_size}) (data.vocab_size)" if vocab_size is not None else ">= 0"
                raise self.fail(f"{key}[{i}]={v} is outside the vocabulary: token ids must be {bound}")
        return values

    def floats(self, key: str, length: int, required: bool = True, logprob: bool = False) -> list | None:
        """Numbers or nulls; finite, and <= 0 for log-probabilities."""
        if self.get(key, required) is None:
            return None
        values = self.sequence(key, length)
        for i, v in enumerate(values):
            if v is None:
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise self.fail(f"{key}[{i}]={v!r} is not a number")
            if not math.isfinite(v):
                raise self.fail(f"{key}[{i}]={v} is not finite")
            if logprob and v > 0:
                raise self.fail(f"{key}[{i}]={v} is > 0, not a log-probability")
        return values

    def sequence(self, key: str, length: int | None) -> list:
        values = self.get(key)
        if not isinstance(values, list):
            raise self.fail(f"field {key!r} must be a list, got {type(values).__name__}")
        if length is not None and len(values) != length:
            raise self.fail(f"field {key!r} has {len(values)} entries, expected {length} (one per position)")
        return values

    def scalar(self, key: str, default: float | None, minimum: float | None = None) -> float | None:
        value = self.get(key, required=default is None)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise self.fail(f"field {key!r}={value!r} must be a finite number")
        if minimum is not None and value < minimum:
            raise self.fail(f"field {key!r}={value} must be >= {minimum}")
        return float(value)


def _datum_tokens(fields: _Fields, vocab_size: int | None) -> list[int]:
    model_input = fields.get("model_input")
    if isinstance(model_input, Mapping) and "chunks" in model_input:
        chunks = model_input["chunks"]
        if not isinstance(chunks, list) or not all(isinstance(c, Mapping) and "tokens" in c for c in chunks):
            raise fields.fail("model_input.chunks must be a list of {'tokens': [...]} (text chunks only)")
        model_input = [t for c in chunks for t in c["tokens"]]
    elif isinstance(model_input, Mapping) and "tokens" in model_input:
        model_input = model_input["tokens"]
    model_input_field = _Fields(
        {"model_input": model_input}, where=fields.where, known=DATUM_KEYS, foreign={}
    )
    return model_input_field.ints("model_input", vocab_size=vocab_size)


def _flat_targets(f: _Fields, n: int, logprobs: list, weights: list | None) -> list[bool]:
    mask = f.get("completion_mask", required=False)
    if mask is not None:
        mask = f.sequence("completion_mask", n)
        for i, m in enumerate(mask):
            if m not in (0, 1):  # True/False compare equal to 1/0
                raise f.fail(f"completion_mask[{i}]={m!r} must be 0 or 1")
        chosen = [bool(m) for m in mask]
    elif weights is not None:
        chosen = [w is not None and w != 0 for w in weights]
    else:
        chosen = [lp is not None for lp in logprobs]
    if weights is not None:
        chosen = [c and weights[i] is not None and weights[i] != 0 for i, c in enumerate(chosen)]
    if chosen[0]:
        raise f.fail(
            "tokens[0] has no preceding token and cannot be a completion token (its logprobs, "
            "completion_mask or weights entry must be null/0)"
        )
    return chosen


def _flat_record(f: _Fields, vocab_size: int | None) -> Converted:
    tokens = f.ints("tokens", vocab_size)
    n = len(tokens)
    if n < 2:
        raise f.fail(f"field 'tokens' has {n} token(s); a record needs a prompt token and a completion")
    logprobs = f.floats("logprobs", n, logprob=True)
    weights = f.floats("weights", n, required=False)
    targets = _flat_targets(f, n=n, logprobs=logprobs, weights=weights)
    if f.get("advantage", required=False) is not None and f.get("advantages", required=False) is not None:
        raise f.fail("give 'advantage' (one per record) or 'advantages' (one per token), not both")
    if f.get("advantages", required=False) is not None:
        advantages = f.floats("advantages", n)
    elif f.get("advantage", required=False) is not None:
        advantages = [f.scalar("advantage", default=None)] * n
    else:
        raise f.fail("missing field 'advantage' (one per record) or 'advantages' (one per token)")
    columns = {"sampling_logprobs": ("logprobs", logprobs), "advantages": ("advantages", advantages)}
    if weights is not None:
        columns["loss_weights"] = ("weights", weights)
    _optional_logprobs(f, columns=columns, n=n)
    return _shifted(f, inputs=tokens[:-1], targets=tokens[1:], chosen=targets[1:], columns=columns, offset=1)


def _optional_logprobs(f: _Fields, columns: Columns, n: int) -> None:
    """``ref_logprobs`` and ``old_logprobs`` into ``columns`` when the record has them (``old_logprobs``
    aligned like ``logprobs``: as many entries)."""
    old = f.get("old_logprobs", required=False)
    if isinstance(old, list) and len(old) != n:
        raise f.fail(
            f"field 'old_logprobs' has {len(old)} entries but 'logprobs' has {n}: old_logprobs is aligned "
            "like logprobs (one per position)"
        )
    for key in ALL_OR_NONE:
        values = f.floats(key, n, required=False, logprob=True)
        if values is not None:
            columns[key] = (key, values)


def _datum_record(f: _Fields, vocab_size: int | None) -> Converted:
    inputs = f.get("loss_fn_inputs")
    if not isinstance(inputs, Mapping):
        raise f.fail(f"field 'loss_fn_inputs' must be an object, got {type(inputs).__name__}")
    tokens = _datum_tokens(f, vocab_size)
    n = len(tokens)
    g = _Fields(inputs, where=f"{f.where} loss_fn_inputs", known=DATUM_INPUTS, foreign=INPUTS_FOREIGN)
    targets_ids = g.sequence("target_tokens", n)
    weights, mask = g.floats("weights", n, required=False), g.floats("mask", n, required=False)
    if weights is None and mask is None:
        raise g.fail("needs 'weights' or 'mask' (0 at prompt positions) to tell completion tokens apart")
    for key, values in (("weights", weights), ("mask", mask)):
        if values is not None and None in values:
            raise g.fail(f"{key}[{values.index(None)}] is null (0 marks a position without target)")
    targets = [(weights is None or weights[t] != 0) and (mask is None or mask[t] != 0) for t in range(n)]
    for t, target in enumerate(targets_ids):
        if not isinstance(target, int) or isinstance(target, bool):
            raise g.fail(f"target_tokens[{t}]={target!r} is not an integer token id")
        if targets[t] and not 0 <= target < (vocab_size or math.inf):
            bound = f"[0, {vocab_size}) (data.vocab_size)" if vocab_size is not None else ">= 0"
            raise g.fail(f"target_tokens[{t}]={target} is outside the vocabulary: token ids must be {bound}")
    columns = {
        "sampling_logprobs": ("logprobs", g.floats("logprobs", n, logprob=True)),
        "advantages": ("advantages", g.floats("advantages", n)),
    }
    if weights is not None:
        columns["loss_weights"] = ("weights", weights)
    _optional_logprobs(g, columns=columns, n=n)
    return _shifted(g, inputs=tokens, targets=targets_ids, chosen=targets, columns=columns, offset=0)


def _shifted(
    f: _Fields, inputs: list[int], targets: list[int], chosen: list[bool], columns: Columns, offset: int
) -> Converted:
    """Labels and target-aligned fields (``offset``: index of position ``t``'s target in the lists)."""
    labels = [tok if c else IGNORE_INDEX for tok, c in zip(targets, chosen, strict=True)]
    fields: dict[str, list] = {}
    for name, (key, values) in columns.items():
        column = []
        for t, c in enumerate(chosen):
            if c and values[t + offset] is None:
                raise f.fail(f"{key}[{t + offset}] is null at a completion token")
            column.append(float(values[t + offset]) if c else 0.0)
        fields[name] = column
    return inputs, labels, fields


def parse_record(record: Any, where: str, vocab_size: int | None = None, seq_len: int | None = None) -> RLRow:
    """The training row of one record (flat or Datum form; see the module docstring).

    Args:
        record: the decoded JSON object.
        where: where it came from, for errors (``file:line``, ``records[i]``).
        vocab_size: token ids must be below it (``None``: not checked).
        seq_len: the row (``len(tokens) - 1`` positions) must fit it (``None``: not checked).

    Raises:
        ConfigError: naming ``where`` and the field.

    Example:
        >>> row = parse_record({"tokens": [3, 9, 4, 7], "logprobs": [None, None, -2.0, -0.5],
        ...                     "advantage": 0.8}, "records[0]")
        >>> row.input_ids, row.labels
        ([3, 9, 4], [-100, 4, 7])
        >>> row.fields
        {'sampling_logprobs': [0.0, -2.0, -0.5], 'advantages': [0.0, 0.8, 0.8]}
    """
    if not isinstance(record, Mapping):
        raise ConfigError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    if "tokens" in record:
        f = _Fields(record, where=where, known=FLAT_KEYS, foreign=FLAT_FOREIGN)
        inputs, labels, fields = _flat_record(f, vocab_size)
    elif "model_input" in record or "loss_fn_inputs" in record:
        f = _Fields(record, where=where, known=DATUM_KEYS, foreign=DATUM_FOREIGN)
        inputs, labels, fields = _datum_record(f, vocab_size)
    else:
        raise ConfigError(
            f"{where}: a record needs 'tokens' (flat form) or 'model_input' and 'loss_fn_inputs' "
            f"(Tinker's Datum form); it has {sorted(record)}"
        )
    if seq_len is not None and len(inputs) > seq_len:
        raise f.fail(
            f"{len(inputs)} input positions do not fit data.seq_len={seq_len} (a record is never split); "
            "raise data.seq_len or shorten the record"
        )
    sample_weight = f.scalar("sample_weight", default=1.0, minimum=0.0)
    if "sample_weight" in record:
        fields["sample_weights"] = [sample_weight if lab != IGNORE_INDEX else 0.0 for lab in labels]
    row = RLRow(input_ids=inputs, labels=labels, fields=fields)
    if row.num_targets == 0:
        raise f.fail("has no completion token (every target is masked or has weight 0)")
    return row


def read_jsonl(
    path: str, vocab_size: int | None = None, seq_len: int | None = None
) -> list[tuple[RLRow, str]]:
    """The rows of a JSONL file of records (blank lines skipped), each with its ``file:line``."""
    return [
        (parse_record(value, where=where, vocab_size=vocab_size, seq_len=seq_len), where)
        for value, where in jsonl_values(path)
    ]


def parse_records(
    records: Iterable[Any], vocab_size: int | None = None, seq_len: int | None = None, name: str = "records"
) -> list[tuple[RLRow, str]]:
    """The rows of in-memory records, each with its ``records[i]``."""
    return [
        (parse_record(r, where=f"{name}[{i}]", vocab_size=vocab_size, seq_len=seq_len), f"{name}[{i}]")
        for i, r in enumerate(records)
    ]


def complete_fields(rows: list[tuple[RLRow, str]]) -> list[RLRow]:
    """Give every row the same fields: ``loss_weights`` and ``sample_weights`` (1.0 at targets) where some
    record has them; ``ref_logprobs`` and ``old_logprobs`` must be in every record or in none.

    Raises:
        ConfigError: naming the first record without ``ref_logprobs`` (``old_logprobs``) and the first
            one with it.
    """
    for key in ALL_OR_NONE:
        having = [w for row, w in rows if key in row.fields]
        if having and len(having) < len(rows):
            missing = next(w for row, w in rows if key not in row.fields)
            raise ConfigError(
                f"{missing}: missing field {key!r}, which {having[0]} has; give it in every record or in none"
            )
    present = {name for row, _ in rows for name in row.fields}
    for row, _ in rows:
        ones = [1.0 if lab != IGNORE_INDEX else 0.0 for lab in row.labels]
        for name in ("loss_weights", "sample_weights"):
            if name in present and name not in row.fields:
                row.fields[name] = list(ones)
        row.fields = {name: row.fields[name] for name in RL_FIELDS if name in row.fields}
    return [row for row, _ in rows]


def write_jsonl(records: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> None:
    """Write ``records`` one JSON object per line (atomically: a reader never sees a partial file).

    Example:
        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "mine.jsonl"
        >>> write_jsonl([{"tokens": [4, 2], "logprobs": [None, -0.5], "advantage": 1.0}], path)
        >>> [row.labels for row, _ in read_jsonl(str(path))]
        [[2]]
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text("".join(json.dumps(dict(r), allow_nan=False) + "\n" for r in records), encoding="utf-8")
    tmp.replace(path)
