"""`token_stats` (entropy, ``log Σ_v p_v²``, mean logit, top-1 per token in one no-grad pass) against the
full float64 logits: token chunks, vocabulary blocks, temperature, bias, ignored positions, ties of the
maximum (the first index wins, as ``torch.argmax``); the mean logit alone without a pass; the
vocabulary-parallel head on one process and on 2 gloo processes holding uneven rows (one of them none)."""

from __future__ import annotations

import pytest
import torch

from lit_losses.heads import FusedLMHead, VocabParallelHead, log_sum_sq_probs, token_stats
from tests.loss.test_preference import LargestFloatTensor
from tests.parallel.launch import launch

V, D = 37, 5
ALL = ("entropy", "log_sum_sq_probs", "mean_logit", "is_top1")


def problem(seed: int = 0, scale: float = 2.0):
    """Random float64 weights and hidden states; a third of the targets are the argmax (so that
    ``is_top1`` is neither all false nor all true), two are ignored."""
    g = torch.Generator().manual_seed(seed)
    weight = scale * torch.randn(V, D, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    hidden = torch.randn(3, 6, D, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (3, 6), generator=g)
    top = (hidden @ weight.T + bias).argmax(-1)
    targets.view(-1)[::3] = top.view(-1)[::3]
    targets[0, 1] = targets[2, 5] = -100
    return weight, bias, hidden, targets


def naive(hidden, weight, bias, targets, temperature=1.0) -> dict[str, torch.Tensor]:
    """Every statistic from the materialized logits ``z / T`` (float64), 0 at ignored positions."""
    z = hidden.double() @ weight.double().T
    z = (z if bias is None else z + bias.double()) / temperature
    valid = targets != -100
    logp = torch.log_softmax(z, -1)
    values = {
        "entropy": -(logp.exp() * logp).sum(-1),
        "log_sum_sq_probs": torch.logsumexp(2 * logp, -1),
        "mean_logit": z.mean(-1),
    }
    out = {name: torch.where(valid, value, 0.0) for name, value in values.items()}
    out["is_top1"] = valid & (z.argmax(-1) == targets)
    return out


def assert_stats(got, expected, names=ALL, rtol=1e-12, atol=1e-12) -> None:
    for name in names:
        value = getattr(got, name)
        if name == "is_top1":
            assert value.dtype == torch.bool and torch.equal(value, expected[name]), name
        else:
            torch.testing.assert_close(value.double(), expected[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("chunk_size", [None, 1, 4])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [True, False])
def test_every_statistic_equals_the_full_logits_value(chunk_size, temperature, with_bias):
    weight, bias, hidden, targets = problem()
    bias = bias if with_bias else None
    head = FusedLMHead(weight, bias, chunk_size=chunk_size, temperature=temperature)
    got = token_stats(head, hidden, targets, ALL)
    expected = naive(hidden, weight, bias, targets, temperature)
    assert_stats(got, expected)
    assert 0 < int(got.is_top1.sum()) < int((targets != -100).sum())
    assert got.entropy.dtype == torch.float64 and not got.entropy.requires_grad
    # WPO's value is the same field, bit for bit
    assert torch.equal(got.log_sum_sq_probs, log_sum_sq_probs(head, hidden, targets))


def test_only_the_requested_statistics_and_the_mean_logit_alone_without_a_pass():
    weight, bias, hidden, targets = problem(seed=1)
    head = FusedLMHead(weight, bias, chunk_size=2, temperature=0.8)
    expected = naive(hidden, weight, bias, targets, 0.8)
    got = token_stats(head, hidden, targets, ["entropy"])
    assert got.log_sum_sq_probs is None and got.mean_logit is None and got.is_top1 is None
    assert_stats(got, expected, ["entropy"])
    with LargestFloatTensor() as seen:
        alone = token_stats(head, hidden, targets, ["mean_logit"])
    assert seen.largest < 3 * 6 * V  # h · Σ_v W_v: no [tokens, V] block
    assert_stats(alone, expected, ["mean_logit"])


def test_ties_of_the_maximum_count_for_the_first_index_only():
    weight = torch.zeros(6, 2, dtype=torch.float64)
    weight[1] = weight[4] = torch.tensor([1.0, 0.0])  # rows 1 and 4 tie for the maximum when h = (1, 0)
    hidden = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]], dtype=torch.float64)
    targets = torch.tensor([[1, 4, 0]])
    for chunk in (None, 1):  # 4 in another block than 1, too: blocks of ≤ chunk·V/D rows with a cast weight
        got = token_stats(FusedLMHead(weight, chunk_size=chunk), hidden, targets, ["is_top1"])
        assert got.is_top1.tolist() == [[True, False, False]]
        assert got.is_top1.tolist() == (torch.argmax(hidden @ weight.T, -1) == targets).tolist()


