"""Where one forward + backward of the output head spends its time: a `torch.profiler` table of the kernels
of one step (after a warm-up that builds the compiled kernels), sorted by device time.

    python benchmarks/head_profile.py --device cuda --dtype bfloat16 --shape 8192x4096x128256 \\
        --variants blocked_ce blocked_entropy
    python benchmarks/head_profile.py --shape 1024x256x32768 --variants chunked_entropy   # CPU

The variants are those of `benchmarks/fused_head.py`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from fused_head import RUNS


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="1024x256x32768", help="N x D x V")
    parser.add_argument("--variants", nargs="+", default=["blocked_entropy"], choices=sorted(RUNS))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--rows", type=int, default=15, help="kernels listed per variant")
    args = parser.parse_args()
    n, d, v = (int(x) for x in args.shape.split("x"))
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(args.device).manual_seed(0)
    hidden = (torch.randn(n, d, generator=g, device=args.device) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g, device=args.device) * 0.02).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g, device=args.device)
    upstream = torch.randn(n, generator=g, device=args.device)
    on_cuda = args.device == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]
    for variant in args.variants:

        def step(variant=variant) -> None:
            hidden.grad = weight.grad = None
            RUNS[variant](hidden, weight, targets, upstream, args.chunk_size)
            if on_cuda:
                torch.cuda.synchronize()

        step()
        with profile(activities=activities) as prof:
            step()
        key = "self_cuda_time_total" if on_cuda else "self_cpu_time_total"
        print(f"\n## {variant} ({args.shape}, {args.dtype} on {args.device})")
        print(prof.key_averages().table(sort_by=key, row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
