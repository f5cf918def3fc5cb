"""The design's four examples and its legacy ``custom_loss`` run as written.

Every value and gradient is checked against plain PyTorch autograd on log-probabilities materialized
from the full float64 logits, with ``data``/``logprobs_list`` built here row by row (1e-10).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import warnings
from types import SimpleNamespace

import pytest
import torch

from lit_losses.regularizers import RegularizerError
from tests.helpers import EmbeddingLM
from tests.regularizers import design_examples as design
from tests.regularizers.design_examples import custom_loss, regularizers

TOL = dict(rtol=1e-10, atol=1e-10)


@pytest.fixture(scope="module", autouse=True)
def knowledge_base():
    port, stop = design.serve_knowledge_base()
    yield port
    stop()


@pytest.fixture(autouse=True)
def _value_only_terms_warn():  # topology and kb_consistency return counts without gradient, as designed
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*adds to the loss value only")
        yield


def make_model(seed: int = 0, **kwargs) -> EmbeddingLM:
    torch.manual_seed(seed)
    return EmbeddingLM(head_backend="chunked", **kwargs).double()


def make_batch(seed: int = 0, B: int = 3, T: int = 7) -> dict:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 11, (B, T), generator=g)
    labels[torch.rand(B, T, generator=g) < 0.3] = -100
    labels[:, 0] = torch.randint(0, 11, (B,), generator=g)  # every row has a target (custom_loss's mean)
    return {"input_ids": torch.randint(0, 11, (B, T), generator=g), "labels": labels}


def reference_inputs(model: EmbeddingLM, batch: dict) -> tuple[list, list[torch.Tensor]]:
    """``(data, logprobs_list)`` row by row from the materialized float64 log-softmax."""
    logp_all = torch.log_softmax(model.lm_head(torch.tanh(model.embed(batch["input_ids"]))), -1)
    data, logprobs_list = [], []
    for row, labels in enumerate(batch["labels"]):
        (idx,) = torch.nonzero(labels != -100, as_tuple=True)
        logprobs_list.append(logp_all[row, idx, labels[idx]])
        inputs = {"target_tokens": labels[idx], "weights": torch.ones(len(idx))}
        data.append(SimpleNamespace(model_input=batch["input_ids"][row], loss_fn_inputs=inputs))
    return data, logprobs_list


def call(fn, *args):
    """``fn(*args)``, awaited in a thread of its own when it is a coroutine (the caller may be on a loop)."""
    out = fn(*args)
    if not inspect.iscoroutine(out):
        return out
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, out).result()


def reference_step(model, batch, specs, loss_fn=None) -> tuple[torch.Tensor, dict, list[torch.Tensor]]:
    """``(loss_total, {name: (value, custom)}, parameter gradients)`` computed by hand."""
    data, logprobs_list = reference_inputs(model, batch)
    total, parts = torch.zeros((), dtype=torch.float64), {}
    if loss_fn is not None:
        value, custom = call(loss_fn, data, logprobs_list)
        total, parts["base"] = total + value, (value, custom)
    for spec in specs:
        value, custom = call(spec["fn"], data, logprobs_list)
        total, parts[spec["name"]] = total + spec["weight"] * value, (value, custom)
    return total, parts, list(torch.autograd.grad(total, list(model.parameters())))


def assert_metrics(metrics: dict, total, parts, specs) -> None:
    assert metrics["loss_total"] == pytest.approx(float(total.detach()), rel=1e-10, abs=1e-10)
    reg_total = 0.0
    for spec in specs:
        entry, (value, custom) = metrics["regularizers"][spec["name"]], parts[spec["name"]]
        assert entry["value"] == pytest.approx(float(value.detach()), rel=1e-10, abs=1e-10)
        assert entry["weight"] == spec["weight"]
        contribution = float(
            spec["weight"] * value.detach()
        )  # in the value's dtype, as the design computes it
        assert entry["contribution"] == pytest.approx(contribution, rel=1e-10, abs=1e-12)
        assert entry["custom"] == pytest.approx({k: float(v) for k, v in custom.items()}, rel=1e-10)
        reg_total += entry["contribution"]
    assert metrics["regularizer_total"] == pytest.approx(reg_total, rel=1e-10, abs=1e-12)


def assert_grads(model, expected: list[torch.Tensor]) -> None:
    for p, r in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, r, **TOL)


def test_examples_1_2_3_with_forward_backward_custom():
    model, batch = make_model(), make_batch()
    total, parts, grads = reference_step(model, batch, regularizers)
    metrics = model.forward_backward_custom(batch, regularizers=regularizers)
    assert set(metrics) == {"loss_total", "regularizers", "regularizer_total"}  # no loss_fn: no base_loss
    assert_metrics(metrics, total, parts, regularizers)
    assert_grads(model, grads)
    assert metrics["regularizers"]["topology"]["custom"]["beta_1_max"] >= 1  # the circle has a loop
    claims = [int(labels[labels != -100][0]) for labels in batch["labels"]]  # what the KB was asked
    verified = sum(design.kb_verdict(c)["verified"] for c in claims) / len(claims)
    assert metrics["regularizers"]["kb_consistency"]["custom"]["verified_ratio"] == verified


def test_legacy_custom_loss_unchanged_as_the_loss_or_with_regularizers():
    model, batch = make_model(1), make_batch(1)
    total, parts, grads = reference_step(model, batch, [], loss_fn=custom_loss)
    metrics = model.forward_backward_custom(batch, custom_loss)  # the design's positional call
    assert metrics["base_loss"]["value"] == pytest.approx(
        float(parts["base"][0].detach()), rel=1e-10, abs=1e-10
    )
    assert metrics["base_loss"]["custom"] == pytest.approx(parts["base"][1], rel=1e-10)
    assert metrics["loss_total"] == pytest.approx(float(total), rel=1e-10, abs=1e-10)
    assert metrics["regularizers"] == {} and metrics["regularizer_total"] == 0.0
    assert_grads(model, grads)

    model.zero_grad()
    total, parts, grads = reference_step(model, batch, regularizers[1:2], loss_fn=custom_loss)
    metrics = model.forward_backward_custom(batch, loss_fn=custom_loss, regularizers=regularizers[1:2])
    assert_metrics(metrics, total, parts, regularizers[1:2])
    assert_grads(model, grads)

    # in a RegularizedLM: the legacy callback as a spec dict (no flag), the whole loss with weight 0
    legacy = make_model(1, base_loss_weight=0.0, regularizers=[{"fn": custom_loss, "name": "legacy"}])
    out = legacy.compute_loss(batch)
    total, _, grads = reference_step(legacy, batch, [], loss_fn=custom_loss)
    torch.testing.assert_close(out.total, total, **TOL)
    for g, r in zip(torch.autograd.grad(out.total, list(legacy.parameters())), grads, strict=True):
        torch.testing.assert_close(g, r, **TOL)


def test_example_4_training_loop_with_three_regularizers():
    model = make_model(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    dataloader = [make_batch(10), make_batch(11)]
    num_epochs, seen = 2, []

    async def train():
        for epoch in range(num_epochs):  # the design's loop, with this package's counterparts
            for batch in dataloader:
                data = batch
                expected = reference_step(model, data, regularizers)
                result = await model.forward_backward_custom_async(data, regularizers=regularizers)
                assert_metrics(result, *expected[:2], regularizers)
                assert_grads(model, expected[2])
                optimizer.step()
                optimizer.zero_grad()
                print(f"Total loss: {result['loss_total']:.4f} (epoch {epoch})")
                for name, reg_metrics in result["regularizers"].items():
                    print(
                        f"  {name}: value={reg_metrics['value']:.4f}, "
                        f"contribution={reg_metrics['contribution']:.4f}"
                    )
                seen.append(result["regularizers"]["sparsity"]["value"])

    asyncio.run(train())
    assert len(seen) == 4 and seen[2] < seen[0] and seen[3] < seen[1]  # sparsity (with gradient) falls


def test_the_same_regularizers_configured_on_a_regularized_lm():
    """``RegularizedLM(regularizers=[the design's dicts])``: base CE + Σ w_i r_i, exact gradients."""
    model, batch = make_model(3, regularizers=regularizers), make_batch(3)
    out = model.compute_loss(batch)
    data, logprobs_list = reference_inputs(model, batch)
    expected = -torch.cat(logprobs_list).mean()
    for spec in regularizers:
        expected = expected + spec["weight"] * call(spec["fn"], data, logprobs_list)[0]
    torch.testing.assert_close(out.total, expected, **TOL)
    grads = torch.autograd.grad(out.total, list(model.parameters()))
    for g, r in zip(grads, torch.autograd.grad(expected, list(model.parameters())), strict=True):
        torch.testing.assert_close(g, r, **TOL)
    assert out.terms["kb_consistency"]["custom"]["verified_ratio"] == pytest.approx(
        call(design.knowledge_consistency, data, logprobs_list)[1]["verified_ratio"]
    )


def test_a_value_only_term_alone_has_nothing_to_optimize():
    """The design raises when no log-probability gets a gradient; here: one error naming the cause."""
    model = make_model()
    with pytest.raises(RegularizerError, match=r"nothing to optimize.*\['topology'\]"):
        model.forward_backward_custom(make_batch(), regularizers=regularizers[:1])
    assert all(p.grad is None for p in model.parameters())  # no backward ran
