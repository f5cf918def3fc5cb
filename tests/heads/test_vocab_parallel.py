"""The vocabulary-parallel head (`VocabParallelHead`): 2 and 3 gloo processes, each holding uneven rows of
the output projection (DTensor ``Shard(0)`` with and without bias, and an explicit layout that is not
torch.chunk's), against the unsharded naive float64 head; then its single-process contract.

The one-shard case (an unsharded weight) runs in `tests/heads/test_backend.py` with every other backend.
"""

from __future__ import annotations

import math

import pytest
import torch

from lit_losses.heads import FusedLMHead, VocabParallelHead, VocabShard, head_for
from lit_losses.heads.higher_order import DoubleBackwardError
from tests.parallel import vocab_parallel_worker as worker
from tests.parallel.launch import launch


@pytest.fixture(scope="module", params=[2, 3], ids=["2_ranks", "3_ranks"])
def ranks(request, tmp_path_factory):
    """Every rank's results of one run of the worker."""
    out = tmp_path_factory.mktemp(f"vocab_parallel_{request.param}")
    launch("tests.parallel.vocab_parallel_worker", request.param, str(out), timeout=180)
    return [torch.load(out / f"rank{r}.pt") for r in range(request.param)]


@pytest.mark.slow
@pytest.mark.ddp
def test_outputs_and_gradients_equal_the_unsharded_naive_head(ranks):
    for rank, result in enumerate(ranks):
        assert len(result["errors"]) == 3 * 8  # 3 layouts × (7 outputs/losses + forward_logits)
        for case, error in result["errors"].items():
            assert error < 1e-10, (rank, case, error)


@pytest.mark.slow
@pytest.mark.ddp
def test_outputs_are_identical_on_every_rank(ranks):
    for result in ranks[1:]:
        for layout, values in result["values"].items():
            for name, value in values.items():
                assert torch.equal(value, ranks[0]["values"][layout][name]), (layout, name)


@pytest.mark.slow
@pytest.mark.ddp
def test_communication_is_o_tokens_per_chunk(ranks):
    """Per call, one all-reduce of 4 numbers (the ranks' targets agree); per chunk, an all-reduce MAX of
    ``c`` and SUM of ``≤ 3c`` numbers; once per call, the all-reduce of ``∂/∂hidden`` ``[n, D]``; nothing
    else, and never anything of the vocabulary's size."""
    result = ranks[0]
    n, chunk = result["n_valid"], worker.CHUNK
    chunks = math.ceil(n / chunk)
    for layout in ("dtensor", "dtensor_no_bias", "explicit"):
        calls = [
            (phase.split("/", 1)[1], op, numel)
            for phase, op, numel in result["collectives"]
            if phase.startswith(layout + "/")
        ]
        assert {op for _, op, _ in calls} == {"all_reduce"}
        counts: dict[tuple[str, str], int] = {}
        for phase, _, numel in calls:
            kind = {4: "targets", n * worker.D: "hidden_grad"}.get(numel, "statistics")
            if kind == "statistics":
                assert numel <= 3 * min(chunk, n), (layout, phase, numel)
            counts[phase, kind] = counts.get((phase, kind), 0) + 1
        # per_token: forward statistics, the hidden gradient in backward; fused paths: all in forward
        assert counts == {
            ("__call__/forward", "targets"): 1,
            ("__call__/forward", "statistics"): 2 * chunks,
            ("per_token/backward", "hidden_grad"): 1,
            ("weighted_ce/forward", "targets"): 2,  # two calls: per-token and uniform weights
            ("weighted_ce/forward", "statistics"): 4 * chunks,
            ("weighted_ce/forward", "hidden_grad"): 2,
            ("pointwise_loss/forward", "targets"): 1,
            ("pointwise_loss/forward", "statistics"): 2 * chunks,
            ("pointwise_loss/forward", "hidden_grad"): 1,
        }
        total = sum(numel for _, _, numel in calls)
        assert total < 4 * n * worker.D + 8 * n * 3  # vs n·V = 1515 per gathered logits tensor


