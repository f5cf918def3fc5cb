"""Worker of ``tests/heads/test_token_statistics.py``: every rank computes `token_stats` with a
vocabulary-parallel head over its rows (a DTensor ``Shard(0)`` weight with bias, and explicit layouts, one
of them leaving rank 0 without rows; the maximum tied across the ranks' rows at some positions) and
compares each statistic with the full float64 logits' value.

``python -m tests.parallel.token_statistics_worker OUT`` under `tests.parallel.launch` (2 ranks). Rank ``r``
saves ``OUT/rank{r}.pt``: ``errors`` (layout → statistic → max absolute error; top-1 mismatches and hits)
and ``values`` (layout → statistic → values, for the cross-rank equality check).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lit_losses.heads import token_stats
from tests.heads.test_token_statistics import naive
from tests.parallel.collision_worker import IGNORE, TEMPERATURE, D, V, vocab_parallel_heads
from tests.parallel.launch import init_from_env

ALL = ("entropy", "log_sum_sq_probs", "mean_logit", "is_top1")


def problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, D, generator=g, dtype=torch.float64)
    weight = 2 * torch.randn(V, D, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    weight[45], bias[45] = weight[7], bias[7]  # rows 7 (rank 0's) and 45 (rank 1's) tie everywhere
    hidden[0, 0] = weight[7] / weight[7].norm() * 20  # ... and are the maximum at two positions
    hidden[1, 1] = hidden[0, 0]
    targets = torch.randint(0, V, (3, 5), generator=g)
    top = (hidden @ weight.T + bias).argmax(-1)
    targets.view(-1)[1::2] = top.view(-1)[1::2]
    targets.view(-1)[::5] = IGNORE
    targets[0, 0], targets[1, 1] = 7, 45  # the first index of the tie is the top-1, the other not
    return hidden, weight, bias, targets


def run(out_dir: str) -> None:
    rank, world = init_from_env()
    hidden, weight, bias, targets = problem()
    heads = vocab_parallel_heads(weight, bias, rank=rank, world=world)
    reference = naive(hidden, weight, bias, targets, TEMPERATURE)  # the full logits; IGNORE is -100
    result: dict = {"errors": {}, "values": {}}
    for layout, head in heads.items():
        stats = token_stats(head, hidden, targets, ALL)
        alone = token_stats(head, hidden, targets, ["mean_logit"]).mean_logit
        values = {name: getattr(stats, name) for name in ALL} | {"mean_logit_alone": alone}
        errors = {
            name: float((values[name] - reference[name.removesuffix("_alone")]).abs().max())
            for name in ("entropy", "log_sum_sq_probs", "mean_logit", "mean_logit_alone")
        }
        errors["top1_mismatches"] = int((stats.is_top1 != reference["is_top1"]).sum())
        errors["top1_hits"] = int(stats.is_top1.sum())
        result["errors"][layout], result["values"][layout] = errors, values
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    run(sys.argv[1])
