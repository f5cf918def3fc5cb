"""One training step (forward + backward) of a small Hugging Face Llama at a large vocabulary: through
`HFCausalLM` (fused head, no logits) vs the model's own ``model(input_ids, labels=labels).loss``.

Variants:
  hf_labels   transformers' own loss: full [N, V] logits, cross-entropy, autograd
  lit_losses  HFCausalLM.compute_loss (backend auto: the chunked plain-CE fast path)

Each variant runs in a fresh subprocess so that its peak RSS is its own; peak memory is the process
high-water mark minus the resident size once the model, its gradients (one step run beforehand, then
zeroed in place) and the batch are allocated, so it is what the step itself adds. Tokens/s uses the best
of ``--repeats`` timed steps after that warm-up step.

    python benchmarks/hf_step.py                                  # CPU fp32, vocabulary 128256
    python benchmarks/hf_step.py --vocab 32000 --tokens 1024 --repeats 2
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

VARIANTS = ("hf_labels", "lit_losses")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_one(variant: str, args: argparse.Namespace) -> dict:
    import torch

    from lit_losses import HFCausalLM

    torch.manual_seed(0)
    config = {
        "model_type": "llama",
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": 2 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": max(1, args.hidden // 256),
        "max_position_embeddings": args.seq_len,
    }
    model = HFCausalLM(
        config=config, attn_implementation="sdpa", label_format="input_aligned", check_finite=False
    )
    rows = args.tokens // args.seq_len
    input_ids = torch.randint(0, args.vocab, (rows, args.seq_len))
    batch = {"input_ids": input_ids, "labels": input_ids.clone()}

    def step() -> float:
        if variant == "hf_labels":
            loss = model.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        else:
            loss = model.compute_loss(batch).total
        loss.backward()
        for p in model.parameters():
            p.grad.zero_()  # in place: the gradient buffers stay allocated, as in training
        return float(loss)

    step()  # warm-up; allocates the parameter gradients
    base = rss_bytes()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "variant": variant,
        "seconds": min(times),
        "tokens_per_s": args.tokens / min(times),
        "peak_mib": max(0, peak - base) / 2**20,
        "loss": loss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per step (rows × seq-len)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(run_one(args.one, args)))
        return
    results = {}
    for variant in VARIANTS:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--one", variant]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    ours, ref = results["lit_losses"], results["hf_labels"]
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} threads"
    )
    print(f"# {machine}, fp32")
    print(f"# llama hidden={args.hidden} layers={args.layers} V={args.vocab}, {args.tokens} tokens per step")
    print("| variant | step (s) | tokens/s | peak MiB | loss |")
    print("|---|---:|---:|---:|---:|")
    for r in results.values():
        cells = (
            r["variant"],
            f"{r['seconds']:.3f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['peak_mib']:.0f}",
            f"{r['loss']:.5f}",
        )
        print("| " + " | ".join(cells) + " |")
    print(
        f"\nlit_losses / hf_labels: tokens/s {ours['tokens_per_s'] / ref['tokens_per_s']:.2f}x, "
        f"peak memory {ours['peak_mib'] / ref['peak_mib']:.2f}x"
    )


if __name__ == "__main__":
    main()
