"""``executor: process``: CPU-bound terms in worker processes, with exact values and gradients."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from lit_losses.regularizers import executors
from tests.conftest import REPO
from tests.helpers import EmbeddingLM, random_batch


# Module-level: a process term must be picklable (by reference: the worker imports this module).
def sequence_squares(data, logprobs_list):
    """Σ_i Σ_t log p_it² / number of sequences (the design's form); never returns while ``stuck``."""
    if float(data[0]["stuck"]):
        time.sleep(3600)  # its worker is killed at the time limit
    value = torch.stack([lp.square().sum() for lp in logprobs_list]).sum() / len(data)
    return value, {"sequences": len(data)}


def lse_and_logprobs(ctx):
    """A scalar from two head outputs (ctx form): mean log p² + 0.1 · mean lse over valid tokens."""
    return ctx.logprobs[ctx.mask].square().mean() + 0.1 * ctx.lse[ctx.mask].mean()


def specs(executor: str) -> list[dict]:
    return [
        {"name": "seq", "fn": sequence_squares, "weight": 0.3, "executor": executor, "on_error": "skip"},
        {"name": "ctx", "fn": lse_and_logprobs, "weight": 0.2, "needs": ["lse"], "executor": executor},
    ]


def loss_and_grads(model, batch):
    out = model.compute_loss(batch)
    return out, torch.autograd.grad(out.total, list(model.parameters()))


@pytest.mark.slow
def test_process_terms_equal_main_thread_terms_and_a_stuck_one_is_killed_at_its_timeout(monkeypatch):
    batch = {**random_batch(B=4, T=7, seed=2), "stuck": torch.tensor(0.0)}
    results = []
    for executor in ("none", "process"):
        torch.manual_seed(0)
        model = EmbeddingLM(regularizers=specs(executor), head_backend="chunked").double()
        results.append((model, *loss_and_grads(model, batch)))
    (_, inline, g_inline), (model, offloaded, g_offloaded) = results
    torch.testing.assert_close(offloaded.total, inline.total, rtol=1e-12, atol=1e-12)
    for name in ("seq", "ctx"):
        torch.testing.assert_close(
            offloaded.terms[name]["value"], inline.terms[name]["value"], rtol=1e-12, atol=0
        )
        assert offloaded.terms[name]["custom"] == inline.terms[name]["custom"]
    for a, b in zip(g_offloaded, g_inline, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)

    monkeypatch.setattr(executors, "DEFAULT_TIMEOUT_S", 1.0)
    start = time.perf_counter()
    stuck = model.compute_loss({**batch, "stuck": torch.tensor(1.0)})
    assert time.perf_counter() - start < 5.0
    assert stuck.terms["seq"]["error"] == 1.0 and stuck.terms["ctx"]["error"] == 0.0
    again, _ = loss_and_grads(model, batch)  # its worker was killed; a new one serves the next step
    torch.testing.assert_close(again.total, inline.total, rtol=1e-12, atol=1e-12)
    model.regularizer_set.close()


@pytest.mark.slow
def test_a_script_without_main_guard_fails_with_one_clear_error(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(REPO)!r})
            import torch
            from tests.helpers import EmbeddingLM, random_batch
            from tests.regularizers.test_process_executor import sequence_squares
            spec = {{"name": "seq", "fn": sequence_squares, "executor": "process"}}
            model = EmbeddingLM(regularizers=[spec])
            model.compute_loss({{**random_batch(), "stuck": torch.tensor(0.0)}})
            """
        )
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "must guard its entry point with `if __name__ == '__main__':`" in proc.stderr.splitlines()[-1]
