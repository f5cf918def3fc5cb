"""``forward_backward_custom(data, loss_fn=None, regularizers=None)``: inputs, errors, manual optimization."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lit_losses.errors import ConfigError
from lit_losses.loss.custom import collate
from tests.helpers import EmbeddingLM, dr_grpo, quiet_trainer


def sparsity(data, logprobs_list):
    l1 = torch.stack([lp.abs().sum() for lp in logprobs_list]).sum() / len(logprobs_list)
    return l1, {"sequences": len(data)}


def nll(data, logprobs_list):
    return -torch.cat(logprobs_list).mean(), {}


def make_model(seed: int = 0) -> EmbeddingLM:
    torch.manual_seed(seed)
    return EmbeddingLM(head_backend="chunked").double()


SEQUENCES = [([1, 2, 3, 4], [2, 3, 4, 5]), ([6, 7], [7, -100]), ([8, 9, 10], [-100, -100, -100])]


def reference(model, sequences, weight: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``nll + weight · sparsity`` one sequence at a time (no padding), and its gradient."""
    logprobs_list = []
    for ids, targets in sequences:
        logp = torch.log_softmax(model.lm_head(torch.tanh(model.embed(torch.tensor(ids)))), -1)
        valid = [i for i, t in enumerate(targets) if t != -100]
        logprobs_list.append(logp[valid, [targets[i] for i in valid]])
    total = nll(None, logprobs_list)[0] + weight * sparsity(sequences, logprobs_list)[0]
    return total, list(torch.autograd.grad(total, list(model.parameters())))


@pytest.mark.parametrize("form", ["dicts", "design", "design-objects", "batch"])
def test_every_input_form_gives_the_per_sequence_reference(form):
    if form == "dicts":
        data = [{"input_ids": torch.tensor(i), "labels": torch.tensor(t)} for i, t in SEQUENCES]
    elif form in ("design", "design-objects"):  # the design's Datum: model_input + loss_fn_inputs
        data = []
        for ids, targets in SEQUENCES:
            weights = [float(t != -100) for t in targets]
            inputs = {"target_tokens": [max(t, 0) for t in targets], "weights": weights}
            item = {"model_input": ids, "loss_fn_inputs": inputs}
            data.append(SimpleNamespace(**item) if form == "design-objects" else item)
    else:
        data = collate([{"input_ids": torch.tensor(i), "labels": torch.tensor(t)} for i, t in SEQUENCES])
    model = make_model()
    expected, grads = reference(model, SEQUENCES, 0.1)
    metrics = model.forward_backward_custom(
        data, loss_fn=nll, regularizers=[{"fn": sparsity, "weight": 0.1, "name": "sparsity"}]
    )
    assert metrics["loss_total"] == pytest.approx(float(expected.detach()), rel=1e-12)
    assert metrics["regularizers"]["sparsity"]["custom"] == {"sequences": 3.0}  # one datum per item
    for p, r in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, r, rtol=1e-10, atol=1e-12)


