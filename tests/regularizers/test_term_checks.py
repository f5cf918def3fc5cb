"""Errors named by term (no gradient path, nothing to optimize, non-finite), executors and time limits."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from lit_losses.errors import ConfigError
from lit_losses.regularizers import RegularizerError, executors
from tests.helpers import EmbeddingLM, random_batch


def model_with(*specs, **kwargs) -> EmbeddingLM:
    torch.manual_seed(0)
    return EmbeddingLM(regularizers=list(specs), head_backend="chunked", **kwargs).double()


def reference_grads(model, batch, extra=lambda logp, mask: 0.0):
    logp, _, _, mask = model.reference_head(batch)
    expected = -logp[mask].mean() + extra(logp, mask)
    return expected, torch.autograd.grad(expected, list(model.parameters()))


# ---- no gradient path ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fn",
    [
        lambda data, lps: (torch.tensor(1.5, dtype=torch.float64, requires_grad=True), {}),  # a leaf
        lambda data, lps: (torch.ones((), dtype=torch.float64, requires_grad=True) * 2, {}),  # not a leaf
        lambda ctx: torch.zeros_like(ctx.logprobs.detach()).requires_grad_() + 1,  # ctx form, a matrix
    ],
    ids=["leaf", "non-leaf", "ctx-form"],
)
def test_a_tensor_that_requires_grad_without_path_to_the_logprobs_is_named(fn):
    with pytest.raises(
        RegularizerError, match=r"'orphan' returned a tensor that requires grad but has no gradient path"
    ):
        model_with({"name": "orphan", "fn": fn}).compute_loss(random_batch())


def test_a_path_through_a_parameter_only_is_a_gradient_path():
    weight = torch.nn.Parameter(torch.tensor(2.0, dtype=torch.float64))

    def weight_decay(data, logprobs_list):
        return weight.square(), {}

    out = model_with({"name": "decay", "fn": weight_decay}).compute_loss(random_batch())
    (grad,) = torch.autograd.grad(out.total, [weight])
    assert float(grad) == 4.0


def test_a_design_function_without_gradient_adds_its_value_only_and_warns_once():
    def count(data, logprobs_list):  # e.g. a count from an external tool: no gradient by nature
        return torch.tensor(float(len(data))), {}

    model, batch = model_with({"name": "count", "fn": count, "weight": 0.5}), random_batch()
    with pytest.warns(UserWarning, match="'count' returned a value without gradient"):
        out = model.compute_loss(batch)
    expected, grads = reference_grads(model, batch)
    torch.testing.assert_close(out.total, expected + 0.5 * 3.0, rtol=1e-12, atol=1e-12)
    for g, r in zip(torch.autograd.grad(out.total, list(model.parameters())), grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    with pytest.raises(RegularizerError, match="'count' has no gradient path"):  # declared differentiable
        model_with({"name": "count", "fn": count, "differentiable": True}).compute_loss(batch)


# ---- nothing to optimize, non-finite values --------------------------------------------------------
def test_nothing_to_optimize_is_an_error():
    with pytest.raises(ConfigError, match=r"base_loss_weight is 0 and model.regularizers is empty"):
        EmbeddingLM(base_loss_weight=0.0)
    value_only = {"name": "count", "fn": lambda data, lps: (torch.tensor(1.0), {}), "differentiable": False}
    model = model_with(value_only, base_loss_weight=0.0)
    with pytest.raises(RegularizerError, match=r"nothing to optimize at step 0.*\['count'\]"):
        model.compute_loss(random_batch())
    model.regularizer_set.set_enabled("count", False)
    with pytest.raises(RegularizerError, match="nothing to optimize"):
        model.compute_loss(random_batch())
    model.compute_loss(random_batch(), "val")  # evaluation has nothing to optimize by design


def test_a_failed_and_skipped_term_is_flagged_not_an_error_when_it_is_the_whole_loss():
    def down(data, logprobs_list):
        raise ConnectionError("service down")

    out = model_with({"name": "remote", "fn": down, "on_error": "skip"}, base_loss_weight=0.0).compute_loss(
        random_batch()
    )
    assert out.terms["remote"]["error"] == 1.0 and float(out.total) == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values_name_the_term(bad):
    with pytest.raises(RegularizerError, match="'nan_term' returned a non-finite value"):
        model_with(
            {"name": "nan_term", "fn": lambda data, lps: (torch.cat(lps).sum() * bad, {})}
        ).compute_loss(random_batch())


def test_the_design_legacy_mean_over_a_sequence_without_target_is_named():
    from tests.regularizers.design_examples import custom_loss

    batch = random_batch()
    batch["labels"][1] = -100  # row 1 has no target: logprobs_list[1] is empty, its mean NaN
    with pytest.raises(RegularizerError, match=r"'legacy' returned a non-finite value.*empty"):
        model_with({"name": "legacy", "fn": custom_loss}).compute_loss(batch)


# ---- bad specs ----------------------------------------------------------------------------------------
async def async_term(data, logprobs_list):
    return torch.cat(logprobs_list).sum(), {}


def scaled(data, logprobs_list, scale: float = 1.0):
    return scale * torch.cat(logprobs_list).sum(), {}


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"fn": async_term, "executor": "thread"}, "'t': executor 'thread' .* is for sync functions"),
        ({"fn": async_term, "run_in_executor": True}, "'t': executor 'thread' .* is for sync functions"),
        ({"fn": scaled, "args": {"scael": 2.0}}, r"\.args\.scael: regularizer 't' takes no argument 'scael'"),
        ({"fn": scaled, "args": [2.0]}, r"'t'.args must be a mapping"),
        ({"fn": scaled, "timeout_s": 0}, r"'t'.timeout_s must be a number of seconds > 0, 'default' or null"),
        ({"fn": scaled, "timeout_s": "soon"}, r"'t'.timeout_s .* got 'soon'"),
        ({"fn": scaled, "timeout_s": True}, r"'t'.timeout_s .* got True"),
        ({"fn": scaled, "executor": "proces"}, r"executor 'proces' is not one of .*did you mean 'process'"),
        ({"fn": lambda d, lps: (lps[0].sum(), {}), "executor": "process"}, "needs a picklable function"),
        ({"fn": scaled, "weight": True}, "weight must be a finite number, got True"),
    ],
)
def test_bad_specs_are_one_config_error_naming_the_term(spec, match):
    with pytest.raises(ConfigError, match=match):
        model_with({"name": "t", **spec})


# ---- executors and time limits ------------------------------------------------------------------------
def test_run_in_executor_runs_the_design_function_in_a_thread_with_the_same_result():
    threads = []

    def heavy(data, logprobs_list):
        threads.append(threading.current_thread().name)
        return torch.cat(logprobs_list).square().mean(), {}

    batch = random_batch()
    inline = model_with({"name": "h", "fn": heavy}).compute_loss(batch)
    model = model_with({"name": "h", "fn": heavy, "run_in_executor": True})
    assert model.regularizer_set.term("h").spec.executor == "thread"
    offloaded = model.compute_loss(batch)
    assert threads == ["MainThread", "lit-losses-term"]
    torch.testing.assert_close(offloaded.total, inline.total, rtol=0, atol=0)


def test_two_async_design_terms_of_0_2_s_take_less_than_0_3_s_together():
    async def slow(data, logprobs_list):
        await asyncio.sleep(0.2)
        return torch.cat(logprobs_list).square().mean(), {}

    model = model_with({"name": "a", "fn": slow}, {"name": "b", "fn": slow})
    batch = random_batch()
    model.compute_loss(batch)  # warm-up: the persistent event loop starts once
    start = time.perf_counter()
    model.compute_loss(batch)
    assert time.perf_counter() - start < 0.3

    async def caller():  # the async call: the terms run concurrently on the caller's loop
        start = time.perf_counter()
        specs = [{"name": "a", "fn": slow}, {"name": "b", "fn": slow}]
        await model.forward_backward_custom_async(batch, regularizers=specs)
        return time.perf_counter() - start

    assert asyncio.run(caller()) < 0.3


@pytest.fixture
def short_default_timeout(monkeypatch):
    monkeypatch.setattr(executors, "DEFAULT_TIMEOUT_S", 0.2)


@pytest.mark.parametrize("executor", ["async", "thread"])
def test_a_term_that_never_returns_hits_the_default_timeout(executor, short_default_timeout):
    release = threading.Event()

    async def never_async(data, logprobs_list):
        await asyncio.Event().wait()

    def never_thread(data, logprobs_list):
        release.wait()  # until the test ends (a daemon thread: it would not block the exit either)
        return torch.cat(logprobs_list).sum(), {}

    spec = {"fn": never_async} if executor == "async" else {"fn": never_thread, "executor": "thread"}
    start = time.perf_counter()
    try:
        with pytest.raises(RegularizerError, match=r"'stuck' timed out after 0.2 s \(the default timeout_s"):
            model_with({"name": "stuck", **spec}).compute_loss(random_batch())
        assert time.perf_counter() - start < 2.0
        out = model_with({"name": "stuck", "on_error": "skip", **spec}).compute_loss(random_batch())
        assert out.terms["stuck"]["error"] == 1.0  # training goes on, flagged
    finally:
        release.set()


def test_null_timeout_means_none(short_default_timeout):
    async def slower_than_the_default(data, logprobs_list):
        await asyncio.sleep(0.4)
        return torch.cat(logprobs_list).square().mean(), {}

    out = model_with({"name": "slow", "fn": slower_than_the_default, "timeout_s": None}).compute_loss(
        random_batch()
    )
    assert out.terms["slow"]["error"] == 0.0 and float(out.terms["slow"]["value"]) > 0


@pytest.mark.parametrize("executor", ["async", "thread"])
def test_a_terms_own_timeout_error_is_its_error_not_the_time_limit(executor):
    async def async_upstream(data, logprobs_list):
        raise TimeoutError("upstream service timed out")

    def thread_upstream(data, logprobs_list):
        raise TimeoutError("upstream service timed out")

    spec = {"fn": async_upstream} if executor == "async" else {"fn": thread_upstream, "executor": "thread"}
    with pytest.raises(RegularizerError, match=r"'up' failed: TimeoutError\('upstream service timed out'\)"):
        model_with({"name": "up", **spec}).compute_loss(random_batch())


def test_a_spec_dict_with_an_unknown_or_missing_field_is_named():
    with pytest.raises(
        ConfigError, match=r"model.regularizers\[1\]: unknown field 'wieght'; did you mean 'weight'"
    ):
        model_with({"name": "a", "fn": scaled}, {"name": "b", "fn": scaled, "wieght": 0.1})
    with pytest.raises(ConfigError, match=r"model.regularizers\[0\]: a regularizer needs a 'name'"):
        model_with({"fn": scaled, "weight": 0.1})
    with pytest.raises(ConfigError, match=r"^regularizers\[0\]: unknown field 'run_in_exector'"):
        model_with().forward_backward_custom(
            random_batch(), regularizers=[{"name": "a", "fn": scaled, "run_in_exector": True}]
        )
