"""Cost of an RL objective on the tiny LM at vocabulary 32768: a ``ppo`` + ``kl_reference`` + ``entropy``
step against a cross-entropy step, in one run.

The tiny LM of ``configs/tiny_lm.yaml`` (d_model 192, 3 layers, 3 heads) with a 32768-token vocabulary, on
one packed micro-batch of 16 rows × 256 tokens carrying the RL keys (``sampling_logprobs``,
``advantages``, ``ref_logprobs``, ``sample_weights``). One "step" is ``compute_loss`` + ``backward`` (the
optimizer update is the same in every variant). Variants are interleaved round-robin, so that machine
noise hits them alike; reported: the median of ``--repeats`` steps, the fastest step of each (the cost
without other tenants' load: on a shared VM the element-wise passes suffer from memory-bandwidth
contention more than the matmuls do) and the median over rounds of each round's ratio to its ce step
(robust to load that drifts between rounds).

Variants:
  ce              the base cross-entropy alone (the head's plain-CE fast path)
  ppo             base_loss: ppo alone (the fused pointwise path)
  ppo_kl          ppo + kl_reference (k3, weight 0.05)
  ppo_kl_entropy  ppo + kl_reference + entropy (bonus, weight 0.01), the PPO/GRPO objective
  ppo_kl_entropy_eager  the same with the eager entropy passes (LIT_LOSSES_COMPILE_KERNELS=0)

The RL variants run chunk by chunk inside the fused head with every gradient computed in forward (three
matmuls, no logits recompute), as the CE fast path does; the policy loss and the KL add O(tokens) work,
the entropy two element-wise passes over each chunk of log-probabilities (the compiled kernels of
`lit_losses.heads.entropy_kernels`: one read for H, one read-write for the logit gradient) on top of the
CE path's log-softmax and exp; the eager passes form p in a second buffer, read a row dot and form the
logit gradient in two passes, on half-size chunks. The first step of each variant is reported apart (it
includes the kernels' compile, a few seconds once per process).
Target (issue #17): ppo_kl_entropy ≤ 1.10 × ce.

    python benchmarks/rl_step.py --repeats 15 [--threads 2] [--device cuda]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from unittest import mock

import torch

from lit_losses import TinyLM

VOCAB = 32768
PPO = dict(base_loss="ppo", base_loss_args={"clip_low_threshold": 0.8, "clip_high_threshold": 1.28})
KL = {"name": "kl_reference", "weight": 0.05}
ENTROPY = {"name": "entropy", "weight": 0.01, "args": {"mode": "bonus"}}
VARIANTS = {
    "ce": {},
    "ppo": PPO,
    "ppo_kl": {**PPO, "regularizers": [KL]},
    "ppo_kl_entropy": {**PPO, "regularizers": [KL, ENTROPY]},
    "ppo_kl_entropy_eager": {**PPO, "regularizers": [KL, ENTROPY]},
}
EAGER = {"ppo_kl_entropy_eager"}  # these variants run with the environment EAGER_ENV, the others COMPILED_ENV
EAGER_ENV, COMPILED_ENV = {"LIT_LOSSES_COMPILE_KERNELS": "0"}, {"LIT_LOSSES_COMPILE_KERNELS": "1"}


def rl_batch(rows: int = 16, width: int = 256, vocab: int = VOCAB) -> dict:
    """Two packed documents per row, the first 32 positions of each a prompt (no target)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    labels = torch.roll(ids, -1, 1)
    cut = torch.randint(64, 192, (rows, 1), generator=g)
    segment_ids = (torch.arange(width)[None] >= cut).long() + 1
    position_ids = torch.where(segment_ids == 1, torch.arange(width), torch.arange(width) - cut)
    labels[(position_ids < 32) | (torch.roll(segment_ids, -1, 1) != segment_ids)] = -100
    labels[:, -1] = -100
    valid = labels != -100

    def per_token(values: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, values, 0.0)

    near_uniform = -math.log(vocab) + 0.2 * torch.randn(rows, width, generator=g)
    return {
        "input_ids": ids,
        "labels": labels,
        "segment_ids": segment_ids,
        "position_ids": position_ids,
        "sampling_logprobs": per_token(near_uniform),
        "advantages": per_token(torch.randn(rows, 1, generator=g).expand(rows, width)),
        "ref_logprobs": per_token(near_uniform + 0.05 * torch.randn(rows, width, generator=g)),
        "sample_weights": per_token(torch.ones(rows, width)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--chunk", type=int, default=None, help="head_chunk_size (default: the head's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dims = dict(vocab_size=VOCAB, d_model=192, n_layers=3, n_heads=3, head_chunk_size=args.chunk)
    torch.manual_seed(0)
    names = ["ce", *(v for v in args.variants if v != "ce")]
    models = {name: TinyLM(**dims, **VARIANTS[name]).to(args.device) for name in names}
    state = models["ce"].state_dict()
    for model in models.values():
        model.load_state_dict(state)
    data = {k: v.to(args.device) for k, v in rl_batch().items()}
    paths = {n: m.objective.path("train", m.head_outputs_needed()) for n, m in models.items()}
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    times: dict[str, list[float]] = {k: [] for k in models}
    first: dict[str, float] = {}
    for r in range(args.repeats + 2):
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            sync()
            start = time.perf_counter()
            with mock.patch.dict(os.environ, EAGER_ENV if name in EAGER else COMPILED_ENV):
                model.compute_loss(data).total.backward()
            sync()
            if r >= 2:  # warm-up
                times[name].append(time.perf_counter() - start)
            elif r == 0:
                first[name] = time.perf_counter() - start
    print(
        f"{platform.machine()} · torch {torch.__version__} · {torch.get_num_threads()} threads · "
        f"device {args.device} · repeats {args.repeats} · {int((data['labels'] != -100).sum())} valid "
        f"tokens · head_chunk_size {args.chunk or 'default'}"
    )
    base, best = statistics.median(times["ce"]), min(times["ce"])
    print("| variant | path | median step (ms) | / ce | fastest step (ms) | / ce | median of round ratios |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, t in times.items():
        med = statistics.median(t)
        paired = statistics.median(a / b for a, b in zip(t, times["ce"], strict=True))
        print(
            f"| {name} | {paths[name]} | {med * 1e3:.1f} | {med / base:.3f} | {min(t) * 1e3:.1f} | "
            f"{min(t) / best:.3f} | {paired:.3f} |"
        )
    print(
        "first step (ms, with the entropy kernels' compile): "
        + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in first.items())
    )


if __name__ == "__main__":
    main()