def test_gradients_accumulate_over_calls_like_the_design():
    model = make_model()
    data = [{"input_ids": torch.tensor(i), "labels": torch.tensor(t)} for i, t in SEQUENCES]
    model.forward_backward_custom(data, nll)
    once = [p.grad.clone() for p in model.parameters()]
    model.forward_backward_custom(data, nll)
    for p, g in zip(model.parameters(), once, strict=True):
        torch.testing.assert_close(p.grad, 2 * g, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    ("data", "kwargs", "match"),
    [
        ([{"input_ids": [1, 2], "labels": [2, 3]}], {}, "give loss_fn or regularizers"),
        ([{"input_ids": [1, 2], "labels": [2, 3]}], {"regularizers": []}, "give loss_fn or regularizers"),
        (
            [{"input_ids": [1, 2], "labels": [2]}],
            {"loss_fn": nll},
            r"data\[0\]: 2 input tokens but 1 targets",
        ),
        ([{"tokens": [1, 2]}], {"loss_fn": nll}, r"data\[0\] must have 'input_ids' and 'labels'"),
        ([], {"loss_fn": nll}, "non-empty list of sequences"),
        ([{"input_ids": [[1, 2]], "labels": [[2, 3]]}], {"loss_fn": nll}, r"data\[0\].input_ids must be 1-D"),
    ],
)
def test_bad_calls_say_what_is_wrong(data, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_model().forward_backward_custom(data, **kwargs)


class ManualLM(EmbeddingLM):
    """Manual optimization: ``training_step`` drives the design's call."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.recorded: list[dict] = []

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.recorded.append(
            self.forward_backward_custom(
                batch, loss_fn=nll, regularizers=[{"fn": sparsity, "weight": 0.1, "name": "s"}]
            )
        )
        optimizer.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_manual_optimization_in_a_lightning_fit_takes_the_reference_step():
    L.seed_everything(0, verbose=False)
    model = ManualLM()
    before = [p.detach().clone() for p in model.parameters()]
    expected, grads = reference(model, SEQUENCES, 0.1)
    batch = collate([{"input_ids": torch.tensor(i), "labels": torch.tensor(t)} for i, t in SEQUENCES])
    quiet_trainer(max_steps=1).fit(model, DataLoader([batch], batch_size=None))
    assert model.recorded[0]["loss_total"] == pytest.approx(float(expected.detach()), rel=1e-6)
    for p, p0, g in zip(model.parameters(), before, grads, strict=True):
        torch.testing.assert_close(p.detach(), p0 - 0.1 * g, rtol=1e-5, atol=1e-6)


NORM = "seq-mean-token-sum-norm"


def token_nll(ctx):
    """A per-token matrix ``−log p_t`` (the ``fn(ctx)`` form), aggregated in the term's mode."""
    return -ctx.logprobs


def packed_batch() -> dict:
    """Two packed rows: 5 sequences with a target (row 0, segment 2 has none)."""
    return {
        "input_ids": torch.tensor([[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 1, 2, 3, 4]]),
        "labels": torch.tensor([[2, 3, -100, 5, -100, -100, 8], [9, 10, 1, -100, 3, 4, 5]]),
        "segment_ids": torch.tensor([[0, 0, 0, 1, 2, 2, 3], [0, 0, 0, 0, 1, 1, 1]]),
    }


@pytest.mark.parametrize("call", ["sync", "async"])
@pytest.mark.parametrize(
    ("model_agg", "term_agg"), [(NORM, None), ("token-mean", NORM)], ids=["model-mode", "term-agg"]
)
def test_seq_mean_token_sum_norm_uses_the_models_loss_agg_norm(model_agg, term_agg, call):
    torch.manual_seed(0)
    model = EmbeddingLM(head_backend="chunked", loss_agg=model_agg, loss_agg_norm=7.0).double()
    batch = packed_batch()
    logp = model.reference_head(batch)[0]
    mask = batch["labels"] != -100
    # loss_fn's scalar is used as returned; the per-token term is (1/S) Σ_s Σ_t L_t / C with S = 5, C = 7
    expected_term = dr_grpo(-logp, batch["labels"], batch["segment_ids"], 7.0)
    expected = -logp[mask].mean() + 0.5 * expected_term
    assert dr_grpo(torch.ones_like(logp), batch["labels"], batch["segment_ids"], 1.0) == 10 / 5  # 10 targets
    grads = torch.autograd.grad(expected, list(model.parameters()))
    spec = {"fn": token_nll, "weight": 0.5, "name": "tok", **({"agg": term_agg} if term_agg else {})}
    args = (batch, nll, [spec])
    if call == "sync":
        metrics = model.forward_backward_custom(*args)
    else:
        metrics = asyncio.run(model.forward_backward_custom_async(*args))
    assert metrics["regularizers"]["tok"]["value"] == pytest.approx(float(expected_term.detach()), rel=1e-12)
    assert metrics["loss_total"] == pytest.approx(float(expected.detach()), rel=1e-12)
    for p, r in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, r, rtol=1e-10, atol=1e-12)


def test_norm_mode_without_loss_agg_norm_names_the_regularizer():
    model = make_model()  # token-mean, no loss_agg_norm
    spec = {"fn": token_nll, "weight": 0.5, "name": "tok", "agg": NORM}
    with pytest.raises(
        ConfigError,
        match=r"^forward_backward_custom: model\.loss_agg_norm is required .*"
        r"used by regularizer 'tok'$",
    ):
        model.forward_backward_custom(packed_batch(), loss_fn=nll, regularizers=[spec])
    assert all(p.grad is None for p in model.parameters())  # refused before any backward
