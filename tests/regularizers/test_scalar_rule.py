"""The one rule for scalar terms (`scalar_value`), in every aggregation mode, split or not."""

from __future__ import annotations

import pytest
import torch

from lit_losses.aggregation import AGG_MODES, GlobalStats, count_masks
from tests.helpers import EmbeddingLM, random_batch

TOL = dict(rtol=1e-12, atol=1e-12)
NORM = 7.0  # the constant C of seq-mean-token-sum-norm (model.loss_agg_norm)


def per_mode(mode: str):
    """A design-form term that is, in ``mode``, this micro-batch's value of ``L_t = log p_t²``."""

    def term(data, logprobs_list):
        seqs = [lp.square() for lp in logprobs_list if len(lp)]  # sequences with a target
        if mode == "token-mean":
            value = torch.cat(seqs).mean()
        elif mode == "token-sum":
            value = torch.cat(seqs).sum()
        elif mode == "seq-mean-token-sum":
            value = torch.stack([s.sum() for s in seqs]).mean()
        elif mode == "seq-mean-token-sum-norm":
            value = torch.stack([s.sum() for s in seqs]).mean() / NORM
        else:
            value = torch.stack([s.mean() for s in seqs]).mean()
        return value, {}

    return term


def model_for(mode: str, rule: str) -> EmbeddingLM:
    torch.manual_seed(0)
    spec = {"name": "r", "fn": per_mode(mode), "agg": mode, "scalar": rule}
    norm = NORM if mode == "seq-mean-token-sum-norm" else None
    model = EmbeddingLM(regularizers=[spec], loss_agg=mode, head_backend="chunked", loss_agg_norm=norm)
    return model.double()


def micro_batches(batch: dict, splits=((0, 1), (1, 4))) -> list[dict]:
    """Row ranges of ``batch`` as the micro-batches of one step, each with the step's global counts."""
    total = count_masks(batch)
    out = []
    for i, (a, b) in enumerate(splits):
        mb = {k: v[a:b] for k, v in batch.items()}
        mb["global_stats"] = GlobalStats(total, float(len(splits)), count_masks(mb), i, len(splits))
        out.append(mb)
    return out


def step_value(model: EmbeddingLM, batches: list[dict]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Σ over the micro-batches of the regularizer's part, and its parameter gradient."""
    total = sum(model.compute_loss(b).regularizer_total for b in batches)
    return total, list(torch.autograd.grad(total, list(model.parameters())))


def by_hand(model: EmbeddingLM, batch: dict, mode: str) -> torch.Tensor:
    logp, _, _, mask = model.reference_head(batch)
    rows = [logp[r][mask[r]].square() for r in range(len(mask)) if mask[r].any()]
    if mode == "token-mean":
        return torch.cat(rows).mean()
    if mode == "token-sum":
        return torch.cat(rows).sum()
    if mode == "seq-mean-token-sum":
        return torch.stack([s.sum() for s in rows]).mean()
    if mode == "seq-mean-token-sum-norm":
        return torch.stack([s.sum() for s in rows]).mean() / NORM
    return torch.stack([s.mean() for s in rows]).mean()


@pytest.mark.parametrize("mode", AGG_MODES)
def test_share_rule_makes_a_split_step_equal_the_whole_batch(mode):
    batch = random_batch(B=4, T=7, seed=3)
    model = model_for(mode, "share")
    value, grads = step_value(model, micro_batches(batch))
    expected = by_hand(model, batch, mode)
    torch.testing.assert_close(value, expected, **TOL)
    for g, r in zip(grads, torch.autograd.grad(expected, list(model.parameters())), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_sum_rule_is_the_design_semantics_the_sum_of_the_calls(mode):
    batch = random_batch(B=4, T=7, seed=3)
    model = model_for(mode, "sum")
    batches = micro_batches(batch)
    value, grads = step_value(model, batches)
    expected = sum(by_hand(model, {k: v for k, v in b.items() if k != "global_stats"}, mode) for b in batches)
    torch.testing.assert_close(value, expected, **TOL)
    for g, r in zip(grads, torch.autograd.grad(expected, list(model.parameters())), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rule", ["share", "sum"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_one_micro_batch_uses_the_value_returned(mode, rule):
    """E.g. ``token-sum`` with a legacy scalar: 10.35 returned is 10.35 used (never × tokens)."""
    batch = random_batch(B=3, T=7, seed=5)
    model = model_for(mode, rule)
    out = model.compute_loss(batch)
    returned = per_mode(mode)(*_reference_inputs(model, batch))[0]
    torch.testing.assert_close(out.terms["r"]["value"], returned.detach(), **TOL)
    torch.testing.assert_close(out.regularizer_total, returned, **TOL)
    grads = torch.autograd.grad(out.regularizer_total, list(model.parameters()))
    for g, r in zip(grads, torch.autograd.grad(returned, list(model.parameters())), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def _reference_inputs(model, batch):
    logp, _, _, mask = model.reference_head(batch)
    return [None] * len(mask), [logp[r][mask[r]] for r in range(len(mask))]


def test_scalar_rule_is_validated():
    from lit_losses.errors import ConfigError
    from lit_losses.regularizers import RegularizerSpec

    with pytest.raises(
        ConfigError, match=r"regularizer 'r'.scalar 'summ' is not one of .*did you mean 'sum'"
    ):
        RegularizerSpec(name="r", scalar="summ")
