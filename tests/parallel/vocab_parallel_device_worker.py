"""Worker of ``tests/heads/test_cuda_vocab_parallel.py``: the vocabulary-parallel head on a device, in fp32
and bf16, against the naive float64 head over the whole (rounded) weight, computed on the CPU.

``python -m tests.parallel.vocab_parallel_device_worker OUT DEVICE BACKEND`` under `tests.parallel.launch`:
2 ranks with ``gloo`` (with ``DEVICE=cuda`` both share the one GPU and gloo reduces the CUDA tensors
through host memory; NCCL refuses two ranks on one device), or 1 rank with ``nccl`` (the collectives a
GPU job issues, over a group of one). Rank ``r`` holds rows ``EDGES[world][r]:EDGES[world][r+1]`` of ``W``
and of the bias (2 ranks: an uneven split) and saves `compare`'s result for each dtype to
``OUT/rank{r}.pt``. In one process, `compare` with ``VocabShard.full(V)`` checks the single-shard path (no
group, no communication).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lit_losses.heads import FusedLMHead, VocabParallelHead, VocabShard
from tests.parallel.launch import init_from_env

N, D, V, CHUNK, IGNORE = 256, 64, 4000, 96, -100
#: Rows per rank by world size (2 ranks: deliberately not torch.chunk's 2000 + 2000).
EDGES = {1: [0, V], 2: [0, 1537, V]}
BOUNDARY = EDGES[2][1]
ALL = ("logprobs", "lse", "entropy")
CASES = ("per_token", "weighted_ce", "uniform_ce", "pointwise")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def problem() -> dict[str, torch.Tensor]:
    """fp32 inputs on the CPU: ``[4, 64]`` targets (every 5th position ignored; the first and last ids of
    the vocabulary and of the shard boundary among them), random upstream gradients and token weights."""
    g = torch.Generator().manual_seed(0)
    targets = torch.randint(0, V, (4, N // 4), generator=g)
    targets.view(-1)[::5] = IGNORE
    targets[0, 1:5] = torch.tensor([0, BOUNDARY - 1, BOUNDARY, V - 1])
    return {
        "hidden": torch.randn(4, N // 4, D, generator=g),
        "weight": torch.randn(V, D, generator=g) * 0.2,
        "bias": torch.randn(V, generator=g) * 0.5,
        "targets": targets,
        "token_w": torch.rand(4, N // 4, generator=g),
        **{f"up_{k}": torch.randn(4, N // 4, generator=g) for k in ALL},
    }


def chunk_loss(s, e, lp, lse, ent):
    """A fused pointwise loss of all three values (position-dependent entropy coefficient)."""
    pos = torch.arange(s, e, device=lp.device, dtype=lp.dtype)
    return (-lp + 0.05 * lse**2 + 0.2 * ent * torch.cos(pos)).sum()


def losses(head, hidden, targets, p):
    """``(per-token outputs, {case: scalar loss})`` of ``head``; ``p`` holds the upstream gradients and
    token weights in the outputs' dtype, on the head's device."""
    out = head(hidden, targets, ALL)
    values = {k: getattr(out, k) for k in ALL}
    return values, {
        "per_token": sum((values[k] * p[f"up_{k}"]).sum() for k in ALL),
        "weighted_ce": head.weighted_ce(hidden, targets, p["token_w"]),
        "uniform_ce": head.weighted_ce(hidden, targets, 0.25),
        "pointwise": head.pointwise_loss(hidden, targets, chunk_loss, with_entropy=True),
    }


def max_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |got − ref| / max |ref|`` (``ref`` float64 on the CPU)."""
    return float((got.detach().double().cpu() - ref).abs().max() / ref.abs().max())


def reference(p: dict[str, torch.Tensor], dtype: torch.dtype):
    """The naive float64 head on the CPU over the whole weight, at the inputs rounded to ``dtype``:
    ``(values, losses, {case: (∂hidden, ∂W, ∂b)})``."""
    leaves = [p[k].to(dtype).double().requires_grad_() for k in ("hidden", "weight", "bias")]
    extras = {k: v.double() for k, v in p.items() if k.startswith("up_") or k == "token_w"}
    head = FusedLMHead(leaves[1], leaves[2], backend="naive")
    values, ref_losses = losses(head, leaves[0], p["targets"], extras)
    grads = {case: torch.autograd.grad(ref_losses[case], leaves, retain_graph=True) for case in CASES}
    return {k: v.detach() for k, v in values.items()}, ref_losses, grads


def compare(device: str, dtype: torch.dtype, shard: VocabShard) -> dict:
    """This rank's head on ``device`` with leaves in ``dtype`` against `reference`.

    Returns ``errors`` (``{value}`` and ``{case}/{loss|hidden|weight|bias}`` → `max_error`), ``dtypes``
    (name → dtype of each output and gradient), ``ignored_hidden_grad`` (the largest ``|∂/∂hidden|`` at an
    ignored position: exactly 0) and ``values`` (the per-token outputs, for the cross-rank check).
    """
    p = problem()
    ref_values, ref_losses, ref_grads = reference(p, dtype)
    rows = slice(shard.start, shard.stop)
    h = p["hidden"].to(device, dtype).requires_grad_()
    w = p["weight"][rows].to(device, dtype).requires_grad_()
    b = p["bias"][rows].to(device, dtype).requires_grad_()
    extras = {k: v.to(device) for k, v in p.items() if k.startswith("up_") or k == "token_w"}
    targets = p["targets"].to(device)
    head = VocabParallelHead(w, b, shard=shard, chunk_size=CHUNK)
    values, got = losses(head, h, targets, extras)
    result = {"errors": {}, "dtypes": {}, "ignored_hidden_grad": 0.0, "values": {}}
    for k in ALL:
        result["errors"][k] = max_error(values[k], ref_values[k])
        result["dtypes"][k] = values[k].dtype
        result["values"][k] = values[k].detach().cpu()
    ignored = targets == IGNORE
    for case in CASES:
        grads = torch.autograd.grad(got[case], (h, w, b), retain_graph=True)
        ref_h, ref_w, ref_b = ref_grads[case]
        refs = {"hidden": ref_h, "weight": ref_w[rows], "bias": ref_b[rows]}
        result["errors"][f"{case}/loss"] = max_error(got[case], ref_losses[case].detach())
        result["dtypes"][f"{case}/loss"] = got[case].dtype
        for (name, ref), grad in zip(refs.items(), grads, strict=True):
            result["errors"][f"{case}/{name}"] = max_error(grad, ref)
            result["dtypes"][f"{case}/{name}"] = grad.dtype
        result["values"][f"{case}/hidden"] = grads[0].cpu()
        worst = float(grads[0][ignored].abs().max())
        result["ignored_hidden_grad"] = max(result["ignored_hidden_grad"], worst)
    return result


def run(out_dir: str, device: str, backend: str) -> None:
    if device == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU (nccl's object collectives use it)
    if backend == "gloo":
        rank, world = init_from_env()
    else:
        dist.init_process_group(backend)
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_float32_matmul_precision("highest")  # fp32 matmuls in fp32 (no TF32) on CUDA
    edges = EDGES[world]
    shard = VocabShard(edges[rank], edges[rank + 1], V, dist.group.WORLD)
    results = {name: compare(device, dtype, shard) for name, dtype in DTYPES.items()}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    run(*sys.argv[1:4])
