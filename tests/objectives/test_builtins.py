"""Each built-in base loss against its float64 formula (value and gradients w.r.t. hidden states, the
output weight and bias, 1e-10), on the fused pointwise path and on the general path, with ignored
positions, packed rows, per-token and per-sequence weights, in every aggregation mode."""

from __future__ import annotations

import pytest
import torch

from lit_losses.aggregation import AGG_MODES, GlobalStats
from lit_losses.heads import FusedLMHead
from lit_losses.loss.objective import Objective
from lit_losses.objectives import BASE_LOSSES, builtins
from lit_losses.regularizers import RegularizerSet
from tests.objectives import reference

B, T, V, D = 3, 10, 17, 6
NORM = 8.0
TOL = dict(rtol=1e-10, atol=1e-12)


def rl_batch(seed: int = 0, weighted: bool = True) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed batch (3 rows, 2–3 documents each, padding, prompt positions without label) with the RL
    keys; garbage (not 0) at ignored positions, which must never matter."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (B, T), generator=g)
    segment_ids = torch.tensor(
        [[1, 1, 1, 2, 2, 2, 2, 3, 3, 0], [1, 1, 1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 2, 2, 2, 2, 2, 2, 0, 0]]
    )
    labels[segment_ids == 0] = -100
    labels[:, 0] = -100  # prompt positions
    labels[1, 5] = -100
    labels[2, 7] = -100  # the last token of a document has no target
    position_ids = torch.zeros_like(segment_ids)
    for b in range(B):
        for t in range(1, T):
            position_ids[b, t] = (
                position_ids[b, t - 1] + 1 if segment_ids[b, t] == segment_ids[b, t - 1] else 0
            )
    garbage = torch.full((B, T), 123.0, dtype=torch.float64)
    valid = labels != -100

    def values(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, x, garbage)

    batch = {
        "labels": labels,
        "segment_ids": segment_ids,
        "position_ids": position_ids,
        "sampling_logprobs": values(-torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 1.5),
        "advantages": values(torch.randn(B, T, generator=g, dtype=torch.float64)),
    }
    if weighted:
        batch["loss_weights"] = values(torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5)
        seq = segment_ids + 10 * torch.arange(B)[:, None]
        per_sequence = torch.rand(int(seq.max()) + 1, generator=g, dtype=torch.float64) * 2
        batch["sample_weights"] = values(per_sequence[seq])
    weight = torch.randn(V, D, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True)
    hidden = torch.randn(B, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    return batch, weight, bias, hidden


def expected_total(name: str, mode: str, batch: dict, weight, bias, hidden) -> torch.Tensor:
    labels = batch["labels"]
    lp = reference.head_logprobs(hidden, weight, bias, labels)
    loss = reference.per_token(
        name, lp, batch["sampling_logprobs"], batch["advantages"], reference.ARGS[name]
    )
    if "loss_weights" in batch:
        loss = loss * batch["loss_weights"]
    return reference.aggregate(loss, labels, mode, batch["segment_ids"], NORM, batch.get("sample_weights"))


def objective_for(name: str, mode: str, terms=()) -> Objective:
    return Objective(
        RegularizerSet(list(terms), default_agg=mode),
        mode,
        base_loss=name,
        base_loss_args=reference.ARGS[name],
        loss_agg_norm=NORM,
    )


@pytest.mark.parametrize("path", ["fused", "general"])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", sorted(reference.ARGS))
def test_base_loss_matches_its_float64_formula_on_both_paths(name, mode, path):
    batch, weight, bias, hidden = rl_batch(
        seed=10 * sorted(reference.ARGS).index(name) + AGG_MODES.index(mode)
    )
    objective = objective_for(name, mode)
    stage = "train" if path == "fused" else "val"
    if name != "cross_entropy":
        assert objective.path(stage, objective.head_outputs_needed()) == path
    head = FusedLMHead(weight, bias, backend="chunked", chunk_size=4)
    out = objective(head, hidden, batch, GlobalStats.local_only(batch), step=0, stage=stage)
    expected = expected_total(name, mode, batch, weight, bias, hidden)
    torch.testing.assert_close(out.total, expected, **TOL)
    torch.testing.assert_close(out.base, expected.detach(), **TOL)
    grads = torch.autograd.grad(out.total, (hidden, weight, bias))
    for g, r in zip(grads, torch.autograd.grad(expected, (hidden, weight, bias)), strict=True):
        torch.testing.assert_close(g, r, **TOL)


@pytest.mark.parametrize("name", sorted(reference.ARGS))
def test_fused_and_general_paths_agree_with_regularizers_and_every_backend(name):
    """ppo-style full objective: base + kl_reference + entropy, fused (chunked) vs general (a non-pointwise
    copy of the terms) vs the naive backend (per-token outputs)."""
    batch, weight, bias, hidden = rl_batch(seed=7)
    batch["ref_logprobs"] = batch["sampling_logprobs"] + 0.3
    terms = [
        {"name": "kl_reference", "weight": 0.2},
        {"name": "entropy", "weight": 0.05, "args": {"mode": "bonus"}},
    ]
    results = {}
    for label, backend, pointwise in (
        ("fused", "chunked", None),
        ("general", "chunked", False),
        ("naive", "naive", None),
    ):
        specs = [{**t, "pointwise": pointwise} if pointwise is not None else t for t in terms]
        objective = objective_for(name, "seq-mean-token-mean", specs)
        if label == "general":
            assert objective.path("train", objective.head_outputs_needed()) == "general"
        head = FusedLMHead(weight, bias, backend=backend, chunk_size=3)
        out = objective(head, hidden, batch, GlobalStats.local_only(batch), step=0, stage="train")
        results[label] = (out.total, torch.autograd.grad(out.total, (hidden, weight, bias)))
    lp = reference.head_logprobs(hidden, weight, bias, batch["labels"])
    entropy = reference.head_entropy(hidden, weight, bias, batch["labels"])
    d = batch["ref_logprobs"] - lp
    kl = torch.exp(d) - d - 1
    mask_seq = dict(labels=batch["labels"], mode="seq-mean-token-mean", segment_ids=batch["segment_ids"])
    expected = expected_total(name, "seq-mean-token-mean", batch, weight, bias, hidden)
    expected = (
        expected + 0.2 * reference.aggregate(kl, **mask_seq) - 0.05 * reference.aggregate(entropy, **mask_seq)
    )
    ref_grads = torch.autograd.grad(expected, (hidden, weight, bias))
    for total, grads in results.values():
        torch.testing.assert_close(total, expected, **TOL)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, **TOL)


