"""Forward+backward time and peak memory of the output-head variants, in one run.

Variants (per-token = a random upstream gradient on every requested output):
  naive                 logits materialized, autograd (the reference), per-token logprobs
  naive_entropy         the same, per-token logprobs + entropy
  torch_chunked         torch.nn.functional.linear_cross_entropy(reduction="none", options=chunked)
  chunked               lit_losses chunked backend, per-token logprobs
  chunked_entropy       the same, logprobs + entropy
  chunked_ce            lit_losses plain-CE fast path (weighted_ce: gradients in forward)
  blocked               lit_losses blocked backend (vocabulary blocks, no V x D temporary), logprobs
  blocked_entropy       the same, logprobs + entropy
  blocked_ce            the blocked backend's plain CE (weighted_ce: 4 matmuls, the weight's gradient
                        written once)
  blocked_ce_low_logits the same with matmul_precision="low_logits" (bf16 logits, as HF's and Liger's)
  matmul3               the bare 3 matmuls of any exact head: logits, grad of hidden, grad of weight
  liger_ce              backend liger: Liger-Kernel's fused linear cross-entropy, plain CE (CUDA)
  liger_native          Liger-Kernel's LigerFusedLinearCrossEntropyLoss called directly (the peer, CUDA)
  liger_scaled_entropy  backend liger_scaled: Liger's fused linear scaled CE, logprobs + entropy (CUDA)
  cce                   backend cce: cut-cross-entropy, per-token logprobs (CUDA)
  cce_ce                backend cce, plain CE (CUDA)
  cce_native            cut_cross_entropy.linear_cross_entropy called directly, mean CE (the peer, CUDA)

Each (variant, shape) runs in a fresh subprocess so that its peak RSS is its own; peak memory is the
process high-water mark minus the resident size once inputs are allocated. Time is the best of
``--repeats`` after one warm-up, as wall-clock seconds and as the process's CPU seconds (all its threads):
on a shared machine the CPU time is what the step itself costs, the wall time also what other processes
took from it (compare CPU times at ``--threads 1``, where no thread waits for a descheduled other).

    python benchmarks/fused_head.py                      # CPU fp32, the shapes of the issue
    python benchmarks/fused_head.py --shapes 512x256x32000 --repeats 2
    python benchmarks/fused_head.py --shapes 2048x512x128256 --threads 1 --variants matmul3 chunked blocked
    python benchmarks/fused_head.py --device cuda --dtype bfloat16 --shapes 8192x4096x128256   # all
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

import torch


def _naive(hidden, weight, targets, upstream, chunk, entropy=False):
    logits = (hidden @ weight.T).float()
    log_p = torch.log_softmax(logits, -1)
    lp = log_p.gather(1, targets[:, None]).squeeze(1)
    if not entropy:
        lp.backward(upstream)
        return
    ent = -(log_p.exp() * log_p).sum(-1)
    torch.autograd.backward((lp, ent), (upstream, upstream))


def _torch_chunked(hidden, weight, targets, upstream, chunk):
    ce = torch.nn.functional.linear_cross_entropy(
        hidden, weight, targets, reduction="none", options=torch.nn.LinearCrossEntropyOptions()
    )
    (-ce).backward(upstream.to(ce.dtype))


def _ours_per_token(backend, outputs):
    def run(hidden, weight, targets, upstream, chunk):
        from lit_losses.heads import FusedLMHead

        head = FusedLMHead(weight, backend=backend, chunk_size=chunk, check_finite=False)
        out = head(hidden, targets, outputs)
        values = [getattr(out, name) for name in outputs]
        torch.autograd.backward(values, [upstream] * len(values))

    return run


def _ours_ce(backend, matmul_precision="auto"):
    def run(hidden, weight, targets, upstream, chunk):
        from lit_losses.heads import FusedLMHead

        head = FusedLMHead(
            weight, backend=backend, chunk_size=chunk, check_finite=False, matmul_precision=matmul_precision
        )
        head.weighted_ce(hidden, targets, 1.0 / hidden.shape[0]).backward()

    return run


def _liger_native(hidden, weight, targets, upstream, chunk):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    LigerFusedLinearCrossEntropyLoss()(weight, hidden, targets).backward()


def _cce_native(hidden, weight, targets, upstream, chunk):
    from cut_cross_entropy import linear_cross_entropy

    linear_cross_entropy(hidden, weight, targets, reduction="mean").backward()


def _matmul3(hidden, weight, targets, upstream, chunk):
    with torch.no_grad():
        logits = hidden @ weight.T
        _ = logits @ weight
        _ = logits.T @ hidden


LP, LP_ENT = ("logprobs",), ("logprobs", "entropy")

#: name -> one forward and backward (``matmul3``: the three matmuls alone, no gradient).
RUNS = {
    "naive": _naive,
    "naive_entropy": lambda *args: _naive(*args, entropy=True),
    "torch_chunked": _torch_chunked,
    "chunked": _ours_per_token("chunked", LP),
    "chunked_entropy": _ours_per_token("chunked", LP_ENT),
    "chunked_ce": _ours_ce("chunked"),
    "blocked": _ours_per_token("blocked", LP),
    "blocked_entropy": _ours_per_token("blocked", LP_ENT),
    "blocked_ce": _ours_ce("blocked"),
    "blocked_ce_low_logits": _ours_ce("blocked", matmul_precision="low_logits"),
    "matmul3": _matmul3,
    "liger_ce": _ours_ce("liger"),
    "liger_native": _liger_native,
    "liger_scaled_entropy": _ours_per_token("liger_scaled", LP_ENT),
    "cce": _ours_per_token("cce", LP),
    "cce_ce": _ours_ce("cce"),
    "cce_native": _cce_native,
}
VARIANTS = tuple(RUNS)
#: The variants that need CUDA (the peers' kernels).
CUDA_ONLY = ("liger_ce", "liger_native", "liger_scaled_entropy", "cce", "cce_ce", "cce_native")
CPU_VARIANTS = tuple(v for v in VARIANTS if v not in CUDA_ONLY)
DEFAULT_SHAPES = ("2048x512x128256", "4096x1024x65536")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_variant(variant: str, hidden, weight, targets, upstream, chunk: int | None) -> None:
    """One forward and backward of ``variant``."""
    RUNS[variant](hidden, weight, targets, upstream, chunk)


def run_one(
    variant: str, n: int, d: int, v: int, repeats: int, dtype_name: str, device: str, chunk: int | None = None
) -> dict:
    dtype = getattr(torch, dtype_name)
    g = torch.Generator(device).manual_seed(0)  # drawn where they live: a 128256 x 4096 draw on one CPU
    # thread would take seconds per variant
    hidden = (torch.randn(n, d, generator=g, device=device) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g, device=device) * 0.02).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g, device=device)
    upstream = torch.randn(n, generator=g, device=device)

    def step() -> None:
        hidden.grad = weight.grad = None
        run_variant(variant, hidden=hidden, weight=weight, targets=targets, upstream=upstream, chunk=chunk)
        if device == "cuda":
            torch.cuda.synchronize()

    base_rss = rss_bytes()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
    step()  # warm-up; also the memory measurement
    peak = (
        torch.cuda.max_memory_allocated() - base_cuda
        if device == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    )
    times, cpu_times = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    return {
        "variant": variant,
        "shape": f"{n}x{d}x{v}",
        "time_s": min(times),
        "cpu_s": min(cpu_times),
        "peak_mb": peak / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="N x D x V")
    parser.add_argument("--variants", nargs="+", default=None, choices=VARIANTS, help="default: all on CUDA")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--chunk-size", type=int, default=None, help="head chunk size (default: the head's)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant in this process
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.variants is None:
        args.variants = list(VARIANTS if args.device == "cuda" else CPU_VARIANTS)
    if args.one:
        variant, shape = args.one.split(":")
        n, d, v = (int(x) for x in shape.split("x"))
        print(json.dumps(run_one(variant, n, d, v, args.repeats, args.dtype, args.device, args.chunk_size)))
        return

    print(
        f"# {time.strftime('%Y-%m-%d')} | {platform.processor() or platform.machine()} | "
        f"{os.cpu_count()} CPUs | torch {torch.__version__} threads={torch.get_num_threads()} | "
        f"{args.dtype} on {args.device}"
    )
    print(f"# command: python {' '.join(sys.argv)}")
    for shape in args.shapes:
        rows = {}
        for variant in args.variants:
            cmd = [
                sys.executable,
                __file__,
                "--one",
                f"{variant}:{shape}",
                "--repeats",
                str(args.repeats),
                "--dtype",
                args.dtype,
                "--device",
                args.device,
                *(["--chunk-size", str(args.chunk_size)] if args.chunk_size else []),
                *(["--threads", str(args.threads)] if args.threads else []),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{variant} {shape} failed: {out.stderr[-500:]}", file=sys.stderr)
                continue
            for line in out.stderr.splitlines():  # e.g. compiled kernels that could not be built
                if "lit_losses:" in line:
                    print(f"{variant} {shape}: {line.strip()}", file=sys.stderr)
            rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        naive = rows.get("naive")
        print(
            f"\n| {shape} | time (s) | peak MiB | time / naive | mem / naive | time / matmul3 | CPU (s) "
            "| CPU / matmul3 |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for variant, r in rows.items():
            t_ratio = r["time_s"] / naive["time_s"] if naive else float("nan")
            m_ratio = r["peak_mb"] / naive["peak_mb"] if naive else float("nan")
            mm = rows.get("matmul3")
            mm_ratio = r["time_s"] / mm["time_s"] if mm else float("nan")
            cpu_ratio = r["cpu_s"] / mm["cpu_s"] if mm else float("nan")
            print(
                f"| {variant} | {r['time_s']:.3f} | {r['peak_mb']:.0f} | {t_ratio:.2f} | {m_ratio:.2f} "
                f"| {mm_ratio:.2f} | {r['cpu_s']:.3f} | {cpu_ratio:.2f} |"
            )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
