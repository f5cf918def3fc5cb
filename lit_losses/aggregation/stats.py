"""Counts of valid units that the aggregation modes divide by."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


def sequence_ids(mask: Tensor, segment_ids: Tensor | None = None) -> Tensor:
    """A dense id per position of its sequence: a (row, segment) pair in packed rows, else the row.

    Returns a ``long`` tensor shaped like ``mask`` with ids in ``[0, number of sequences)``.
    """
    rows = torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)
    if segment_ids is None:
        return rows.long()
    if segment_ids.shape != mask.shape:
        raise ValueError(
            f"segment_ids shape {tuple(segment_ids.shape)} differs from the mask shape {tuple(mask.shape)}"
        )
    seg = segment_ids.long() - segment_ids.min()
    key = rows.long() * (int(seg.max()) + 1) + seg
    return torch.unique(key, return_inverse=True)[1]


def count_units(mask: Tensor, segment_ids: Tensor | None = None) -> tuple[int, int]:
    """``(valid tokens, sequences with at least one valid token)`` of one micro-batch."""
    mask = mask.bool()
    ids = sequence_ids(mask, segment_ids)
    per_seq = torch.bincount(ids[mask], minlength=1)
    return int(mask.sum()), int((per_seq > 0).sum())


@dataclass
class MaskStats:
    """Global counts of one mask key over the whole optimizer step (all micro-batches, all ranks)."""

    num_tokens: int = 0
    """Valid tokens."""
    num_sequences: int = 0
    """Sequences with at least one valid token."""


@dataclass
class GlobalStats:
    """What every micro-batch of an optimizer step needs to normalize by global counts.

    ``loss_scale = accumulate_grad_batches × world_size`` cancels Lightning's ``÷A`` and DDP's ``÷D``,
    so that summing the micro-batch losses the way they do gives the global-batch loss.
    """

    masks: dict[str, MaskStats] = field(default_factory=dict)
    """Counts per mask key (``"labels"``: ``labels != ignore_index``)."""
    loss_scale: float = 1.0
    """Factor applied to the micro-batch loss before Lightning and DDP average it."""

    def get(self, key: str) -> MaskStats:
        if key not in self.masks:
            raise KeyError(f"no global statistics for mask key {key!r}; known keys: {sorted(self.masks)}")
        return self.masks[key]
