"""Worker of ``tests/heads/test_collision.py``: every rank computes `log_sum_sq_probs` with a
vocabulary-parallel head over its rows (a DTensor ``Shard(0)`` weight with bias, and explicit layouts, one
of them leaving rank 0 without rows) and compares it with ``lse(2z) − 2 lse(z)`` of the full float64 logits.

``python -m tests.parallel.collision_worker OUT`` under `tests.parallel.launch` (2 ranks). Rank ``r`` saves
``OUT/rank{r}.pt``: ``errors`` (layout → max absolute error), ``values`` (layout → the values, for the
cross-rank equality check) and ``collectives`` (layout → ``[(op, numel)]`` of the all-reduces issued).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

from lit_losses.heads import VocabParallelHead, VocabShard, log_sum_sq_probs
from tests.parallel.launch import init_from_env

V, D, CHUNK, IGNORE, TEMPERATURE = 53, 6, 4, -100, 0.8
#: Explicit layouts (rows per rank): uneven, and one where rank 0 holds no row.
EXPLICIT_EDGES = {"explicit": [0, 40, V], "explicit_empty": [0, 0, V]}


def problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, D, generator=g, dtype=torch.float64)
    weight = 2 * torch.randn(V, D, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (3, 5), generator=g)
    targets.view(-1)[::3] = IGNORE
    return hidden, weight, bias, targets


def expected(hidden, weight, bias, targets) -> torch.Tensor:
    z = (hidden @ weight.T + bias) / TEMPERATURE
    values = torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1)
    return torch.where(targets != IGNORE, values, 0.0)


def vocab_parallel_heads(weight: torch.Tensor, bias: torch.Tensor, rank: int, world: int) -> dict:
    """Layout name → this rank's `VocabParallelHead` over ``weight`` and ``bias``: a DTensor ``Shard(0)``
    and the `EXPLICIT_EDGES` layouts."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    heads = {
        "dtensor": VocabParallelHead(
            distribute_tensor(weight.clone(), mesh, [Shard(0)]),
            distribute_tensor(bias.clone(), mesh, [Shard(0)]),
            chunk_size=CHUNK,
            temperature=TEMPERATURE,
        )
    }
    for layout, edges in EXPLICIT_EDGES.items():
        shard = VocabShard(edges[rank], edges[rank + 1], V, mesh.get_group(0))
        rows = slice(shard.start, shard.stop)
        heads[layout] = VocabParallelHead(
            weight[rows], bias[rows], shard=shard, chunk_size=CHUNK, temperature=TEMPERATURE
        )
    return heads


def run(out_dir: str) -> None:
    rank, world = init_from_env()
    hidden, weight, bias, targets = problem()
    heads = vocab_parallel_heads(weight, bias, rank=rank, world=world)
    reference = expected(hidden, weight, bias, targets)
    result: dict = {"errors": {}, "values": {}, "collectives": {}}
    original = dist.all_reduce
    for layout, head in heads.items():
        calls: list = []

        def recorded(tensor, *args, calls=calls, **kwargs):
            calls.append(("all_reduce", tensor.numel()))
            return original(tensor, *args, **kwargs)

        dist.all_reduce = recorded
        try:
            values = log_sum_sq_probs(head, hidden, targets)
        finally:
            dist.all_reduce = original
        result["values"][layout] = values
        result["errors"][layout] = float((values - reference).abs().max())
        result["collectives"][layout] = calls
    result["n_valid"] = int((targets != IGNORE).sum())
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    run(sys.argv[1])
