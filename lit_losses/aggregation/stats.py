"""Counts of valid units that the aggregation modes divide by."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from lit_losses.aggregation.checks import check_batch, check_count, check_ids, check_index, check_tensor
from lit_losses.choices import check_choice
from lit_losses.errors import BatchKeyError

LABELS_KEY = "labels"
"""The default mask key: ``labels != ignore_index``."""

LabelFormat = Literal["next_token", "input_aligned"]
"""How a batch's ``labels`` are laid out: ``next_token`` (``labels[t]`` is the target of position ``t``:
lit_losses' data modules) or ``input_aligned`` (aligned with ``input_ids`` and shifted by the model, as
Hugging Face's collators and ``labels=`` loss do: the target of position ``t`` is ``labels[t + 1]``)."""


def segments_from_positions(position_ids: Tensor) -> Tensor:
    """Segment ids ``[B, T]`` from ``position_ids`` alone: a new segment wherever a position is not the
    previous one plus 1 (Hugging Face's packed format, ``DataCollatorWithFlattening``: positions restart
    at 0 for each document and there are no ``segment_ids``; the rule transformers' own packed-sequence
    detection uses).

    Example:
        >>> import torch
        >>> segments_from_positions(torch.tensor([[0, 1, 2, 0, 1, 0], [5, 6, 7, 8, 9, 10]])).tolist()
        [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]]
    """
    first = position_ids[..., :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def batch_segment_ids(batch: Mapping[str, Any]) -> Tensor | None:
    """The segments of a batch's packed rows: ``batch["segment_ids"]``, else derived from
    ``batch["position_ids"]`` (`segments_from_positions`), else ``None`` (one sequence per row).

    Example:
        >>> import torch
        >>> batch_segment_ids({"position_ids": torch.tensor([[0, 1, 0, 1, 2]])}).tolist()
        [[0, 0, 1, 1, 1]]
        >>> batch_segment_ids({"labels": torch.tensor([[1, 2]])}) is None
        True
    """
    if batch.get("segment_ids") is not None:
        return batch["segment_ids"]
    position_ids = batch.get("position_ids")
    if not isinstance(position_ids, Tensor) or position_ids.dim() < 1:
        return None
    return segments_from_positions(position_ids)


def sequence_ids(
    mask: Tensor, segment_ids: Tensor | None = None, position_ids: Tensor | None = None
) -> Tensor:
    """A dense id per position of its sequence: a (row, segment) pair in packed rows, else the row.

    Segments are ``segment_ids``; without them, runs of consecutive ``position_ids``
    (`segments_from_positions`: Hugging Face's packed rows); with neither, each row is one sequence.

    Returns a ``long`` tensor shaped like ``mask`` with ids in ``[0, number of sequences)``.

    Example:
        >>> import torch
        >>> mask = torch.ones(2, 4, dtype=torch.bool)
        >>> sequence_ids(mask).tolist()
        [[0, 0, 0, 0], [1, 1, 1, 1]]
        >>> sequence_ids(mask, position_ids=torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]])).tolist()
        [[0, 0, 1, 1], [2, 2, 2, 2]]
    """
    rows = torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)
    name = "segment_ids"
    if segment_ids is None and position_ids is not None:
        segment_ids, name = segments_from_positions(position_ids), "position_ids"
    if segment_ids is None:
        return rows.long()
    if segment_ids.shape != mask.shape:
        raise ValueError(
            f"{name} shape {tuple(segment_ids.shape)} differs from the mask shape {tuple(mask.shape)}"
        )
    check_ids(segment_ids, name)
    seg = segment_ids.long() - segment_ids.min()
    key = rows.long() * (int(seg.max()) + 1) + seg
    return torch.unique(key, return_inverse=True)[1]


