"""`log_sum_sq_probs` (``log Σ_v p_v²`` per token, WPO's weights read it) against ``lse(2z) − 2 lse(z)`` of
the full float64 logits: token chunks, temperature, bias, ignored positions; a bf16 weight read in blocks;
no gradient and no ``[tokens × V]`` tensor; the vocabulary-parallel head on one process and on 2 gloo
processes holding uneven rows (one of them none)."""

from __future__ import annotations

import pytest
import torch

from lit_losses.heads import FusedLMHead, VocabParallelHead, log_sum_sq_probs
from tests.loss.test_preference import LargestFloatTensor
from tests.parallel.launch import launch

V, D = 37, 5


def problem(seed: int = 0, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    weight = scale * torch.randn(V, D, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    hidden = torch.randn(3, 6, D, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (3, 6), generator=g)
    targets[0, 1] = targets[2, 5] = -100
    return weight, bias, hidden, targets


def naive(hidden, weight, bias, targets, temperature=1.0):
    """``log Σ_v p_v²`` from the materialized logits ``z / T`` (float64), 0 at ignored positions."""
    z = hidden.double() @ weight.double().T
    z = (z if bias is None else z + bias.double()) / temperature
    return torch.where(targets != -100, torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1), 0.0)


@pytest.mark.parametrize("chunk_size", [None, 1, 4])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [True, False])
def test_equals_the_full_logits_value(chunk_size, temperature, with_bias):
    weight, bias, hidden, targets = problem()
    bias = bias if with_bias else None
    head = FusedLMHead(weight, bias, chunk_size=chunk_size, temperature=temperature)
    got = log_sum_sq_probs(head, hidden, targets)
    expected = naive(hidden, weight, bias, targets, temperature)
    assert got.dtype == torch.float64 and got.shape == targets.shape
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-13)
    valid = targets != -100
    assert bool((got[~valid] == 0).all()) and bool((got[valid] < 0).all())
    assert bool((got[valid] >= -torch.log(torch.tensor(float(V))) - 1e-12).all())  # ≥ −log V (uniform)


def test_extreme_logits_stay_finite_and_exact():
    weight, bias, hidden, targets = problem(scale=200.0)  # logits of size ~10³: naive exp would overflow
    got = log_sum_sq_probs(FusedLMHead(weight, bias, chunk_size=2), hidden, targets)
    torch.testing.assert_close(got, naive(hidden, weight, bias, targets), rtol=1e-12, atol=1e-12)
    assert bool(torch.isfinite(got).all())


def test_a_bf16_weight_is_read_in_blocks_in_the_compute_dtype():
    weight, _, hidden, targets = problem()
    weight, hidden = weight.to(torch.bfloat16), hidden.float()
    head = FusedLMHead(weight, chunk_size=2)  # cast blocks of ≤ chunk·V/D = 14 rows: 3 blocks
    got = log_sum_sq_probs(head, hidden, targets)
    assert got.dtype == torch.float32  # the compute dtype: promote(hidden, weight, fp32)
    torch.testing.assert_close(got.double(), naive(hidden, weight, None, targets), rtol=1e-5, atol=1e-6)


def test_no_gradient_and_no_tokens_by_vocabulary_tensor():
    vocab, chunk = 32000, 16
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, 8, generator=g).to(torch.bfloat16).requires_grad_()
    hidden = torch.randn(4, 24, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (4, 24), generator=g)
    with LargestFloatTensor() as seen:
        got = log_sum_sq_probs(FusedLMHead(weight, chunk_size=chunk), hidden, targets)
    assert not got.requires_grad and got.grad_fn is None
    assert seen.largest <= chunk * vocab, seen.largest  # one [chunk, V] block; never [96, V]
    expected = naive(hidden.detach(), weight.detach(), None, targets)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_a_one_shard_vocabulary_parallel_head_gives_the_same_values():
    weight, bias, hidden, targets = problem()
    got = log_sum_sq_probs(VocabParallelHead(weight, bias, chunk_size=3, temperature=0.7), hidden, targets)
    torch.testing.assert_close(got, naive(hidden, weight, bias, targets, 0.7), rtol=1e-12, atol=1e-13)


def test_bad_inputs_are_the_heads_errors():
    weight, _, hidden, targets = problem()
    targets[1, 2] = V
    with pytest.raises(ValueError, match=r"target 37 is out of range for vocabulary size V=37"):
        log_sum_sq_probs(FusedLMHead(weight), hidden, targets)
    with pytest.raises(ValueError, match=r"targets shape \(3, 5\) does not match hidden.shape\[:-1\]"):
        log_sum_sq_probs(FusedLMHead(weight), hidden, targets[:, :5])


@pytest.mark.slow
@pytest.mark.ddp
def test_vocabulary_parallel_ranks_give_the_whole_vocabularys_value(tmp_path):
    launch("tests.parallel.collision_worker", 2, str(tmp_path), timeout=180)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    n = ranks[0]["n_valid"]
    for result in ranks:
        assert set(result["errors"]) == {"dtensor", "explicit", "explicit_empty"}
        for layout, error in result["errors"].items():
            assert error < 1e-12, (layout, error)
            assert torch.equal(result["values"][layout], ranks[0]["values"][layout]), layout
            # the targets' check (4 numbers), the maxima (n), the rescaled sums (2n): O(tokens)
            assert result["collectives"][layout] == [
                ("all_reduce", 4),
                ("all_reduce", n),
                ("all_reduce", 2 * n),
            ]
