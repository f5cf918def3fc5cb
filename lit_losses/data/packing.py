"""Packing tokenized documents into rows, and rows into micro-batches of a token budget.

A *piece* is a run of at most ``seq_len`` tokens of one document (long documents are cut into
several pieces). A *row* holds one or more whole pieces (packing) or exactly one (no packing).
A *micro-batch* holds as many rows as fit ``rows × longest row ≤ tokens_per_batch``, so the number of
rows and of sequences varies from one micro-batch to the next.

Row layout, for pieces ``a`` then ``b``::

    input_ids     a0 a1 a2 b0 b1 PAD
    labels        a1 a2 -100 b1 -100 -100      (-100: no next token in the same document)
    segment_ids   1  1  1  2  2  0             (0: padding)
    position_ids  0  1  2  0  1  0

Pieces built with explicit ``labels`` (`Pieces.from_sequences`, e.g. RL records whose prompt tokens have
no target) use them instead of the next tokens, and their per-token ``fields`` (e.g. ``advantages``)
travel with the tokens into ``[B, T]`` float32 batch keys, 0.0 outside the pieces; a field of ``k`` values
per token (a teacher's top-k) becomes a ``[B, T, k]`` key, int64 for integer values (token ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch
from torch import Tensor


def field_tensor(values: list[Any]) -> Tensor:
    """Per-token values as a tensor: ``[n]`` float32 for numbers; ``[n, k]`` for lists of ``k``, int64 when
    they are integers (token ids), else float32.

    Example:
        >>> field_tensor([0.5, 1.0]).dtype, field_tensor([[3, 4], [0, 0]]).dtype
        (torch.float32, torch.int64)
    """
    first = values[0] if values else 0.0
    integers = isinstance(first, list) and bool(first) and all(type(v) is int for v in first)
    return torch.tensor(values, dtype=torch.int64 if integers else torch.float32)


@dataclass
class Pieces:
    """Pieces as ``(start, length)`` into one flat token tensor.

    ``labels`` (optional, aligned with ``tokens``): the target of each position, ``-100`` where there is
    none; without it a position's target is the next token of its piece. ``fields``: per-token tensors
    ``[n]`` or ``[n, k]`` aligned with ``tokens`` (the value at position ``i`` describes its target).
    """

    tokens: Tensor
    starts: Tensor
    lengths: Tensor
    labels: Tensor | None = None
    fields: dict[str, Tensor] = field(default_factory=dict)

    @classmethod
    def from_documents(cls, documents: list[list[int]], seq_len: int) -> Pieces:
        """Concatenate ``documents`` and cut each into pieces of at most ``seq_len`` tokens."""
        flat, starts, lengths, offset = [], [], [], 0
        for doc in documents:
            flat.extend(doc)
            for s in range(0, len(doc), seq_len):
                starts.append(offset + s)
                lengths.append(min(seq_len, len(doc) - s))
            offset += len(doc)
        return cls(
            tokens=torch.tensor(flat, dtype=torch.int32),
            starts=torch.tensor(starts, dtype=torch.int64),
            lengths=torch.tensor(lengths, dtype=torch.int64),
        )

    @classmethod
    def from_sequences(
        cls, inputs: list[list[int]], labels: list[list[int]], fields: dict[str, list[list[Any]]]
    ) -> Pieces:
        """One piece per sequence (never cut), with its own ``labels`` and per-token ``fields``: a number per
        token (float32), or a list of ``k`` per token (int64 for integers, else float32).

        Example:
            >>> adv = {"advantages": [[0.0, 1.5], [-1.0]]}
            >>> p = Pieces.from_sequences([[5, 6], [7]], [[-100, 9], [8]], adv)
            >>> p.lengths.tolist(), p.labels.tolist(), p.fields["advantages"].tolist()
            ([2, 1], [-100, 9, 8], [0.0, 1.5, -1.0])
        """
        lengths = [len(seq) for seq in inputs]
        flat_fields = {k: [v for seq in rows for v in seq] for k, rows in fields.items()}
        return cls(
            tokens=torch.tensor([tok for seq in inputs for tok in seq], dtype=torch.int32),
            starts=torch.tensor([0, *accumulate(lengths)][:-1], dtype=torch.int64),
            lengths=torch.tensor(lengths, dtype=torch.int64),
            labels=torch.tensor([t for seq in labels for t in seq], dtype=torch.int32),
            fields={k: field_tensor(values) for k, values in flat_fields.items()},
        )

    def __len__(self) -> int:
        return len(self.starts)


def pack_rows(lengths: list[int], seq_len: int, packing: bool) -> list[list[int]]:
    """Group piece indices into rows: greedily in order (packing) or one piece per row, by length."""
    if not packing:
        return [[i] for i in sorted(range(len(lengths)), key=lambda i: lengths[i])]
    rows, current, used = [], [], 0
    for i, n in enumerate(lengths):
        if current and used + n > seq_len:
            rows.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        rows.append(current)
    return rows


def batch_rows(row_lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    """Consecutive rows per micro-batch while ``rows × longest ≤ tokens_per_batch``."""
    batches, current, longest = [], [], 0
    for r, n in enumerate(row_lengths):
        new_longest = max(longest, n)
        if current and (len(current) + 1) * new_longest > tokens_per_batch:
            batches.append(current)
            current, new_longest = [], n
        current.append(r)
        longest = new_longest
    if current:
        batches.append(current)
    return batches


def collate_rows(pieces: Pieces, rows: list[list[int]], pad_id: int, ignore_index: int = -100) -> dict:
    """Build the padded micro-batch tensors (see the module docstring for the layout)."""
    widths = [int(pieces.lengths[row].sum()) for row in rows]
    B, T = len(rows), max(widths)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    labels = torch.full((B, T), ignore_index, dtype=torch.long)
    segment_ids = torch.zeros((B, T), dtype=torch.long)
    position_ids = torch.zeros((B, T), dtype=torch.long)
    fields = {key: torch.zeros((B, T, *v.shape[1:]), dtype=v.dtype) for key, v in pieces.fields.items()}
    for b, row in enumerate(rows):
        col = 0
        for seg, p in enumerate(row, start=1):
            start, n = int(pieces.starts[p]), int(pieces.lengths[p])
            toks = pieces.tokens[start : start + n].long()
            input_ids[b, col : col + n] = toks
            if pieces.labels is None:
                labels[b, col : col + n - 1] = toks[1:]
            else:
                labels[b, col : col + n] = pieces.labels[start : start + n]
            for key, values in pieces.fields.items():
                fields[key][b, col : col + n] = values[start : start + n]
            segment_ids[b, col : col + n] = seg
            position_ids[b, col : col + n] = torch.arange(n)
            col += n
    return {
        "input_ids": input_ids,
        "labels": labels,
        "segment_ids": segment_ids,
        "position_ids": position_ids,
        **fields,
    }


class MicroBatchDataset(torch.utils.data.Dataset):
    """Item ``i`` is the whole micro-batch ``i`` (use ``DataLoader(batch_size=None)``).

    Indexing micro-batches rather than rows keeps token budgets intact under Lightning's automatic
    ``DistributedSampler`` (which shards and shuffles the micro-batch indices) and ``num_workers > 0``.
    """

    def __init__(
        self, pieces: Pieces, seq_len: int, tokens_per_batch: int, packing: bool, pad_id: int
    ) -> None:
        self.pieces = pieces
        self.pad_id = pad_id
        self.rows = pack_rows(pieces.lengths.tolist(), seq_len=seq_len, packing=packing)
        row_lengths = [int(pieces.lengths[row].sum()) for row in self.rows]
        self.batches = batch_rows(row_lengths, tokens_per_batch)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return collate_rows(self.pieces, rows=[self.rows[r] for r in self.batches[index]], pad_id=self.pad_id)


class EpochShuffleSampler(torch.utils.data.DistributedSampler):
    """A permutation of ``range(length)`` that depends only on ``seed`` and the epoch, sharded over ranks.

    Unlike ``shuffle=True`` (seeded from the global RNG), the order of an epoch is the same in a
    resumed run as in an uninterrupted one. It is a ``DistributedSampler``: Lightning calls its
    ``set_epoch`` every epoch and, under DDP, keeps it instead of wrapping it (a wrapped sampler would
    never see ``set_epoch`` and repeat epoch 0's order). Rank ``r`` of ``num_replicas`` takes positions
    ``r, r + num_replicas, …`` of the permutation, padded as ``DistributedSampler`` pads (with its first
    indices) so that every rank gets ``ceil(length / num_replicas)`` indices.

    Args:
        length: number of items to permute.
        seed: seed of every epoch's permutation.
        num_replicas: number of data-parallel ranks.
        rank: this process's rank.

    Example:
        >>> sampler = EpochShuffleSampler(5, seed=1)
        >>> sorted(sampler), len(sampler)
        ([0, 1, 2, 3, 4], 5)
        >>> halves = [list(EpochShuffleSampler(5, seed=1, num_replicas=2, rank=r)) for r in (0, 1)]
        >>> [len(h) for h in halves], sorted(set(halves[0] + halves[1])) == sorted(sampler)
        ([3, 3], True)
    """

    def __init__(self, length: int, seed: int = 0, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(range(length), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.length = length

    def permutation(self) -> list[int]:
        """This epoch's order of all ``length`` items (before sharding)."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.length, generator=generator).tolist()

    def __iter__(self):
        # A generator: the order is drawn at the first ``next``, after Lightning's ``set_epoch``.
        order = self.permutation()
        while len(order) < self.total_size:
            order += order[: self.total_size - len(order)]
        yield from order[self.rank : self.total_size : self.num_replicas]
