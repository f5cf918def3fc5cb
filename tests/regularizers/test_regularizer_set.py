"""RegularizerSet: exact gradients, concurrency, errors, order, runtime control."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from lit_losses.errors import ConfigError
from lit_losses.regularizers import RegularizerError, RegularizerSpec
from tests.helpers import EmbeddingLM, random_batch


def square_logprobs(ctx):
    return ctx.logprobs.square()


async def async_lse(ctx):
    await asyncio.sleep(0.01)
    return 0.1 * ctx.lse


def thread_entropy_scalar(ctx):  # a scalar: the mean over this micro-batch's valid tokens
    return ctx.entropy[ctx.mask].mean(), {"tokens": float(ctx.mask.sum())}


def model_with(*specs, **kwargs) -> EmbeddingLM:
    torch.manual_seed(0)
    return EmbeddingLM(regularizers=list(specs), head_backend="chunked", **kwargs).double()


def hand_loss(model, batch, w_a, w_b):
    logp, lse, entropy, mask = model.reference_head(batch)
    n = mask.sum()
    base = -logp.sum() / n
    return base + w_a * logp.square().sum() / n + w_b * (0.1 * lse).sum() / n, entropy, mask, n


@pytest.mark.parametrize(
    ("executor_a", "async_b"), [("none", False), ("none", True), ("thread", True), ("thread", False)]
)
def test_two_terms_give_the_hand_computed_gradient_in_float64(executor_a, async_b):
    b_fn = async_lse if async_b else (lambda ctx: 0.1 * ctx.lse)
    specs = [
        RegularizerSpec(name="a", fn=square_logprobs, weight=0.3, executor=executor_a),
        RegularizerSpec(name="b", fn=b_fn, weight=0.7, needs=["lse"]),
    ]
    model, batch = model_with(*specs), random_batch()
    out = model.compute_loss(batch, "train")
    grads = torch.autograd.grad(out.total, list(model.parameters()))
    reference, _, _, _ = hand_loss(model, batch, 0.3, 0.7)
    ref_grads = torch.autograd.grad(reference, list(model.parameters()))
    torch.testing.assert_close(out.total, reference, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    assert set(out.terms) == {"a", "b"}
    torch.testing.assert_close(out.terms["a"]["contribution"], 0.3 * out.terms["a"]["value"])


def test_scalar_terms_follow_the_aggregation_contract_and_report_custom_metrics():
    model, batch = (
        model_with(RegularizerSpec(name="h", fn=thread_entropy_scalar, executor="thread", needs=["entropy"])),
        random_batch(),
    )
    out = model.compute_loss(batch, "train")
    _, _, entropy, mask = model.reference_head(batch)
    torch.testing.assert_close(out.terms["h"]["value"], entropy[mask].mean())
    assert out.terms["h"]["custom"] == {"tokens": float(mask.sum())}


def test_the_order_of_terms_never_changes_the_result():
    specs = [
        RegularizerSpec(name="zz", fn=square_logprobs, weight=0.3),
        RegularizerSpec(name="aa", fn="z_loss", weight=1e-2),
        RegularizerSpec(name="mm", fn="entropy", weight=0.05),
    ]
    batch = random_batch()
    forward = model_with(*specs).compute_loss(batch).total
    backward = model_with(*reversed(specs)).compute_loss(batch).total
    assert torch.equal(forward, backward)


def test_async_and_thread_terms_run_concurrently():
    async def slow_async(ctx):
        await asyncio.sleep(0.2)
        return ctx.logprobs

    def slow_thread(ctx):
        time.sleep(0.2)
        return ctx.logprobs

    model = model_with(
        RegularizerSpec(name="a1", fn=slow_async),
        RegularizerSpec(name="a2", fn=slow_async),
        RegularizerSpec(name="t1", fn=slow_thread, executor="thread"),
    )
    batch = random_batch()
    model.compute_loss(batch)  # warm-up: starts the event loop and the thread pool once
    loop = model.regularizer_set.executors._loop
    start = time.perf_counter()
    model.compute_loss(batch)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.32, f"three 0.2 s terms took {elapsed:.3f} s"
    assert model.regularizer_set.executors._loop is loop  # one persistent loop, not one per step


def test_a_term_without_gradient_path_is_an_error_unless_declared():
    detached = RegularizerSpec(name="detached_term", fn=lambda ctx: ctx.logprobs.detach())
    with pytest.raises(RegularizerError, match=r"detached_term.*no gradient path"):
        model_with(detached).compute_loss(random_batch(), "train")
    declared = RegularizerSpec(name="external", fn=lambda ctx: ctx.logprobs.detach(), differentiable=False)
    model = model_with(declared)
    with pytest.warns(UserWarning, match=r"external.*non-differentiable"):
        model.compute_loss(random_batch(), "train")
    model.compute_loss(random_batch(), "train")  # warns once: a second call is silent


def boom(ctx):
    raise RuntimeError("external service down")


async def too_slow(ctx):
    await asyncio.sleep(1.0)
    return ctx.logprobs


def test_error_policies_and_timeouts():
    with pytest.raises(RegularizerError, match=r"'flaky'.*external service down"):
        model_with(RegularizerSpec(name="flaky", fn=boom)).compute_loss(random_batch())
    model = model_with(
        RegularizerSpec(name="flaky", fn=boom, on_error="skip"),
        RegularizerSpec(name="ok", fn=square_logprobs),
    )
    out = model.compute_loss(random_batch())
    assert out.terms["flaky"]["error"] == 1.0 and out.terms["ok"]["error"] == 0.0
    assert float(out.terms["flaky"]["contribution"]) == 0.0
    torch.testing.assert_close(out.regularizer_total, out.terms["ok"]["contribution"])
    with pytest.warns(UserWarning, match="'flaky' skipped"):
        model_with(RegularizerSpec(name="flaky", fn=boom, on_error="warn")).compute_loss(random_batch())
    start = time.perf_counter()
    with pytest.raises(RegularizerError, match=r"'slow' timed out after 0\.1 s"):
        model_with(RegularizerSpec(name="slow", fn=too_slow, timeout_s=0.1)).compute_loss(random_batch())
    assert time.perf_counter() - start < 0.9


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda ctx: 3.0, "'bad' returned a float, not a tensor"),
        (
            lambda ctx: ctx.logprobs[:, :2],
            r"'bad' returned shape \(3, 2\); expected a scalar or the mask shape \(3, 7\)",
        ),
        (lambda ctx: ctx.logprobs * float("nan"), "'bad' returned a non-finite value"),
    ],
)
def test_bad_term_outputs_name_the_term(fn, match):
    with pytest.raises(RegularizerError, match=match):
        model_with(RegularizerSpec(name="bad", fn=fn)).compute_loss(random_batch())


def test_bad_specs_are_config_errors():
    with pytest.raises(ConfigError, match="duplicate regularizer name 'z_loss'"):
        model_with(RegularizerSpec(name="z_loss"), RegularizerSpec(name="z_loss"))
    with pytest.raises(ConfigError, match="unknown regularizer 'z_los'; did you mean 'z_loss'"):
        model_with(RegularizerSpec(name="z_los"))
    with pytest.raises(ConfigError, match=r"'entropy': negative weight -0\.1"):
        RegularizerSpec(name="entropy", weight=-0.1)
    assert RegularizerSpec(name="entropy", weight=-0.1, allow_negative_weight=True).weight == -0.1
    with pytest.raises(ConfigError, match="on_error 'ignore'"):
        RegularizerSpec(name="entropy", on_error="ignore")
    with pytest.raises(ConfigError, match="needs"):
        model_with(RegularizerSpec(name="entropy", needs=["logits"]))


def test_runtime_weights_schedule_and_enable():
    model = model_with(
        RegularizerSpec(name="z_loss", weight=0.1, schedule={"kind": "linear_warmup", "warmup_steps": 10}),
        RegularizerSpec(name="entropy", weight=0.2),
    )
    terms = model.regularizer_set
    assert terms.effective_weight("z_loss", 5) == pytest.approx(0.05)
    terms.scale_weight("z_loss", 0.5)
    terms.set_enabled("entropy", False)
    assert terms.state_dict() == {
        "entropy": {"weight": 0.2, "enabled": False},
        "z_loss": {"weight": 0.05, "enabled": True},
    }
    assert model.head_outputs_needed() == ("lse",)
    out = model.compute_loss(random_batch())
    assert float(out.terms["entropy"]["contribution"]) == 0.0
    with pytest.raises(ConfigError, match="negative weight"):
        terms.set_weight("entropy", -1.0)
    terms.set_enabled("z_loss", False)
    assert model.head_outputs_needed() == ()  # nothing consumes the head outputs: fast path


def test_class_terms_are_instantiated_once_with_their_args():
    from lit_losses import register_regularizer

    @register_regularizer("test_scaled_square", needs=("logprobs",))
    class ScaledSquare:
        """``r_t = scale · log p_t²``."""

        instances = 0

        def __init__(self, scale: float = 1.0) -> None:
            ScaledSquare.instances += 1
            self.scale = scale

        def __call__(self, ctx):
            return self.scale * ctx.logprobs.square()

    model, batch = (
        model_with(RegularizerSpec(name="sq", fn="test_scaled_square", args={"scale": 3.0})),
        random_batch(),
    )
    out = model.compute_loss(batch)
    model.compute_loss(batch)
    logp, _, _, mask = model.reference_head(batch)
    torch.testing.assert_close(out.terms["sq"]["value"], 3.0 * logp.square().sum() / mask.sum())
    assert ScaledSquare.instances == 1


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ({"kind": "constant"}, [1.0, 1.0, 1.0, 1.0]),
        ({"kind": "linear_warmup", "warmup_steps": 4, "start": 0.2}, [0.2, 0.4, 0.8, 1.0]),
        ({"kind": "cosine", "warmup_steps": 2, "total_steps": 6, "final": 0.1}, [0.0, 0.5, 0.55, 0.1]),
        ({"kind": "step", "step_size": 2, "gamma": 0.5}, [1.0, 1.0, 0.25, 0.125]),
    ],
)
def test_schedules(schedule, expected):
    from lit_losses import Schedule

    steps = [0, 1, 4, 6] if schedule["kind"] != "linear_warmup" else [0, 1, 3, 9]
    factors = [Schedule(**schedule).factor(s) for s in steps]
    assert factors == pytest.approx(expected)
    with pytest.raises(ConfigError, match="total_steps"):
        Schedule(kind="cosine", warmup_steps=5, total_steps=5)


def test_registering_another_term_under_a_taken_name_is_an_error():
    from lit_losses import register_regularizer

    def z_loss(ctx):  # same name, different definition
        return ctx.lse

    with pytest.raises(ValueError, match="'z_loss' is already registered"):
        register_regularizer("z_loss")(z_loss)