def shift_labels(labels: Tensor, segments: Tensor | None = None, ignore_index: int = -100) -> Tensor:
    """Next-token labels from labels aligned with ``input_ids`` (Hugging Face's convention):
    ``out[:, t] = labels[:, t + 1]``.

    The last position of a row, and the last position of every segment (its next token belongs to
    another document), get ``ignore_index``.

    Example:
        >>> import torch
        >>> labels = torch.tensor([[-100, 11, 12, -100, 21, 22]])  # two documents, first labels ignored
        >>> shift_labels(labels, segments=torch.tensor([[0, 0, 0, 1, 1, 1]])).tolist()
        [[11, 12, -100, 21, 22, -100]]
    """
    shifted = torch.full_like(labels, ignore_index)
    shifted[:, :-1] = labels[:, 1:]
    if segments is not None:
        shifted[:, :-1].masked_fill_(segments[:, 1:] != segments[:, :-1], ignore_index)
    return shifted


def count_units(mask: Tensor, segment_ids: Tensor | None = None) -> tuple[int, int]:
    """``(valid tokens, sequences with at least one valid token)`` of one micro-batch (both counts read from
    the device at once)."""
    mask = mask.bool()
    ids = sequence_ids(mask, segment_ids).flatten()
    per_seq = torch.zeros(ids.numel(), dtype=torch.long, device=mask.device)
    per_seq.index_add_(0, ids, mask.flatten().long())
    tokens, sequences = torch.stack([per_seq.sum(), (per_seq > 0).sum()]).tolist()
    return tokens, sequences


def batch_mask(batch: Mapping[str, Any], key: str, ignore_index: int = -100) -> Tensor:
    """The boolean mask of ``key``: ``labels != ignore_index`` for ``"labels"``, else ``batch[key]``."""
    if key not in batch:
        raise BatchKeyError(f"mask key {key!r} is missing from the batch; the batch has keys {sorted(batch)}")
    value = batch[key]
    if not isinstance(value, Tensor):
        raise TypeError(f"batch[{key!r}] must be a tensor to serve as a mask, got {type(value).__name__}")
    check_tensor(value, f"batch[{key!r}]")
    if key == LABELS_KEY:
        return check_ids(value, f"batch[{key!r}]") != check_index(ignore_index, "ignore_index")
    if value.dtype != torch.bool and not torch.all((value == 0) | (value == 1)):
        raise ValueError(f"batch[{key!r}] is used as a mask but holds values other than 0 and 1")
    return value.bool()


@dataclass
class MaskStats:
    """Counts of one mask key: valid tokens and sequences with at least one valid token."""

    num_tokens: int = 0
    """Valid tokens."""
    num_sequences: int = 0
    """Sequences with at least one valid token."""

    def __post_init__(self) -> None:
        self.num_tokens = check_count(self.num_tokens, "MaskStats.num_tokens")
        self.num_sequences = check_count(self.num_sequences, "MaskStats.num_sequences")
        if self.num_sequences > self.num_tokens:
            raise ValueError(
                f"MaskStats counts contradict each other: {self.num_sequences} sequences with a valid token "
                f"but only {self.num_tokens} valid tokens"
            )

    def __add__(self, other: MaskStats) -> MaskStats:
        return MaskStats(self.num_tokens + other.num_tokens, self.num_sequences + other.num_sequences)


def count_masks(
    batch: Mapping[str, Any],
    mask_keys: Iterable[str] = (LABELS_KEY,),
    ignore_index: int = -100,
    label_format: LabelFormat = "next_token",
) -> dict[str, MaskStats]:
    """Counts of one micro-batch for every mask key (sequences follow `batch_segment_ids`:
    ``batch["segment_ids"]``, else restarts of ``batch["position_ids"]``). With ``input_aligned`` labels
    the ``labels`` key counts the targets after the model's shift (`shift_labels`): what its loss uses.

    Example:
        >>> import torch
        >>> batch = {"labels": torch.tensor([[5, 6, 7, -100]])}  # DataCollatorForLanguageModeling's labels
        >>> count_masks(batch)["labels"].num_tokens
        3
        >>> count_masks(batch, label_format="input_aligned")["labels"].num_tokens  # after the shift
        2
    """
    check_batch(batch, "count_masks")
    check_choice(label_format, LabelFormat, "label_format")
    if isinstance(mask_keys, str):
        raise TypeError(f"mask_keys must be a sequence of batch keys, got the string {mask_keys!r}")
    segment_ids = batch_segment_ids(batch)
    if label_format == "input_aligned" and isinstance(batch.get(LABELS_KEY), Tensor):
        batch = {**batch, LABELS_KEY: shift_labels(batch[LABELS_KEY], segment_ids, ignore_index)}
    return {
        key: MaskStats(*count_units(batch_mask(batch, key, ignore_index), segment_ids)) for key in mask_keys
    }


