"""The memory one forward + backward of the output head adds above its inputs, against its floor.

    ratio = peak bytes above the inputs / (bytes of the weight's gradient + 2 · chunk_size · V · 4)

(the gradient the head must return plus two fp32 chunks of logits). Paths: ``ce`` (the plain cross-entropy,
`FusedLMHead.weighted_ce`) and ``per_token`` (per-token log-probabilities + entropy, a random upstream
gradient on each). Each (backend, dtype, path) runs in a fresh subprocess; the head runs once at full size
first (the compiled kernels' build is not measured), then the peak is reset and one step is measured:
on CPU the resident set's high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) minus the
resident set before the step, with glibc returning every allocation of 64 KiB or more to the system on free
(``MALLOC_MMAP_THRESHOLD_``) so that the resident set is the live memory; on CUDA
``torch.cuda.max_memory_allocated`` above the allocation before the step. ``dtype`` is that of the weight
and the hidden states (``bfloat16``: bf16-true training).

    python benchmarks/head_memory.py                                   # CPU, 1024 x 1024 x 65536, chunk 256
    python benchmarks/head_memory.py --backends auto chunked blocked   # ``auto`` against both backends
    python benchmarks/head_memory.py --device cuda --shape 8192x4096x128256 --chunk-size 1024
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from resident import reset_peak_rss, status_kib

TARGET = 1.25


def measure(backend: str, dtype_name: str, path: str, shape: str, chunk: int, device: str) -> dict:
    """One (backend, dtype, path) in this process: peak bytes above the inputs and the step's time."""
    import torch

    from lit_losses.heads import FusedLMHead

    n, d, v = (int(x) for x in shape.split("x"))
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(n, d, generator=g) * 0.5).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g) * 0.02).to(device, dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    upstream = torch.randn(2, n, generator=g).to(device)
    head = FusedLMHead(weight, backend=backend, chunk_size=chunk, check_finite=False)

    def step() -> None:
        hidden.grad = weight.grad = None
        if path == "ce":
            head.weighted_ce(hidden, targets, 1.0 / n).backward()
        else:
            out = head(hidden, targets, ("logprobs", "entropy"))
            (out.logprobs * upstream[0] + out.entropy * upstream[1]).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()

    step()  # builds the compiled kernels, if any
    hidden.grad = weight.grad = None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        reset_peak_rss()
        base = status_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else status_kib("VmHWM") * 1024
    floor = weight.numel() * weight.element_size() + 2 * chunk * v * 4
    return {
        "added_mib": (peak - base) / 2**20,
        "floor_mib": floor / 2**20,
        "ratio": (peak - base) / floor,
        "time_s": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="1024x1024x65536", help="N x D x V")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--backends", nargs="+", default=["auto"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--paths", nargs="+", default=["ce", "per_token"], choices=["ce", "per_token"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: backend:dtype:path in this process
    args = parser.parse_args()
    if args.one:
        backend, dtype, path = args.one.split(":")
        print(json.dumps(measure(backend, dtype, path, args.shape, args.chunk_size, args.device)))
        return

    import torch

    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')} | {platform.machine()} | {os.cpu_count()} CPUs | "
        f"torch {torch.__version__} | {args.device} | {args.shape}, chunk_size {args.chunk_size}"
    )
    print(f"# command: python {' '.join(sys.argv)}")
    print("\n| backend | dtype | path | added MiB | floor MiB | ratio | ≤ 1.25 | step (s) |")
    print("|---|---|---|---:|---:|---:|---|---:|")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    for backend in args.backends:
        for dtype in args.dtypes:
            for path in args.paths:
                cmd = [
                    sys.executable,
                    __file__,
                    "--one",
                    f"{backend}:{dtype}:{path}",
                    "--shape",
                    args.shape,
                    "--chunk-size",
                    str(args.chunk_size),
                    "--device",
                    args.device,
                ]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if out.returncode != 0:
                    print(f"{backend} {dtype} {path} failed: {out.stderr[-800:]}", file=sys.stderr)
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                ok = "yes" if r["ratio"] <= TARGET else "**no**"
                print(
                    f"| {backend} | {dtype} | {path} | {r['added_mib']:.0f} | {r['floor_mib']:.0f} | "
                    f"{r['ratio']:.2f} | {ok} | {r['time_s']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
