"""Scaling out on 2 CPU processes (gloo): what the vocabulary-parallel head communicates, and FSDP2 vs DDP.

``head``: a tensor-parallel group of 2 ranks, each holding half of a ``V × D`` output projection
(V = 128256, D = 512), 512 valid tokens, float32, the plain cross-entropy forward + backward:

- ``vocab_parallel``: `VocabParallelHead.weighted_ce` (per chunk: all-reduce MAX and SUM of O(chunk)
  statistics; once: the all-reduce of ``∂/∂hidden``);
- ``gather_logits``: what one does without it: local logits, ``all_gather`` into full ``[N, V]`` logits,
  ``cross_entropy`` on them, each rank back-propagating its own slice (plus the same ``∂/∂hidden``
  all-reduce).

Every collective is counted (its payload: the elements of the tensor a rank hands to it), per token, and
each variant is timed (median of ``--repeats``, after one warm-up).

``fsdp``: the tiny LM of ``configs/tiny_lm.yaml`` (d_model 192, 3 layers, vocab 4096) on synthetic
16 × 256-token micro-batches, Lightning ``strategy="ddp"`` vs ``ModelParallelStrategy(data_parallel_size=2)``
(FSDP2, blocks and root sharded) in the same 2 processes, alternated ``--rounds`` times: median time per
optimizer step (the first 3 steps of each fit excluded).

    python benchmarks/parallel_comm.py                 # both parts
    python benchmarks/parallel_comm.py --part head --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]


# ---- the head -----------------------------------------------------------------------------------
class Counter:
    """Wraps ``dist.all_reduce`` / ``dist.all_gather`` and records the elements handed to each call."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        for name in ("all_reduce", "all_gather"):
            setattr(dist, name, self._wrap(getattr(dist, name)))

    def _wrap(self, fn):
        def wrapped(tensor, *args, **kwargs):
            self.calls.append((args[0] if isinstance(tensor, list) else tensor).numel())
            return fn(tensor, *args, **kwargs)

        return wrapped


def gather_logits_ce(hidden, w_local, targets, rank, world):
    """Plain CE from all-gathered logits; every rank computes the same loss, and back-propagates its slice."""
    z_local = hidden @ w_local.T
    parts = [torch.empty_like(z_local) for _ in range(world)]
    dist.all_gather(parts, z_local.detach().contiguous())
    full = torch.cat(parts, dim=1).requires_grad_()
    loss = F.cross_entropy(full, targets)
    loss.backward()
    rows = w_local.shape[0]
    z_local.backward(full.grad[:, rank * rows : (rank + 1) * rows])
    dist.all_reduce(hidden.grad)  # each rank's ∂/∂hidden is a partial sum over its rows
    return loss


def head_worker(args) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from lit_losses.heads import VocabParallelHead

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.d_model)
    weight = torch.randn(args.vocab, args.d_model) * 0.02
    targets = torch.randint(0, args.vocab, (args.tokens,))
    mesh = init_device_mesh("cpu", (world,))
    w_dtensor = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
    w_local = weight.chunk(world)[rank].clone().requires_grad_()
    counter = Counter()
    result = {}
    for name in ("vocab_parallel", "gather_logits"):
        times, calls = [], []
        for repeat in range(args.repeats + 1):
            h = hidden.clone().requires_grad_()
            dist.barrier()
            counter.calls = []
            start = time.perf_counter()
            if name == "vocab_parallel":
                VocabParallelHead(w_dtensor).weighted_ce(h, targets, 1.0 / args.tokens).backward()
            else:
                gather_logits_ce(h, w_local, targets, rank, world)
            if repeat:  # the first call warms up
                times.append(time.perf_counter() - start)
                calls = counter.calls
        hidden_grad = [n for n in calls if n == hidden.numel()]  # the same ∂/∂hidden all-reduce in both
        result[name] = {
            "ms": 1e3 * statistics.median(times),
            "collectives": len(calls),
            "head_elements_per_token": (sum(calls) - sum(hidden_grad)) / args.tokens,
            "hidden_grad_elements_per_token": sum(hidden_grad) / args.tokens,
        }
    return result


