"""The design's examples, as written (its four examples and its legacy ``custom_loss``).

Only what the design leaves to the user is defined here: the domain helpers
(``extract_reasoning_graphs``, ``extract_claims``, ``verify_claim``) and the knowledge base they query
(a local aiohttp server, `serve_knowledge_base`). ``types.Datum`` is `lit_losses.regularizers.Datum`.
"""

from __future__ import annotations

import asyncio
import math
import socket
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import List  # noqa: UP035 (the design's annotations, as written)

import aiohttp
import numpy as np
import torch
from aiohttp import web
from gudhi import RipsComplex  # Topological data analysis

from lit_losses.regularizers import Datum

types = SimpleNamespace(Datum=Datum)


# ---- the user's domain helpers (the design leaves them undefined) ----------------------------------
def extract_reasoning_graphs(data):
    """One graph per datum: its input tokens as points on the unit circle (angle = token / 11 turns)."""
    graphs = []
    for datum in data:
        tokens = torch.as_tensor(datum.model_input).double()
        angles = 2 * math.pi * tokens / 11
        points = np.stack([np.cos(angles.numpy()), np.sin(angles.numpy())], axis=1)
        graphs.append(SimpleNamespace(node_embeddings=points))
    return graphs


def extract_claims(data):
    """One claim per datum: its first target token (a datum without targets claims nothing: -1)."""
    claims = []
    for datum in data:
        targets = datum.loss_fn_inputs["target_tokens"]
        claims.append(int(targets[0]) if len(targets) else -1)
    return claims


KB_URL = "http://127.0.0.1:{port}/verify"
KB_PORT: list[int] = []


def kb_verdict(claim: int) -> dict:
    """The knowledge base's answer: even claims are verified; others get confidence (claim mod 7) / 7."""
    return {"verified": claim % 2 == 0, "confidence": (claim % 7) / 7}


async def verify_claim(session, claim):
    async with session.get(KB_URL.format(port=KB_PORT[0]), params={"claim": str(claim)}) as response:
        return SimpleNamespace(**(await response.json()))


def serve_knowledge_base() -> tuple[int, Callable[[], None]]:
    """Start the knowledge base on 127.0.0.1 (a free port) in a thread; returns ``(port, stop)``."""

    async def verify(request):
        return web.json_response(kb_verdict(int(request.query["claim"])))

    app = web.Application()
    app.router.add_get("/verify", verify)
    runner, sock = web.AppRunner(app), socket.socket()
    sock.bind(("127.0.0.1", 0))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="knowledge-base", daemon=True).start()

    async def start():
        await runner.setup()
        await web.SockSite(runner, sock).start()

    asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
    KB_PORT[:] = [sock.getsockname()[1]]

    def stop():
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)

    return KB_PORT[0], stop


# ---- Example 1: Topological Consistency Regularizer (as written) -----------------------------------
def topological_consistency(data: List[types.Datum], logprobs_list: List[torch.Tensor]):  # noqa: UP006
    """
    Penalize reasoning structures that lack topological coherence.
    Uses persistent homology to measure structural complexity.
    """
    # Extract reasoning graph from outputs (domain-specific)
    graphs = extract_reasoning_graphs(data)

    # Compute Betti numbers via persistent homology
    betti_losses = []
    betti_1_values = []

    for graph in graphs:
        rips = RipsComplex(points=graph.node_embeddings)
        st = rips.create_simplex_tree(max_dimension=2)
        st.compute_persistence()

        # Penalize high Betti-1 (indicates loops/cycles in reasoning)
        betti_1 = len(st.persistence_intervals_in_dimension(1))
        betti_1_values.append(betti_1)
        betti_losses.append(torch.tensor(float(betti_1)))

    loss = torch.mean(torch.stack(betti_losses))
    metrics = {
        "beta_1_mean": sum(betti_1_values) / len(betti_1_values),
        "beta_1_max": max(betti_1_values),
    }

    return loss, metrics


# ---- Example 2: Sparsity Penalty (as written) ------------------------------------------------------
def sparsity_penalty(data: List[types.Datum], logprobs_list: List[torch.Tensor]):  # noqa: UP006
    """
    L1 regularization on log-probability magnitudes.
    Encourages peaked, confident predictions.
    """
    l1_norms = []
    for logprobs in logprobs_list:
        l1_norm = torch.norm(logprobs, p=1)
        l1_norms.append(l1_norm)

    total_l1 = torch.sum(torch.stack(l1_norms))
    mean_l1 = total_l1 / len(logprobs_list)

    metrics = {
        "l1_total": total_l1.item(),
        "l1_mean": mean_l1.item(),
    }

    return mean_l1, metrics


# ---- Example 3: Async Knowledge Base Query (as written) --------------------------------------------
async def knowledge_consistency(data: List[types.Datum], logprobs_list: List[torch.Tensor]):  # noqa: UP006
    """
    Async regularizer that queries an external knowledge base.
    Penalizes outputs inconsistent with verified facts.
    """
    async with aiohttp.ClientSession() as session:
        # Extract claims from model outputs
        claims = extract_claims(data)

        # Query KB asynchronously
        verification_tasks = [verify_claim(session, claim) for claim in claims]
        results = await asyncio.gather(*verification_tasks)

    # Penalize unverified claims
    penalties = []
    verified_count = 0
    for result in results:
        if result.verified:
            verified_count += 1
            penalties.append(torch.tensor(0.0))
        else:
            penalties.append(torch.tensor(result.confidence))

    loss = torch.mean(torch.stack(penalties))
    metrics = {
        "verified_ratio": verified_count / len(results),
        "penalty_mean": loss.item(),
    }

    return loss, metrics


# ---- Example 4's regularizers (as written) and the legacy callback of the design's docs -------------
regularizers = [
    {"fn": topological_consistency, "weight": 0.1, "name": "topology"},
    {"fn": sparsity_penalty, "weight": 0.01, "name": "sparsity"},
    {"fn": knowledge_consistency, "weight": 0.05, "name": "kb_consistency"},  # async
]


def custom_loss(data, logprobs_list):
    loss = torch.mean(torch.stack([torch.mean(lp) for lp in logprobs_list]))
    metrics = {"custom_metric": loss.item()}
    return loss, metrics
