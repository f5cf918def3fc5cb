"""The matmuls of one vocabulary block of the ``blocked`` head, timed on CUDA for several block widths: the
speed of a GEMM depends on its rows being aligned (an odd width takes cuBLAS to slower kernels).

For bf16 ``h [n, D]``, ``W_b [V_b, D]`` and ``dz [n, V_b]``: ``h W_bᵀ`` with an fp32 output (the logits),
``dz W_b`` with an fp32 output (the hidden states' gradient) and ``dzᵀ h`` in bf16 (the weight's gradient),
each in TFLOP/s (the mean of 10 after 3 warm-ups, CUDA events), against the full head's ``h Wᵀ``.

    python benchmarks/block_gemm.py --n 8192 --d 4096 --widths 8187 8064 8192 --vocab 128256
"""

from __future__ import annotations

import argparse

import torch


def tflops(fn, flop: float, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return flop * repeats / (start.elapsed_time(end) / 1e3) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--widths", type=int, nargs="+", default=[8187, 8064, 8192])
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args()
    n, d, bf16, fp32 = args.n, args.d, torch.bfloat16, torch.float32
    h = torch.randn(n, d, device="cuda", dtype=bf16)
    weight = torch.randn(args.vocab, d, device="cuda", dtype=bf16) * 0.02
    print(
        f"# {torch.cuda.get_device_name()} | torch {torch.version.cuda and torch.__version__} | n={n} D={d}"
    )
    print("| V_b | logits h W_bᵀ (fp32 out) | dz W_b (fp32 out) | dzᵀ h (bf16 out) |")
    print("|---:|---:|---:|---:|")
    for width in [*args.widths, args.vocab]:
        w_blk = weight[:width]
        dz = torch.randn(n, width, device="cuda", dtype=bf16)
        grad_w = torch.empty(width, d, device="cuda", dtype=bf16)
        flop = 2.0 * n * d * width
        cells = [
            tflops(lambda w_blk=w_blk: torch.mm(h, w_blk.t(), out_dtype=fp32), flop),
            tflops(lambda w_blk=w_blk, dz=dz: torch.mm(dz, w_blk, out_dtype=fp32), flop),
            tflops(lambda dz=dz, grad_w=grad_w: torch.mm(dz.t(), h, out=grad_w), flop),
        ]
        print(f"| {width} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    print("(TFLOP/s; the last row is the full vocabulary, as the naive head and matmul3 run it)")


if __name__ == "__main__":
    main()
