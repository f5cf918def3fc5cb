"""One DPO step through the fused head against the naive computation of the same loss from full logits.

The tiny LM of ``configs/tiny_lm.yaml`` (d_model 192, 3 layers, 3 heads) with a 32768-token vocabulary, on
one micro-batch of ``--pairs`` preference pairs (2 × pairs rows of ``--width`` tokens, the first quarter of
each row a prompt without target), DPO ``sigmoid`` with ``β = 0.1``, the reference a frozen copy of the
initial policy (its log-probabilities computed in the step, without gradient). One "step" is the loss and
its backward (the optimizer update is the same in every variant).

Variants:
  fused        ``TinyLM(dpo=..., ref_model="initial_policy")``: ``compute_loss`` + ``backward`` (the policy's
               and the reference's log-probabilities from the fused head: no ``[tokens × V]`` logits)
  metrics      ``fused`` with ``token_metrics=True``: TRL's per-token metrics (entropy, mean token accuracy,
               ``logits/chosen|rejected``) from one more no-grad pass of the head over the completion tokens
  precomputed  the same with the reference's sequence log-probabilities in the batch
               (``precompute_ref_log_probs``): the policy alone
  naive        the same loss from materialized logits: ``log_softmax(h Wᵀ)`` of the policy (with autograd)
               and of the reference (under ``no_grad``), gathered at the labels, summed per sequence

Time: variants interleaved round-robin, the median and the fastest of ``--repeats`` steps after one
warm-up step. Memory: each variant in a fresh subprocess, one warm-up step, then the resident set's
high-water mark of one step above the resident set before it (``VmHWM`` reset through
``/proc/self/clear_refs``; glibc returns every allocation of 64 KiB or more on free, so the resident set is
the live memory). The variants give the same loss (printed).

    python benchmarks/preference_step.py --repeats 5 [--pairs 4 --width 256] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from resident import reset_peak_rss, status_kib

VOCAB, D_MODEL, LAYERS, HEADS, BETA = 32768, 192, 3, 3, 0.1
VARIANTS = ("fused", "metrics", "precomputed", "naive")


def preference_batch(pairs: int, width: int, vocab: int = VOCAB):
    """``2 × pairs`` rows (chosen rows, then rejected), a prompt of ``width // 4`` tokens shared by the two
    rows of a pair, completions of different lengths; next-token labels on the completions."""
    import torch

    g = torch.Generator().manual_seed(0)
    prompt = width // 4
    ids = torch.randint(0, vocab, (2 * pairs, width), generator=g)
    ids[pairs:, :prompt] = ids[:pairs, :prompt]
    ends = torch.randint(prompt + 8, width + 1, (2 * pairs, 1), generator=g)
    position = torch.arange(width)[None]
    labels = torch.roll(ids, -1, 1)
    labels[(position < prompt - 1) | (position >= ends - 1)] = -100
    attention = (position < ends).long()
    chosen = torch.zeros_like(labels, dtype=torch.bool)
    chosen[:pairs] = labels[:pairs] != -100
    return {"input_ids": ids, "labels": labels, "attention_mask": attention, "chosen_mask": chosen}


def build(variant: str, batch: dict):
    """The model of ``variant`` (every variant's weights identical) and the batch it reads."""
    import torch

    from lit_losses import TinyLM

    dims = dict(vocab_size=VOCAB, d_model=D_MODEL, n_layers=LAYERS, n_heads=HEADS)
    torch.manual_seed(0)
    if variant == "precomputed":
        model = TinyLM(**dims, dpo={"beta": BETA, "precompute_ref_log_probs": True})
        torch.manual_seed(0)
        reference = TinyLM(**dims, dpo={"beta": BETA}).reference_model()
        logps = sequence_sums(reference.logprobs(batch, batch["labels"]), batch["labels"])
        pairs = batch["labels"].shape[0] // 2
        return trained(model), {
            **batch,
            "ref_chosen_logps": logps[:pairs],
            "ref_rejected_logps": logps[pairs:],
        }
    metrics = variant == "metrics"
    model = TinyLM(**dims, dpo={"beta": BETA}, ref_model="initial_policy", token_metrics=metrics)
    model.reference_model()  # the frozen copy is taken here, before any step
    return trained(model), batch


def trained(model):
    """``model`` with every weight moved a little (seeded), as after some training: the policy is no
    longer its reference."""
    import torch

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return model


def sequence_sums(token_logps, labels):
    import torch

    return torch.where(labels != -100, token_logps, 0.0).sum(-1)


def naive_loss(model, batch):
    """DPO sigmoid from full logits: the textbook computation (TRL's ``selective_log_softmax``)."""
    import torch
    import torch.nn.functional as F

    labels = batch["labels"]

    def logps(runner):
        logits = F.linear(runner.hidden_states(batch), runner.output_projection()[0])
        picked = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
        return sequence_sums(picked, labels)

    policy = logps(model)
    with torch.no_grad():
        reference = logps(model.frozen_models["reference"].runner)
    ratios = policy - reference
    pairs = labels.shape[0] // 2
    return -F.logsigmoid(BETA * (ratios[:pairs] - ratios[pairs:])).mean()


def step(variant: str, model, batch) -> float:
    model.zero_grad(set_to_none=True)
    loss = naive_loss(model, batch) if variant == "naive" else model.compute_loss(batch).total
    loss.backward()
    return float(loss.detach())


def measure_memory(variant: str, pairs: int, width: int) -> dict:
    """In this (fresh) process: the peak resident memory one step adds above the state before it."""
    batch = preference_batch(pairs, width)
    model, data = build(variant, batch)
    step(variant, model, data)  # warm-up: gradients allocated, like every later step
    before = status_kib("VmRSS")
    reset_peak_rss()
    loss = step(variant, model, data)
    return {"variant": variant, "peak_mib": (status_kib("VmHWM") - before) / 1024, "loss": loss}


def memory_of(variant: str, pairs: int, width: int, threads: int | None) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    cmd = [sys.executable, __file__, "--memory-of", variant, "--pairs", str(pairs), "--width", str(width)]
    cmd += ["--threads", str(threads)] if threads else []
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--memory-of", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_of:
        print(json.dumps(measure_memory(args.memory_of, args.pairs, args.width)))
        return
    batch = preference_batch(args.pairs, args.width)
    runs = {v: build(v, batch) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    losses = {}
    for r in range(args.repeats + 1):
        for variant, (model, data) in runs.items():
            start = time.perf_counter()
            losses[variant] = step(variant, model, data)
            if r:  # the first round warms up
                times[variant].append(time.perf_counter() - start)
    memory = {v: memory_of(v, args.pairs, args.width, args.threads) for v in VARIANTS}
    tokens = int((batch["labels"] != -100).sum())
    print(
        f"{platform.machine()} · torch {torch.__version__} · {torch.get_num_threads()} threads · "
        f"{args.pairs} pairs × 2 rows × {args.width} tokens ({tokens} completion tokens) · V {VOCAB} · "
        f"repeats {args.repeats}"
    )
    print("| variant | loss | median step (ms) | / naive | fastest (ms) | peak memory (MiB) | / naive |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base_time, base_mem = statistics.median(times["naive"]), memory["naive"]["peak_mib"]
    for variant in VARIANTS:
        med, mem = statistics.median(times[variant]), memory[variant]["peak_mib"]
        print(
            f"| {variant} | {losses[variant]:.6f} | {med * 1e3:.0f} | {med / base_time:.2f} | "
            f"{min(times[variant]) * 1e3:.0f} | {mem:.0f} | {mem / base_mem:.2f} |"
        )
    print(f"logits of one forward: {2 * args.pairs * args.width * VOCAB * 4 / 2**20:.0f} MiB (fp32)")


if __name__ == "__main__":
    main()
