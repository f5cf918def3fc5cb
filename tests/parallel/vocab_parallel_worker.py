"""Worker of ``tests/heads/test_vocab_parallel.py``: every rank runs the vocabulary-parallel head on its rows
and compares it with the unsharded naive float64 head over the whole weight (computed here, on every rank).

``python -m tests.parallel.vocab_parallel_worker OUT`` under `tests.parallel.launch`. Rank ``r`` saves to
``OUT/rank{r}.pt``: ``errors`` (case → max relative error against the reference), ``values`` (case → the
outputs, for the cross-rank equality check), ``collectives`` (case → ``[(phase, op, numel)]`` of every
collective the head issued) and ``refusals`` (the error messages of bad inputs).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

from lit_losses.heads import VocabParallelHead, VocabShard, head_for
from tests.parallel.launch import init_from_env

V, D, CHUNK, IGNORE = 101, 8, 5, -100
ALL = ("logprobs", "lse", "entropy")
#: Explicit layouts (rows per rank, in rank order): deliberately not torch.chunk's.
EXPLICIT_EDGES = {2: [0, 64, 101], 3: [0, 17, 60, 101]}


def problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 7, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64) * 0.3
    targets = torch.randint(0, V, (3, 7), generator=g)
    targets.view(-1)[::4] = IGNORE
    targets[0, 1], targets[1, 2] = 0, V - 1  # first and last rows of the vocabulary
    upstream = {k: torch.randn(3, 7, generator=g, dtype=torch.float64) for k in ALL}
    token_w = torch.rand(3, 7, generator=g, dtype=torch.float64)
    return hidden, weight, bias, targets, upstream, token_w


def reference(hidden, weight, bias, targets):
    """Naive float64 ``logprobs``, ``lse``, ``entropy`` from materialized logits (0 at ignored positions)."""
    logits = F.linear(hidden, weight, bias)
    logp = F.log_softmax(logits, -1)
    valid = targets != IGNORE
    values = {
        "logprobs": logp.gather(-1, targets.clamp_min(0)[..., None])[..., 0],
        "lse": torch.logsumexp(logits, -1),
        "entropy": -(logp.exp() * logp).sum(-1),
    }
    return {k: torch.where(valid, v, 0.0) for k, v in values.items()}


def chunk_loss(s, e, lp, lse, ent):
    return (2 * lp + 0.1 * lse**2 + 0.3 * ent * torch.arange(s, e, dtype=lp.dtype)).sum()


def losses(call, targets, upstream, token_w):
    """``(outputs, {case: scalar loss})`` of one head, ``call(method, *args)`` calling it on the hidden
    states: per-token outputs under random upstream weights, the plain-CE fast path (per-token and
    uniform weights) and a fused pointwise loss with the entropy."""
    out = call("__call__", targets, ALL)
    return {k: getattr(out, k) for k in ALL}, {
        "per_token": sum((getattr(out, k) * upstream[k]).sum() for k in ALL),
        "weighted_ce": call("weighted_ce", targets, token_w) * 1.3,
        "uniform_ce": call("weighted_ce", targets, 0.25),
        "pointwise": call("pointwise_loss", targets, chunk_loss, True),
    }


class Recorder:
    """Records every collective issued through ``torch.distributed`` (op, numel) under a phase label."""

    OPS = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "reduce_scatter_tensor")

    def __init__(self) -> None:
        self.phase, self.calls = None, []
        self.originals = {name: getattr(dist, name) for name in self.OPS}
        for name, fn in self.originals.items():
            setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def wrapped(tensor, *args, **kwargs):
            if self.phase is not None:
                numel = tensor.numel() if isinstance(tensor, torch.Tensor) else -1
                self.calls.append((self.phase, name, numel))
            return fn(tensor, *args, **kwargs)

        return wrapped


def reference_losses(with_bias: bool):
    """``(values, {case: loss}, {case: gradients})`` of the naive float64 head over the whole weight."""
    hidden, weight, bias, targets, upstream, token_w = problem()
    leaves = [hidden.requires_grad_(), weight.requires_grad_(), bias.requires_grad_() if with_bias else None]
    ref = reference(*leaves, targets)
    valid = targets != IGNORE
    ref_losses = {
        "per_token": sum((ref[k] * upstream[k]).sum() for k in ALL),
        "weighted_ce": -(token_w * ref["logprobs"]).sum() * 1.3,
        "uniform_ce": -(0.25 * ref["logprobs"]).sum(),
        "pointwise": chunk_loss(
            0, int(valid.sum()), ref["logprobs"][valid], ref["lse"][valid], ref["entropy"][valid]
        ),
    }
    present = [x for x in leaves if x is not None]
    grads = {k: torch.autograd.grad(v, present, retain_graph=True) for k, v in ref_losses.items()}
    return {k: v.detach() for k, v in ref.items()}, ref_losses, grads


def run(out_dir: str) -> None:
    rank, world = init_from_env()
    torch.exp(torch.ones(8, dtype=torch.float64))  # settle the first vectorized op (see tests/conftest.py)
    recorder = Recorder()
    hidden0, weight0, bias0, targets, upstream, token_w = problem()
    valid = targets != IGNORE
    references = {with_bias: reference_losses(with_bias) for with_bias in (True, False)}

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    group = mesh.get_group(0)
    edges = EXPLICIT_EDGES[world]
    layouts = {
        "dtensor": None,
        "dtensor_no_bias": None,
        "explicit": VocabShard(edges[rank], edges[rank + 1], V, group),
    }
    result = {"errors": {}, "values": {}, "collectives": {}, "refusals": {}}
    for layout, shard in layouts.items():
        with_bias = layout != "dtensor_no_bias"
        if shard is None:  # DTensor leaves placed Shard(0), as ColwiseParallel leaves an lm_head
            w = distribute_tensor(weight0.clone(), mesh, [Shard(0)]).requires_grad_()
            b = distribute_tensor(bias0.clone(), mesh, [Shard(0)]).requires_grad_() if with_bias else None
            head = VocabParallelHead(w, b, chunk_size=CHUNK)
            rows = head.shard
        else:
            w = weight0[shard.start : shard.stop].clone().requires_grad_()
            b = bias0[shard.start : shard.stop].clone().requires_grad_()
            head = VocabParallelHead(w, b, shard=shard, chunk_size=CHUNK)
            rows = shard
        h = hidden0.clone().requires_grad_()
        leaves = [x for x in (h, w, b) if x is not None]

        def call(method, *args, head=head, h=h, layout=layout):
            recorder.phase = f"{layout}/{method}/forward"
            return getattr(head, method)(h, *args)

        values, got = losses(call, targets, upstream, token_w)
        result["values"][layout] = {k: v.detach() for k, v in values.items()}
        ref, ref_losses, ref_grads = references[with_bias]
        for case in ("per_token", "weighted_ce", "uniform_ce", "pointwise"):
            recorder.phase = f"{layout}/{case}/backward"
            grads = torch.autograd.grad(got[case], leaves, retain_graph=True)
            recorder.phase = None
            local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
            refs = [ref_grads[case][0], ref_grads[case][1][rows.start : rows.stop]]
            if with_bias:
                refs.append(ref_grads[case][2][rows.start : rows.stop])
            errors = [float((got[case] - ref_losses[case]).abs() / ref_losses[case].abs())]
            errors += [float((g - r).abs().max() / r.abs().max()) for g, r in zip(local, refs, strict=True)]
            result["errors"][f"{layout}/{case}"] = max(errors)
        with torch.no_grad():  # inference: the gathered full logits
            logits = head.forward_logits(hidden0)
        full = F.linear(hidden0, weight0, bias0 if with_bias else None)
        result["errors"][f"{layout}/forward_logits"] = float((logits - full).abs().max() / full.abs().max())
        for k in ALL:
            err = (values[k].detach() - ref[k]).abs().max() / ref[k].abs().max()
            result["errors"][f"{layout}/{k}"] = float(err)
    result["collectives"] = recorder.calls
    result["n_valid"] = int(valid.sum())

    # refusals: a sharded weight with a backend that would need all of it; shards that overlap; ranks
    # that disagree on one target (same count)
    dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))  # FSDP's, not a TP group
    disagreeing = targets.clone()
    disagreeing[1, 3] = (disagreeing[1, 3] + rank) % V
    w = distribute_tensor(weight0.clone(), mesh, [Shard(0)])
    for name, make in {
        "backend": lambda: head_for(w, None, backend="naive"),
        "overlap": lambda: VocabParallelHead(weight0[:60], shard=VocabShard(0, 60, V, group)),
        "targets": lambda: VocabParallelHead(w)(hidden0, disagreeing),
        "fsdp_shard": lambda: VocabParallelHead(distribute_tensor(weight0.clone(), dp_mesh, [Shard(0)])),
    }.items():
        try:
            make()
            result["refusals"][name] = None
        except (ValueError, RuntimeError) as err:
            result["refusals"][name] = str(err)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    run(sys.argv[1])
