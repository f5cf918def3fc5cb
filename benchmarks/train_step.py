"""One whole training step (forward, backward, optimizer) of a Llama-architecture model: this package against
what users run instead, tokens per second and peak memory, one table.

The model is built from a config (random weights, nothing downloaded; default: Llama 3.2 1B's shape,
1.24 B parameters with the tied 128256-token embedding), in ``--dtype`` (bf16 weights by default: bf16-true),
``sdpa`` attention, the same seeded weights and batch in every variant. One step is ``loss.backward()``,
``AdamW.step()`` and ``zero_grad()``; the table gives the first step (with any kernel's compile), the median
of ``--steps`` steps after ``--warmup`` steps, tokens/s from that median, and peak memory over the timed
steps (CUDA: ``max_memory_allocated``; CPU: the process's resident high-water mark, reset after warm-up),
model, gradients and optimizer states included.

Variants, each in its own process:
  lit_sft          `HFCausalLM` + the fused head (``auto``), the SFT loss (cross-entropy, token mean)
  lit_sft_liger    ``lit_sft`` with ``use_liger_kernel``: Liger-Kernel's decoder kernels (RoPE, RMSNorm,
                   SwiGLU; its loss patches off: the package's head computes the loss)
  lit_sft_reg      ``lit_sft`` + ``z_loss`` and ``entropy`` regularizers
  lit_grpo         the same model with TRL's GRPO loss (``model.grpo``: ``dapo``, clip-higher, a k3 KL to
                   reference log-probabilities; the batch carries sampling and reference log-probabilities
                   and advantages)
  hf               the model's own loss: ``model(input_ids, labels=input_ids).loss`` (full logits)
  hf_liger         the same after Liger-Kernel's ``apply_liger_kernel_to_llama`` (RoPE, RMSNorm, SwiGLU and
                   the fused linear cross-entropy; Triton kernels: CUDA only, the row says why it is absent)

The package's step is the core of a `lit-losses fit` step (``compute_loss`` then backward), without
Lightning's loop; the token counts are attached to the batch beforehand, as `GlobalStatsLoader` does.
Every variant's loss at the first step is the same cross-entropy for the SFT variants (``hf`` shifts the
labels inside, the package reads next-token labels): the table shows it.

``--fsdp``: FSDP2 over one process (gloo on CPU, NCCL on CUDA): the package through its own
`lit_losses.parallel.parallelize` (the decoder layers as units, the root holding the embeddings and the
output projection), the ``hf`` variants with ``fully_shard`` on the same units directly.

    python benchmarks/train_step.py --device cuda                   # 1B, seq 2048, bf16, one GPU
    python benchmarks/train_step.py --device cuda --fsdp
    python benchmarks/train_step.py --device cpu --tiny --dtype float32 --steps 2 --warmup 1
    python benchmarks/train_step.py --device cuda --variants lit_sft_liger hf_liger --profile profiles
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

from resident import reset_peak_rss, status_kib

#: The variants, in table order.
VARIANTS = ("lit_sft", "lit_sft_liger", "lit_sft_reg", "lit_grpo", "hf", "hf_liger")
#: Llama 3.2 1B's shape (hidden, intermediate, layers, heads, key-value heads).
LLAMA_1B = (2048, 8192, 16, 32, 8)
#: A shape that runs in seconds on a CPU (``--tiny``).
TINY = (64, 128, 2, 4, 2)
REGULARIZERS = [{"name": "z_loss", "weight": 1e-4}, {"name": "entropy", "weight": 1e-3}]
GRPO = {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.04}


def llama_config(args: argparse.Namespace) -> dict[str, Any]:
    hidden, intermediate, layers, heads, kv_heads = TINY if args.tiny else LLAMA_1B
    return {
        "model_type": "llama",
        "vocab_size": args.vocab,
        "hidden_size": args.hidden or hidden,
        "intermediate_size": args.intermediate or intermediate,
        "num_hidden_layers": args.layers or layers,
        "num_attention_heads": args.heads or heads,
        "num_key_value_heads": args.kv_heads or kv_heads,
        "max_position_embeddings": args.seq_len,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
    }


def make_batch(args: argparse.Namespace, device: str) -> dict[str, Any]:
    """``input_ids`` ``[rows, seq]``, next-token ``labels`` (the last position unlabelled) and the GRPO keys
    (sampling and reference log-probabilities near a uniform policy's, one advantage per row)."""
    import torch

    g = torch.Generator().manual_seed(1)
    rows, seq = args.rows, args.seq_len
    ids = torch.randint(0, args.vocab, (rows, seq), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((rows, 1), -100)], 1)
    valid = labels != -100
    near_uniform = -math.log(args.vocab) + 0.1 * torch.randn(rows, seq, generator=g)
    batch = {
        "input_ids": ids,
        "labels": labels,
        "sampling_logprobs": torch.where(valid, near_uniform, 0.0),
        "ref_logprobs": torch.where(valid, near_uniform + 0.05 * torch.randn(rows, seq, generator=g), 0.0),
        "advantages": torch.where(valid, torch.randn(rows, 1, generator=g).expand(rows, seq), 0.0),
    }
    return {k: v.to(device) for k, v in batch.items()}


