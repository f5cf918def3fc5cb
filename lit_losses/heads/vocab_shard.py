"""`VocabShard`: which rows of a ``[V, D]`` output projection a rank holds, and with which group.

A vocabulary-parallel head (`lit_losses.heads.vocab_parallel`) reads it from a DTensor placed ``Shard(0)``
(torch.chunk's layout) or takes it explicitly (any contiguous rows per rank, in rank order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import Tensor

#: Names of device-mesh dimensions over which FSDP shards parameters (Lightning's ``ModelParallelStrategy``
#: and common torchtitan-style meshes): a ``Shard(0)`` weight on them is not a vocabulary shard.
DATA_PARALLEL_DIMS = ("data_parallel", "dp", "dp_shard", "fsdp")


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows ``[start, stop)`` of a ``[vocab_size, D]`` output projection, and the group whose
    ranks hold the other rows (``None``: the whole vocabulary on one rank, no communication).

    The shards of the group must tile ``[0, vocab_size)`` exactly once (checked by `check_tiling`).

    Example:
        >>> from lit_losses.heads.vocab_shard import VocabShard
        >>> VocabShard.chunked(101, rank=2, size=3)  # torch.chunk's layout, as DTensor's Shard(0)
        VocabShard(start=68, stop=101, vocab_size=101, group=None)
        >>> VocabShard.full(50).size
        50
    """

    start: int
    stop: int
    vocab_size: int
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop <= self.vocab_size:
            raise ValueError(
                f"vocabulary shard [{self.start}, {self.stop}) does not lie in [0, {self.vocab_size})"
            )

    @property
    def size(self) -> int:
        """Rows of this shard."""
        return self.stop - self.start

    @classmethod
    def full(cls, vocab_size: int) -> VocabShard:
        """The whole vocabulary on one rank."""
        return cls(0, vocab_size, vocab_size)

    @classmethod
    def chunked(cls, vocab_size: int, rank: int, size: int, group: Any = None) -> VocabShard:
        """Shard ``rank`` of ``size`` in `torch.chunk`'s layout (``ceil(V / size)`` rows each, the last ones
        shorter or empty), the layout of a DTensor with ``Shard(0)``."""
        rows = -(-vocab_size // size)
        start = min(rank * rows, vocab_size)
        return cls(start, min(start + rows, vocab_size), vocab_size, group)

    @classmethod
    def of_dtensor(cls, weight: Any) -> VocabShard:
        """The shard of a DTensor weight placed ``Shard(0)`` on one mesh dimension (``Replicate`` on the
        others), e.g. the weight of an ``lm_head`` under ``ColwiseParallel``.

        Raises:
            ValueError: another placement, or a local shard that is not torch.chunk's.
        """
        from torch.distributed.tensor import Replicate, Shard

        placements = tuple(weight.placements)
        sharded = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 0]
        others_ok = all(isinstance(p, Replicate) for i, p in enumerate(placements) if i not in sharded)
        if len(sharded) != 1 or not others_ok:
            raise ValueError(
                f"a vocabulary-parallel head needs the output weight sharded along the vocabulary (dim 0) on "
                f"one mesh dimension and replicated on the others; got placements {placements}"
            )
        mesh, dim = weight.device_mesh, sharded[0]
        name = (mesh.mesh_dim_names or [None] * len(placements))[dim]
        if name in DATA_PARALLEL_DIMS:
            raise ValueError(
                f"the output weight is sharded over the mesh dimension {name!r}: FSDP's shard, not the "
                "vocabulary of a tensor-parallel group; call the head inside a forward that FSDP manages "
                "(RegularizedLM: compute_loss, predict_step, forward_logits; or register_fsdp_forward_method)"
            )
        shard = cls.chunked(
            weight.shape[0], mesh.get_local_rank(dim), mesh.size(dim), group=mesh.get_group(dim)
        )
        if weight.to_local().shape[0] != shard.size:
            raise ValueError(
                f"the local shard of the output weight has {weight.to_local().shape[0]} rows; torch.chunk's "
                f"layout of V={weight.shape[0]} over {mesh.size(dim)} ranks gives {shard.size}"
            )
        return shard

    def check_tiling(self) -> None:
        """Raise unless the shards of the group's ranks tile ``[0, vocab_size)`` in rank order (one
        ``all_gather_object``; explicit shards are checked once, when `VocabParallelHead` first uses them).

        Raises:
            ValueError: gaps, overlaps or a different ``vocab_size`` on some rank (the message lists them).
        """
        if self.group is None:
            if (self.start, self.stop) != (0, self.vocab_size):
                raise ValueError(f"{self} has no group but does not cover the whole vocabulary")
            return
        shards: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(shards, (self.start, self.stop, self.vocab_size), group=self.group)
        edges = [0] + [stop for _, stop, _ in shards]
        if (
            any(s != edges[i] for i, (s, _, _) in enumerate(shards))
            or edges[-1] != self.vocab_size
            or any(v != self.vocab_size for *_, v in shards)
        ):
            raise ValueError(
                f"the vocabulary shards (start, stop, vocab_size) of the group's ranks {shards} do not tile "
                f"[0, {self.vocab_size}) in rank order"
            )


def is_vocab_sharded(weight: Tensor) -> bool:
    """Whether ``weight`` is a DTensor sharded along dim 0 (the vocabulary) on some mesh dimension."""
    from torch.distributed.tensor import DTensor, Shard

    return isinstance(weight, DTensor) and any(isinstance(p, Shard) and p.dim == 0 for p in weight.placements)