@pytest.mark.slow
@pytest.mark.ddp
def test_bad_layouts_are_refused_on_every_rank(ranks):
    for result in ranks:
        assert "cannot compute with an output projection sharded" in result["refusals"]["backend"]
        assert "do not tile [0, 101)" in result["refusals"]["overlap"]
        assert "gave the head different targets" in result["refusals"]["targets"]
        assert "FSDP's shard, not the vocabulary" in result["refusals"]["fsdp_shard"]


# ---- one process ------------------------------------------------------------------------------
def test_chunked_layout_is_torch_chunks():
    for vocab, size in [(101, 2), (101, 3), (10, 4), (8, 4)]:
        shards = [VocabShard.chunked(vocab, r, size) for r in range(size)]
        expected = [len(c) for c in torch.arange(vocab).chunk(size)]
        assert [s.size for s in shards if s.size] == expected
        assert [s.start for s in shards] == [min(r * -(-vocab // size), vocab) for r in range(size)]
        assert shards[-1].stop == vocab


def test_bad_shards_are_refused():
    with pytest.raises(ValueError, match=r"\[5, 12\) does not lie in \[0, 10\)"):
        VocabShard(5, 12, 10)
    with pytest.raises(ValueError, match="has no group but does not cover"):
        VocabParallelHead(torch.zeros(5, 3), shard=VocabShard(0, 5, 10))
    with pytest.raises(ValueError, match=r"rows \(4, 3\) do not match the vocabulary shard \[0, 5\)"):
        VocabParallelHead(torch.zeros(4, 3), shard=VocabShard(0, 5, 5))


def test_targets_are_checked_against_the_whole_vocabulary():
    head = VocabParallelHead(torch.zeros(7, 3))
    with pytest.raises(ValueError, match="target 7 is out of range for vocabulary size V=7"):
        head(torch.zeros(1, 3), torch.tensor([7]))


def test_forward_logits_refuses_to_drop_a_gradient():
    weight = torch.randn(7, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"under torch\.no_grad"):
        VocabParallelHead(weight).forward_logits(torch.randn(2, 3))
    with torch.no_grad():
        logits = VocabParallelHead(weight).forward_logits(torch.ones(2, 3))
    torch.testing.assert_close(logits, torch.ones(2, 3) @ weight.detach().T)


def test_double_backward_is_refused():
    weight = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    hidden = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    out = VocabParallelHead(weight)(hidden, torch.tensor([1, 2, 3, -100]), "entropy")
    with pytest.raises(DoubleBackwardError, match="vocabulary-parallel head"):
        torch.autograd.grad(out.entropy.sum(), hidden, create_graph=True)


def test_head_for_keeps_the_plain_head_for_an_unsharded_weight():
    head = head_for(torch.zeros(8, 4), None, backend="naive", chunk_size=3)
    assert type(head) is FusedLMHead and head.backend == "naive" and head.chunk_size == 3


def test_temperature_gives_the_outputs_and_gradients_of_the_scaled_logits():
    """``temperature=T`` on the vocabulary-parallel head (one shard here; each shard divides its own bias
    rows) equals `FusedLMHead`'s: every output, fused loss and gradient of the logits ``z / T``."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(29, 6, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(29, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 29, (3, 4), generator=g)
    targets[0, 1] = -100
    weights = torch.rand(3, 4, generator=g, dtype=torch.float64)

    def results(head):
        out = head(hidden, targets, ("logprobs", "lse", "entropy"))
        per_token = (out.logprobs + 0.5 * out.lse - 2 * out.entropy).sum()
        ce = head.weighted_ce(hidden, targets, weights)
        pointwise = head.pointwise_loss(hidden, targets, lambda s, e, lp, lse, ent: (lp * ent).sum(), True)
        return [
            value
            for loss in (per_token, ce, pointwise)
            for value in (loss, *torch.autograd.grad(loss, (hidden, weight, bias)))
        ]

    got = results(VocabParallelHead(weight, bias, chunk_size=5, temperature=1.7))
    want = results(FusedLMHead(weight, bias, chunk_size=5, temperature=1.7))
    plain = results(FusedLMHead(weight, bias, chunk_size=5))
    for g_, w_ in zip(got, want, strict=True):
        torch.testing.assert_close(g_, w_, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(got[0], plain[0])