def init_single_process_group(device: str) -> Any:
    """A one-process group and a ``(data_parallel, tensor_parallel)`` mesh of size ``(1, 1)``."""
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return init_device_mesh(device.split(":")[0], (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))


def shard_hf(model: Any, mesh: Any) -> None:
    """``fully_shard`` on each decoder layer, then on the root (kept gathered between forward and
    backward), as `lit_losses.parallel.parallelize` does for `HFCausalLM`."""
    from torch.distributed.fsdp import fully_shard

    dp = mesh["data_parallel"]
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp, reshard_after_forward=False)


def build(variant: str, args: argparse.Namespace, mesh: Any, batch: dict[str, Any]) -> tuple[Any, Any]:
    """``(module whose parameters train, loss_fn() -> loss)`` of one variant on ``batch``."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**llama_config(args))
    with torch.device(args.device):
        hf = transformers.AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
        )
    if variant.startswith("hf"):
        if variant == "hf_liger":
            from liger_kernel.transformers import apply_liger_kernel_to_llama

            apply_liger_kernel_to_llama(model=hf)
        if mesh is not None:
            shard_hf(hf, mesh)

        def hf_loss() -> Any:
            ids = batch["input_ids"]
            return hf(input_ids=ids, labels=ids, use_cache=False).loss

        return hf, hf_loss

    from lit_losses import HFCausalLM
    from lit_losses.aggregation import GLOBAL_STATS_KEY, GlobalStats
    from lit_losses.parallel import ParallelConfig, parallelize

    options: dict[str, Any] = {
        "lit_sft_liger": {"use_liger_kernel": True},
        "lit_sft_reg": {"regularizers": REGULARIZERS},
        "lit_grpo": {"grpo": GRPO},
    }.get(variant, {})
    model = HFCausalLM(
        model=hf,
        head_backend="auto",
        head_chunk_size=args.chunk_size,
        head_matmul_precision=args.head_matmul_precision,
        **options,
    )
    if mesh is not None:
        parallelize(model, mesh, ParallelConfig())
    keys = ("input_ids", "labels") if variant != "lit_grpo" else tuple(batch)
    ours = {k: batch[k] for k in keys}
    # the counts that `GlobalStatsLoader` attaches in `fit`, before the forward
    ours[GLOBAL_STATS_KEY] = GlobalStats.local_only(ours, model.mask_keys(), model.ignore_index)

    def lit_loss() -> Any:
        return model.compute_loss(dict(ours)).total  # a fresh dict per step, as a loader gives

    return model, lit_loss


def run_one(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build, warm up and time one variant in this process (then profile a step with ``--profile``)."""
    import torch
    from torch.profiler import record_function

    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    mesh = init_single_process_group(args.device) if args.fsdp else None
    model, loss_fn = build(variant, args, mesh, batch=make_batch(args, args.device))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step() -> tuple[float, float]:
        sync()
        start = time.perf_counter()
        with record_function("loss (forward)"):
            loss = loss_fn()
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - start, float(loss.detach())

    first_s, first_loss = step()
    for _ in range(args.warmup - 1):
        step()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_peak_rss()
    times = [step()[0] for _ in range(args.steps)]
    peak = torch.cuda.max_memory_allocated() if cuda else status_kib("VmHWM") * 1024
    if args.profile:
        profile_step(step, path=profile_path(args, variant), cuda=cuda)
    if mesh is not None:
        torch.distributed.destroy_process_group()
    median = statistics.median(times)
    return {
        "variant": variant,
        "loss": first_loss,
        "first_s": first_s,
        "step_s": median,
        "tokens_per_s": args.rows * args.seq_len / median,
        "peak_gib": peak / 2**30,
        "params": sum(p.numel() for p in model.parameters()),
    }


def profile_path(args: argparse.Namespace, variant: str) -> str:
    """``<--profile>/<variant>[_chunk<c>][_<head matmul precision>].txt`` (the options of the package's
    variants)."""
    ours = variant.startswith("lit")
    chunk = f"_chunk{args.chunk_size}" if args.chunk_size and ours else ""
    precision = "" if args.head_matmul_precision == "auto" or not ours else f"_{args.head_matmul_precision}"
    return os.path.join(args.profile, f"{variant}{chunk}{precision}.txt")


