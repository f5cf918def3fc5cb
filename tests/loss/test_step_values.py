"""Logged step values against an independent computation: the schema, the totals, the gradient norms."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lit_losses import GlobalStatsLoader
from tests.helpers import EmbeddingLM, quiet_trainer, random_batch

W_SQ, W_L1, BASE_WEIGHT = 0.1, 0.01, 0.5


def square(ctx):
    return ctx.logprobs.square()


def l1_per_sequence(data, logprobs_list):
    """The design's sparsity penalty: mean over sequences of ‖log p‖₁."""
    l1 = torch.stack([lp.abs().sum() for lp in logprobs_list]).mean()
    return l1, {"l1": l1.item()}


class RecordStep(L.Callback):
    """The logged values and ``model.telemetry`` when the first optimizer step is logged."""

    def __init__(self) -> None:
        self.logged, self.telemetry = None, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.logged is None and trainer.global_step == 1:
            self.logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
            self.telemetry = pl_module.telemetry


def micro_batches() -> list[dict]:
    return [random_batch(B=2, T=6, seed=1), random_batch(B=3, T=6, seed=2)]  # 2 micro-batches, A = 2


def fit_one_step(loader_kind: str, **model_kwargs) -> tuple[EmbeddingLM, RecordStep]:
    torch.manual_seed(0)
    model = EmbeddingLM(head_backend="chunked", **model_kwargs)
    initial = EmbeddingLM(head_backend="chunked", **model_kwargs)
    initial.load_state_dict(model.state_dict())
    batches = micro_batches()
    if loader_kind == "global":
        loader = GlobalStatsLoader(batches, batch_size=None)
    else:
        loader = DataLoader(batches, batch_size=None)
    record = RecordStep()
    with warnings.catch_warnings():  # a plain loader warns that it normalizes by local counts
        warnings.simplefilter("ignore")
        quiet_trainer(max_steps=1, accumulate_grad_batches=2, callbacks=[record]).fit(model, loader)
    return initial, record


@pytest.mark.parametrize("loader_kind", ["plain", "global"])
def test_grad_norm_is_the_norm_of_the_steps_gradient_for_any_loader(loader_kind):
    spec = {"name": "sq", "fn": square, "weight": W_SQ}
    initial, record = fit_one_step(loader_kind, regularizers=[spec], regularizer_grad_norm=True)
    # by hand: the step's loss as Lightning applies it, differentiated w.r.t. each micro-batch's log p
    batches = micro_batches()
    n_total = sum(int((b["labels"] != -100).sum()) for b in batches)
    squared = 0.0
    for batch in batches:
        logp, _, _, mask = initial.reference_head(batch)
        logp = logp.detach().requires_grad_()
        n = int(mask.sum())
        if loader_kind == "global":  # normalized by the step's count: the step's loss is the sum
            part = W_SQ * logp[mask].square().sum() / n_total
        else:  # a plain loader: each micro-batch normalized by its own count, Lightning averages (÷ A)
            part = W_SQ * logp[mask].square().sum() / n / 2
        (grad,) = torch.autograd.grad(part, logp)
        squared += float(grad.square().sum())
    assert record.logged["regularizers/sq/grad_norm"] == pytest.approx(squared**0.5, rel=1e-5)
    assert record.telemetry["regularizers"]["sq"]["grad_norm"] == pytest.approx(squared**0.5, rel=1e-5)


def test_schema_totals_and_values_of_a_step_with_a_base_weight():
    specs = [{"name": "z_loss", "weight": W_SQ}, {"name": "sparsity", "fn": l1_per_sequence, "weight": W_L1}]
    initial, record = fit_one_step("global", regularizers=specs, base_loss_weight=BASE_WEIGHT)
    logged, telemetry = record.logged, record.telemetry

    # by hand, from the initial parameters: token-mean over the whole step; the scalar term by its
    # share of the step's tokens (`scalar_value`)
    batches = micro_batches()
    n_total = sum(int((b["labels"] != -100).sum()) for b in batches)
    base = z = l1 = 0.0
    for batch in batches:
        logp, lse, _, mask = initial.reference_head(batch)
        base += float(-logp[mask].sum()) / n_total
        z += float(lse[mask].square().sum()) / n_total
        rows = [logp[r][mask[r]] for r in range(len(mask))]
        l1 += float(torch.stack([lp.abs().sum() for lp in rows]).mean()) * int(mask.sum()) / n_total
    reg_total = W_SQ * z + W_L1 * l1
    expected = {
        "train/base_loss": base,
        "train/base_loss_weight": BASE_WEIGHT,
        "train/regularizer_total": reg_total,
        "train/loss_total": BASE_WEIGHT * base + reg_total,
        "regularizers/z_loss/value": z,
        "regularizers/z_loss/weight": W_SQ,
        "regularizers/z_loss/contribution": W_SQ * z,
        "regularizers/sparsity/value": l1,
        "regularizers/sparsity/contribution": W_L1 * l1,
        "regularizers/sparsity/error": 0.0,
    }
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value, rel=2e-6, abs=1e-7), key
    assert "regularizers/sparsity/custom/l1" in logged

    # the design's schema, as nested values, adding up
    assert set(telemetry) == {"loss_total", "base_loss", "regularizer_total", "regularizers"}
    assert telemetry["base_loss"] == {
        "value": pytest.approx(base, rel=2e-6),
        "weight": BASE_WEIGHT,
        "custom": {},
    }
    for name in ("z_loss", "sparsity"):
        entry = telemetry["regularizers"][name]
        assert {"value", "weight", "contribution", "custom"} <= set(entry)
        assert entry["contribution"] == pytest.approx(entry["weight"] * entry["value"], rel=1e-6)
    assert telemetry["regularizer_total"] == pytest.approx(
        sum(e["contribution"] for e in telemetry["regularizers"].values()), rel=1e-6
    )
    assert telemetry["loss_total"] == pytest.approx(
        telemetry["base_loss"]["weight"] * telemetry["base_loss"]["value"] + telemetry["regularizer_total"],
        rel=1e-6,
    )
