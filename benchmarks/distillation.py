"""Time and peak memory of one forward + backward of logit distillation, three ways:

  fused   lit_losses.heads.linear_distillation (chunked: neither model's logits materialized), per-token
          values with a random upstream gradient on each
  fused_sum  the same with token_weights (the weighted sum the module trains on: gradients in forward,
          four N·D·V matmuls instead of six)
  naive   both [N, V] logits materialized, log_softmax, the divergence, autograd (what a trainer does)
  liger   Liger-Kernel's LigerFusedLinearJSDLoss (soft weight 1, hard weight 0, its torch.compile off on
          CPU), the mean over tokens; ``jsd`` only (its β convention is TRL's, like ours)

Each (variant, loss) runs in a fresh subprocess whose peak memory is its own: on CPU the resident set's
high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs`` after a warm-up run) minus the
resident set before the measured step, with glibc returning every allocation of 64 KiB or more to the
system (``MALLOC_MMAP_THRESHOLD_``, as `benchmarks/head_memory.py`); on CUDA
``torch.cuda.max_memory_allocated`` above the allocation before the step. The floor is the student
weight's gradient plus two fp32 ``[chunk, V]`` chunks; ``ratio`` is the peak above the inputs over it.
Time: the step's wall clock and the process's CPU time (all threads; on a shared machine the CPU time
measures the work, the wall clock also the waiting), compared with ``naive`` by CPU time.

    python benchmarks/distillation.py                                  # CPU, 512x256x65536, chunk 256
    python benchmarks/distillation.py --shape 2048x512x128256 --losses jsd
    python benchmarks/distillation.py --device cuda --shape 8192x2048x128256 --chunk-size 1024
    python benchmarks/distillation.py --one fused:forward_kl           # one measurement, JSON (tests)
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

VARIANTS = ("naive", "fused", "fused_sum", "liger")  # naive first: the others are compared with it
LOSSES = ("forward_kl", "reverse_kl", "jsd")
#: glibc's threshold above which allocations are mmap'ed and returned at free: the resident set is live memory
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def _inputs(shape: str, device: str, dtype_name: str):
    import torch

    n, d, v = (int(x) for x in shape.split("x"))
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    student = (torch.randn(n, d, generator=g) * 0.5).to(device, dtype).requires_grad_()
    s_weight = (torch.randn(v, d, generator=g) * 0.05).to(device, dtype).requires_grad_()
    teacher = (torch.randn(n, 2 * d, generator=g) * 0.5).to(device, dtype)
    t_weight = (torch.randn(v, 2 * d, generator=g) * 0.05).to(device, dtype)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    upstream = (torch.rand(n, generator=g) / n).to(device)
    return student, s_weight, teacher, t_weight, targets, upstream


def _naive(student, s_weight, teacher, t_weight, targets, upstream, loss, chunk):
    import torch

    from lit_losses.heads.divergence import Divergence

    lp = torch.log_softmax((student @ s_weight.T).float(), -1)
    with torch.no_grad():
        lq = torch.log_softmax((teacher @ t_weight.T).float(), -1)
    p, q = lp.exp(), lq.exp()
    if loss == "forward_kl":
        value = (q * (lq - lp)).sum(-1)
    elif loss == "reverse_kl":
        value = (p * (lp - lq)).sum(-1)
    else:
        beta = Divergence.of("jsd").beta
        lm = torch.log((1 - beta) * p + beta * q)
        value = beta * (q * (lq - lm)).sum(-1) + (1 - beta) * (p * (lp - lm)).sum(-1)
    value.backward(upstream.to(value.dtype))


def _fused(student, s_weight, teacher, t_weight, targets, upstream, loss, chunk):
    from lit_losses.heads import linear_distillation

    value = linear_distillation(
        student, s_weight, teacher, t_weight, loss=loss, chunk_size=chunk, check_finite=False
    )
    value.backward(upstream.to(value.dtype))


def _fused_sum(student, s_weight, teacher, t_weight, targets, upstream, loss, chunk):
    from lit_losses.heads import linear_distillation

    total = linear_distillation(
        student,
        s_weight,
        teacher,
        t_weight,
        loss=loss,
        chunk_size=chunk,
        check_finite=False,
        token_weights=upstream,
    )
    total.backward()


def _liger(student, s_weight, teacher, t_weight, targets, upstream, loss, chunk):
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

    if loss != "jsd":
        raise ValueError("Liger-Kernel's fused linear distillation computes the jsd only")
    fn = LigerFusedLinearJSDLoss(
        weight_hard_loss=0.0, weight_soft_loss=1.0, compiled=student.is_cuda, chunk_size=chunk
    )
    fn(student, s_weight, teacher, t_weight, targets).backward()


def measure(
    variant: str, loss: str, shape: str, chunk: int, device: str, dtype: str, warmup: bool = True
) -> dict:
    """One (variant, loss) in this process: peak bytes above the inputs, its floor, and the step's time
    (after a warm-up step unless ``warmup`` is False)."""
    import torch

    inputs = _inputs(shape, device, dtype)
    fn = {"fused": _fused, "fused_sum": _fused_sum, "naive": _naive, "liger": _liger}[variant]
    student, s_weight = inputs[0], inputs[1]

    def step() -> None:
        student.grad = s_weight.grad = None
        fn(*inputs, loss=loss, chunk=chunk)
        if device == "cuda":
            torch.cuda.synchronize()

    if warmup:  # compiled kernels (Liger's on CUDA), lazily loaded libraries
        step()
        student.grad = s_weight.grad = None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        reset_peak_rss()
        base = status_kib("VmRSS") * 1024
    t0, c0 = time.perf_counter(), time.process_time()
    step()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else status_kib("VmHWM") * 1024
    v = s_weight.shape[0]
    floor = s_weight.numel() * s_weight.element_size() + 2 * chunk * v * 4
    return {
        "added_mib": (peak - base) / 2**20,
        "floor_mib": floor / 2**20,
        "ratio": (peak - base) / floor,
        "time_s": seconds,
        "cpu_s": cpu,
    }


def run_one(
    variant: str, loss: str, shape: str, chunk: int, device: str = "cpu", dtype: str = "float32"
) -> dict:
    """`measure` in a fresh subprocess (its own peak memory), as a dict; raises on failure."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--one",
        f"{variant}:{loss}",
        "--shape",
        shape,
        "--chunk-size",
        str(chunk),
        "--device",
        device,
        "--dtype",
        dtype,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **MALLOC_ENV})
    if out.returncode != 0:
        raise RuntimeError(f"{variant}:{loss} failed: {out.stderr[-1500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="512x256x65536", help="N x Ds x V (the teacher has Dt = 2 Ds)")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--one", help="variant:loss, measured in this process, printed as JSON")
    parser.add_argument("--no-warmup", action="store_true", help="with --one: measure the first step")
    args = parser.parse_args()
    if args.one:
        variant, loss = args.one.split(":")
        result = measure(
            variant,
            loss,
            shape=args.shape,
            chunk=args.chunk_size,
            device=args.device,
            dtype=args.dtype,
            warmup=not args.no_warmup,
        )
        print(json.dumps(result))
        return

    import torch

    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')} | {platform.machine()} | {os.cpu_count()} CPUs | "
        f"torch {torch.__version__} | {args.device} {args.dtype} | N x Ds x V = {args.shape} (Dt = 2 Ds), "
        f"chunk_size {args.chunk_size}"
    )
    print(f"# command: python {' '.join(sys.argv)}")
    columns = (
        "loss",
        "variant",
        "step (s)",
        "CPU (s)",
        "added MiB",
        "ratio to floor",
        "CPU / naive",
        "memory / naive",
    )
    print("\n| " + " | ".join(columns) + " |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for loss in args.losses:
        naive = None
        for variant in args.variants:
            if variant == "liger" and loss != "jsd":
                continue
            try:
                r = run_one(variant, loss, args.shape, args.chunk_size, device=args.device, dtype=args.dtype)
            except RuntimeError as err:
                print(err, file=sys.stderr)
                continue
            naive = r if variant == "naive" else naive
            rel_t = f"{r['cpu_s'] / naive['cpu_s']:.2f}" if naive else "–"
            rel_m = f"{r['added_mib'] / naive['added_mib']:.2f}" if naive else "–"
            print(
                f"| {loss} | {variant} | {r['time_s']:.2f} | {r['cpu_s']:.2f} | {r['added_mib']:.0f} | "
                f"{r['ratio']:.2f} | {rel_t} | {rel_m} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
