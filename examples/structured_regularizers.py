"""Structured regularizers: a training loop with three named, weighted regularizers.

Each regularizer is a plain function ``fn(data, logprobs_list) -> (loss, metrics)``: ``data`` holds one
`Datum` per sequence and ``logprobs_list`` one aligned 1-D tensor of log-probabilities per datum.

- ``topology``: a non-differentiable count (the cycle rank, i.e. Betti-1, of each sequence's token
  transition graph), CPU-bound, offloaded to a thread with the ``run_in_executor`` flag. It adds to the
  loss value only (one warning says so).
- ``sparsity``: an L1 penalty on the log-probabilities (differentiable).
- ``kb_consistency``: an async query of a (simulated) knowledge base, awaited concurrently.

The same list runs in a Lightning fit (``RegularizedLM(regularizers=...)``: base cross-entropy plus the
three terms) and in a hand-written loop with ``forward_backward_custom_async`` (the structured-regularizer
call).

    python examples/structured_regularizers.py
"""

from __future__ import annotations

import asyncio
import itertools
import warnings

import lightning as L
import numpy as np
import torch

from lit_losses import GlobalStatsLoader, TinyLM

VOCAB = 64


def topological_consistency(data, logprobs_list):
    """Mean over sequences of the cycle rank ``E − V + C`` of the token transition graph (union-find)."""
    betti_1_values = []
    for datum in data:
        tokens = datum.model_input.tolist()
        edges = {tuple(sorted(e)) for e in itertools.pairwise(tokens) if e[0] != e[1]}
        nodes = sorted(set(tokens))
        parent = {n: n for n in nodes}

        def find(n, parent=parent):
            while parent[n] != n:
                n = parent[n]
            return n

        for a, b in edges:
            parent[find(a)] = find(b)
        components = len({find(n) for n in nodes})
        betti_1_values.append(len(edges) - len(nodes) + components)
    loss = torch.tensor(float(np.mean(betti_1_values)))
    return loss, {"beta_1_mean": float(np.mean(betti_1_values)), "beta_1_max": max(betti_1_values)}


def sparsity_penalty(data, logprobs_list):
    """Mean over sequences of ‖log p‖₁: encourages peaked, confident predictions."""
    l1_norms = [torch.norm(logprobs, p=1) for logprobs in logprobs_list]
    mean_l1 = torch.stack(l1_norms).sum() / len(logprobs_list)
    return mean_l1, {"l1_mean": mean_l1.item()}


async def verify_claim(claim: int) -> tuple[bool, float]:
    await asyncio.sleep(0.005)  # stands for a knowledge-base round trip
    return claim % 3 != 0, (claim % 5) / 5


async def knowledge_consistency(data, logprobs_list):
    """Penalize sequences whose first target the knowledge base does not verify."""
    claims = [
        int(d.loss_fn_inputs["target_tokens"][0]) for d in data if len(d.loss_fn_inputs["target_tokens"])
    ]
    results = await asyncio.gather(*(verify_claim(c) for c in claims))
    penalties = [0.0 if verified else confidence for verified, confidence in results]
    loss = torch.tensor(float(np.mean(penalties)) if penalties else 0.0)
    return loss, {"verified_ratio": sum(v for v, _ in results) / max(len(results), 1)}


regularizers = [
    {"fn": topological_consistency, "weight": 0.1, "name": "topology", "run_in_executor": True},
    {"fn": sparsity_penalty, "weight": 0.01, "name": "sparsity"},
    {"fn": knowledge_consistency, "weight": 0.05, "name": "kb_consistency"},  # async
]


def micro_batches(n: int = 6, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (4, 16), generator=g)
        labels = torch.roll(ids, -1, dims=1)
        labels[:, -1] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def tiny_model() -> TinyLM:
    L.seed_everything(0, verbose=False)
    return TinyLM(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=2, regularizers=regularizers)


def lightning_fit(steps: int = 3) -> dict:
    model = tiny_model()
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, GlobalStatsLoader(micro_batches(), batch_size=None))
    return model.telemetry


async def manual_loop(num_epochs: int = 2) -> list[dict]:
    """The hand-written loop: forward/backward with the structured regularizers, then an optimizer step."""
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    results = []
    for epoch in range(num_epochs):
        for batch in micro_batches(2, seed=epoch):
            result = await model.forward_backward_custom_async(batch, regularizers=regularizers)
            optimizer.step()
            optimizer.zero_grad()
            print(f"Total loss: {result['loss_total']:.4f}")
            for name, reg_metrics in result["regularizers"].items():
                value, contribution = reg_metrics["value"], reg_metrics["contribution"]
                print(f"  {name}: value={value:.4f}, contribution={contribution:.4f}")
            results.append(result)
    return results


def main() -> tuple[dict, list[dict]]:
    warnings.filterwarnings("ignore", message=".*adds to the loss value only")  # topology, kb: counts
    telemetry = lightning_fit()
    print("Lightning fit, last step:", telemetry)
    return telemetry, asyncio.run(manual_loop())


if __name__ == "__main__":
    main()