def test_ppo_clips_where_the_ratio_leaves_its_range_and_the_advantage_says_so():
    """The PPO gradient is 0 exactly at the tokens where the clipped term is the minimum."""
    lp = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5], dtype=torch.float64)).requires_grad_()
    q = torch.log(torch.tensor([0.25, 0.25, 1.0, 1.0, 0.5], dtype=torch.float64))  # r = 2, 2, 0.5, 0.5, 1
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    loss, metrics = builtins.ppo(lp, {"sampling_logprobs": q, "advantages": adv})
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    # r=2, A>0: clipped at 1.2 (no gradient); r=2, A<0: unclipped; r=0.5, A>0: unclipped; r=0.5, A<0: clipped
    assert grad.tolist() == pytest.approx([0.0, 2.0, -0.5, 0.0, -1.0])
    assert metrics["clip_fraction"].tolist() == [True, False, False, True, False]


def test_cispo_never_zeros_a_gradient_it_bounds_the_coefficient():
    lp = torch.log(torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64)).requires_grad_()
    q = torch.log(torch.tensor([0.05, 0.5, 1.0], dtype=torch.float64))  # r = 10, 1, 0.5
    adv = torch.ones(3, dtype=torch.float64)
    loss, metrics = builtins.cispo(lp, {"sampling_logprobs": q, "advantages": adv}, 0.0, 4.0)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    assert grad.tolist() == pytest.approx([-4.0, -1.0, -0.5])  # −clip(r) · A
    assert metrics["clip_fraction"].tolist() == [True, False, False]


TRL_ARGS = {"epsilon_low", "epsilon_high", "delta", "importance_sampling_level"}
"""The parameters TRL's and Liger-Kernel's GRPO losses add to Tinker's (tests/objectives/test_trl.py)."""


def test_builtins_document_tinker_and_their_parameters():
    for name in reference.ARGS:
        entry = BASE_LOSSES[name]
        assert "Tinker" in entry.fn.__doc__, name
        assert set(reference.ARGS[name]) <= set(entry.parameters), name
        assert set(entry.parameters) - set(reference.ARGS[name]) <= TRL_ARGS, name
    ppo = BASE_LOSSES["ppo"].bind(None)
    assert builtins.ppo_bounds(*list(ppo.values())[:4]) == (0.8, 1.2)  # Tinker's defaults
    assert BASE_LOSSES["cispo"].bind(None) == {
        "clip_low_threshold": 0.0,
        "clip_high_threshold": 4.0,
        "importance_sampling_level": "token",
    }