def profile_step(step: Any, path: str, cuda: bool) -> None:
    """One more step under `torch.profiler` (after the timed ones): its operators and kernels by their own
    time on the device (CUDA) or the CPU, the step's phases (``loss (forward)``, ``backward``,
    ``optimizer``) among them, written to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        seconds, _ = step()
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(f"# one profiled step: {seconds:.4f} s\n")
        f.write(prof.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=70))


def run_variant(variant: str, argv: list[str], timeout: float | None, logs: str | None) -> dict[str, Any]:
    """``variant`` in a fresh process: its result, or ``{"absent": why}`` (the last line of its error, or the
    timeout); its stderr in ``logs/<variant>.log`` if ``logs`` is given."""
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--one", variant]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # freed memory leaves the resident set
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as timed_out:
        stderr = timed_out.stderr.decode() if isinstance(timed_out.stderr, bytes) else timed_out.stderr or ""
        out = subprocess.CompletedProcess(cmd, -9, "", stderr + f"\ntimed out after {timeout} s")
    if logs:
        os.makedirs(logs, exist_ok=True)
        with open(os.path.join(logs, f"{variant}.log"), "w") as f:
            f.write(out.stderr)
    lines = out.stdout.strip().splitlines()
    if out.returncode == 0 and lines:
        return json.loads(lines[-1])
    errors = [line.strip() for line in out.stderr.strip().splitlines() if line.strip()]
    why = errors[-1] if errors else f"exit {out.returncode}"
    return {"variant": variant, "absent": why[:300]}


def table(results: list[dict[str, Any]]) -> str:
    """The markdown table, with ratios to ``hf`` and ``hf_liger`` where they ran."""
    ran = {r["variant"]: r for r in results if "absent" not in r}
    lines = [
        "| variant | loss at step 1 | first step (s) | step (s) | tokens/s | peak GiB "
        "| tokens/s / hf | memory / hf | tokens/s / hf_liger | memory / hf_liger |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if "absent" in r:
            lines.append(f"| {r['variant']} | absent: {r['absent']} |" + " |" * 8)
            continue
        ratios = []
        for base in ("hf", "hf_liger"):
            b = ran.get(base)
            ratios += (
                [f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}", f"{r['peak_gib'] / b['peak_gib']:.2f}"]
                if b
                else ["", ""]
            )
        cells = [
            r["variant"],
            f"{r['loss']:.6f}",
            f"{r['first_s']:.3f}",
            f"{r['step_s']:.3f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['peak_gib']:.2f}",
            *ratios,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tiny", action="store_true", help=f"a tiny model {TINY} (CPU tests)")
    parser.add_argument("--hidden", type=int, help="hidden size (default: Llama 3.2 1B's, 2048)")
    parser.add_argument("--intermediate", type=int, help="MLP size (default 8192)")
    parser.add_argument("--layers", type=int, help="decoder layers (default 16)")
    parser.add_argument("--heads", type=int, help="attention heads (default 32)")
    parser.add_argument("--kv-heads", type=int, help="key-value heads (default 8)")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=4, help="sequences per step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing (>= 1)")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 over one process")
    parser.add_argument(
        "--chunk-size", type=int, help="the package's head_chunk_size (default: from a memory budget)"
    )
    parser.add_argument(
        "--head-matmul-precision",
        default="auto",
        choices=["auto", "full", "low", "low_logits"],
        help="the package's head_matmul_precision (low_logits: bf16 logits, as HF's and Liger-Kernel's)",
    )
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--json", help="also write the rows to this JSON file (after each variant)")
    parser.add_argument("--variant-timeout", type=float, help="seconds before a variant's process is stopped")
    parser.add_argument("--logs", help="a folder for each variant's stderr (<variant>.log)")
    parser.add_argument(
        "--profile",
        help="a folder for one more profiled step per variant (<variant>[_chunk<c>].txt: ops by time)",
    )
    parser.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: one variant here
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error(f"--warmup must be >= 1, got {args.warmup}")
    return args


def main() -> None:
    args = parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args)))
        return
    import torch

    argv = sys.argv[1:]
    results = []
    for variant in args.variants:  # each row on stderr and in the JSON as it comes (a timeout keeps them)
        results.append(run_variant(variant, argv, timeout=args.variant_timeout, logs=args.logs))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "rows": results}, f, indent=1)
    config = llama_config(args)
    params = next((r["params"] for r in results if "params" in r), 0)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.machine()
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')} | {device} | {os.cpu_count()} CPUs | torch {torch.__version__} "
        f"| {args.device}{' FSDP2' if args.fsdp else ''} | {args.dtype}"
    )
    print(
        f"# llama hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, vocab "
        f"{config['vocab_size']} ({params / 1e9:.3f} B parameters), {args.rows} x {args.seq_len} tokens per "
        f"step, median of {args.steps} steps after {args.warmup}"
    )
    print(f"# command: python benchmarks/train_step.py {' '.join(argv)}\n")
    print(table(results), flush=True)


if __name__ == "__main__":
    main()