def sum_counts(counts: Iterable[Mapping[str, MaskStats]]) -> dict[str, MaskStats]:
    """Key-wise sum of per-micro-batch counts."""
    total: dict[str, MaskStats] = {}
    for c in counts:
        for key, value in c.items():
            total[key] = total.get(key, MaskStats()) + value
    return total


def counts_to_tensor(counts: Mapping[str, MaskStats], keys: Sequence[str]) -> Tensor:
    """``[tokens, sequences]`` per key, flattened in the order of ``keys`` (for one all-reduce)."""
    return torch.tensor([[counts[k].num_tokens, counts[k].num_sequences] for k in keys], dtype=torch.int64)


def tensor_to_counts(values: Tensor, keys: Sequence[str]) -> dict[str, MaskStats]:
    rows = values.reshape(len(keys), 2).tolist()
    return {k: MaskStats(int(t), int(s)) for k, (t, s) in zip(keys, rows, strict=True)}


@dataclass
class GlobalStats:
    """What every micro-batch of an optimizer step needs to normalize by global counts.

    ``masks`` are the counts of the whole optimizer step (every micro-batch of the accumulation window
    on every data-parallel rank); ``local`` those of this micro-batch. ``loss_scale = A × D``
    (``accumulate_grad_batches`` × world size) cancels Lightning's ``÷A`` and DDP's ``÷D``, so that
    summing the micro-batch losses the way they do gives the global-batch loss.

    Example:
        >>> import torch
        >>> stats = GlobalStats.local_only({"labels": torch.tensor([[1, 2, -100], [3, -100, -100]])})
        >>> stats.get("labels"), stats.loss_scale
        (MaskStats(num_tokens=3, num_sequences=2), 1.0)
    """

    masks: dict[str, MaskStats] = field(default_factory=dict)
    """Global counts per mask key (``"labels"``: ``labels != ignore_index``)."""
    loss_scale: float = 1.0
    """Factor applied to the micro-batch loss before Lightning and DDP average it."""
    local: dict[str, MaskStats] = field(default_factory=dict)
    """Counts of this micro-batch per mask key (empty: not computed)."""
    position: int = 0
    """Index of this micro-batch in its accumulation window."""
    window: int = 1
    """Number of micro-batches of the window on each rank (the trailing one of an epoch may be short)."""

    def get(self, key: str = LABELS_KEY) -> MaskStats:
        """Global counts of ``key``."""
        if key not in self.masks:
            raise KeyError(f"no global statistics for mask key {key!r}; known keys: {sorted(self.masks)}")
        return self.masks[key]

    def get_local(self, key: str = LABELS_KEY) -> MaskStats:
        """Counts of ``key`` in this micro-batch."""
        if key not in self.local:
            raise KeyError(f"no local statistics for mask key {key!r}; known keys: {sorted(self.local)}")
        return self.local[key]

    @classmethod
    def local_only(
        cls, batch: Mapping[str, Any], mask_keys: Iterable[str] = (LABELS_KEY,), ignore_index: int = -100
    ) -> GlobalStats:
        """Statistics of one micro-batch on its own (per-micro-batch normalization, ``loss_scale = 1``)."""
        counts = count_masks(batch, mask_keys, ignore_index)
        return cls(masks=counts, loss_scale=1.0, local=dict(counts))