# ---- FSDP2 vs DDP -------------------------------------------------------------------------------
def fsdp_worker(args) -> dict:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lit_losses import GlobalStatsLoader, TinyLM

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.starts.append(time.perf_counter())

        def on_train_end(self, trainer, pl_module) -> None:
            self.starts.append(time.perf_counter())

    g = torch.Generator().manual_seed(0)

    def batch() -> dict:
        return {k: torch.randint(0, 4096, (16, 256), generator=g) for k in ("input_ids", "labels")}

    batches = [batch() for _ in range(2 * args.steps)]
    steps: dict[str, list[float]] = {"ddp": [], "fsdp2": []}
    for _ in range(args.rounds):  # alternate, so that a change of the machine's load hits both
        for name in steps:
            strategy = DDPStrategy() if name == "ddp" else ModelParallelStrategy(2, 1)
            L.seed_everything(0, verbose=False)
            model = TinyLM(vocab_size=4096, d_model=192, n_layers=3, n_heads=3)
            timer = StepTimer()
            trainer = L.Trainer(
                accelerator="cpu",
                devices=2,
                strategy=strategy,
                max_steps=args.steps,
                callbacks=[timer],
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
            )
            trainer.fit(model, GlobalStatsLoader(batches, batch_size=None))
            steps[name] += [b - a for a, b in zip(timer.starts[3:-1], timer.starts[4:], strict=True)]
    return {name: {"ms_per_step": 1e3 * statistics.median(t), "steps": len(t)} for name, t in steps.items()}


# ---- launching ----------------------------------------------------------------------------------
def launch(argv: list[str]) -> list[dict]:
    """Run this script as 2 ranks (torchrun-style environment); the ranks' printed results."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for rank in range(2):
        ranks = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "NODE_RANK": "0"}
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONWARNINGS="ignore", **ranks)
        cmd = [sys.executable, __file__, *argv, "--worker"]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed: {[p.returncode for p in procs]}")
    return [
        json.loads(line[7:]) for out in outputs for line in out.splitlines() if line.startswith("RESULT ")
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["head", "fsdp", "all"], default="all")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=2, help="fsdp: alternate ddp and fsdp2 this many times")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    parts = ["head", "fsdp"] if args.part == "all" else [args.part]
    if args.worker:
        if args.part != "fsdp":
            dist.init_process_group("gloo")
        result = {"head": head_worker, "fsdp": fsdp_worker}[args.part](args)
        print("RESULT " + json.dumps({"rank": int(os.environ["RANK"]), **result}), flush=True)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    for part in parts:
        argv = [a for a in sys.argv[1:] if a not in ("--part", args.part)] + ["--part", part]
        results = launch(argv)
        print(json.dumps({part: results}, indent=1))
        rank0 = next(r for r in results if r["rank"] == 0)
        if part == "head":
            vp, gl = rank0["vocab_parallel"], rank0["gather_logits"]
            head_vp, head_gl = vp["head_elements_per_token"], gl["head_elements_per_token"]
            print(
                f"fp32 bytes per token handed to collectives by the head: vocab_parallel {4 * head_vp:.1f}, "
                f"gather_logits {4 * head_gl:.0f} (ratio {head_gl / head_vp:.0f}); both also all-reduce "
                f"dL/dhidden: {4 * vp['hidden_grad_elements_per_token']:.0f} bytes per token"
            )
            print(f"time vocab_parallel / gather_logits {vp['ms'] / gl['ms']:.3f}")
        else:
            ddp, fsdp = rank0["ddp"]["ms_per_step"], rank0["fsdp2"]["ms_per_step"]
            print(f"ms per step: ddp {ddp:.1f}, fsdp2 {fsdp:.1f}; fsdp2 / ddp {fsdp / ddp:.3f}")


if __name__ == "__main__":
    main()