def test_extreme_logits_stay_finite_and_exact():
    weight, bias, hidden, targets = problem(scale=200.0)  # logits of size ~10³: naive exp would overflow
    got = token_stats(FusedLMHead(weight, bias, chunk_size=2), hidden, targets, ALL)
    assert_stats(got, naive(hidden, weight, bias, targets), rtol=1e-12, atol=1e-10)
    assert bool(torch.isfinite(got.entropy).all())


def test_a_bf16_weight_is_read_in_blocks_in_the_compute_dtype_without_a_tokens_by_vocabulary_tensor():
    vocab, chunk = 4096, 8
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, 8, generator=g).to(torch.bfloat16)
    hidden = torch.randn(4, 12, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (4, 12), generator=g)
    with LargestFloatTensor() as seen:
        got = token_stats(FusedLMHead(weight, chunk_size=chunk), hidden, targets, ALL)
    assert seen.largest <= chunk * vocab, seen.largest  # one [chunk, V] block; never [48, V]
    assert got.entropy.dtype == torch.float32 and got.entropy.grad_fn is None
    expected = naive(hidden.detach(), weight, None, targets)
    assert_stats(got, expected, ("entropy", "log_sum_sq_probs", "mean_logit"), rtol=1e-5, atol=1e-5)


def test_a_one_shard_vocabulary_parallel_head_gives_the_same_values():
    weight, bias, hidden, targets = problem()
    head = VocabParallelHead(weight, bias, chunk_size=3, temperature=0.7)
    assert_stats(token_stats(head, hidden, targets, ALL), naive(hidden, weight, bias, targets, 0.7))
    alone = token_stats(head, hidden, targets, ["mean_logit"])
    assert_stats(alone, naive(hidden, weight, bias, targets, 0.7), ["mean_logit"])


def test_bad_inputs_are_named():
    weight, _, hidden, targets = problem()
    with pytest.raises(ValueError, match=r"unknown token statistics \['logits'\]; known: \['entropy'"):
        token_stats(FusedLMHead(weight), hidden, targets, ["entropy", "logits"])
    targets[1, 2] = V
    with pytest.raises(ValueError, match=r"target 37 is out of range for vocabulary size V=37"):
        token_stats(FusedLMHead(weight), hidden, targets, ["entropy"])


@pytest.mark.slow
@pytest.mark.ddp
def test_vocabulary_parallel_ranks_give_the_whole_vocabularys_statistics(tmp_path):
    launch("tests.parallel.token_statistics_worker", 2, str(tmp_path), timeout=180)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for result in ranks:
        assert set(result["errors"]) == {"dtensor", "explicit", "explicit_empty"}
        for layout, errors in result["errors"].items():
            assert errors["top1_mismatches"] == 0 and errors["top1_hits"] > 0, (layout, errors)
            for name in ("entropy", "log_sum_sq_probs", "mean_logit", "mean_logit_alone"):
                assert errors[name] < 1e-12, (layout, name, errors[name])
            for name, value in result["values"][layout].items():
                assert torch.equal(value, ranks[0]["values"][layout][name]), (layout, name)
