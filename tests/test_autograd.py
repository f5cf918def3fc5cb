"""Custom-gradient toolkit: custom VJPs, surrogates, stable primitives, gradient checks."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lit_losses.autograd import (
    GradientCheckError,
    check_gradients,
    clamp_ste,
    custom_vjp,
    logsigmoid,
    round_ste,
    scale_gradient,
    sign_ste,
    softplus,
    stop_gradient,
    straight_through,
)


def _mul_forward(x, y, scale: float = 1.0):
    return (x * y * scale, x + y), (x, y, scale)


def _mul_backward(saved, grads):
    x, y, scale = saved
    g_prod, g_sum = grads
    return g_prod * y * scale + g_sum, g_prod * x * scale + g_sum, None


mul_add = custom_vjp(_mul_forward, _mul_backward, name="mul_add")


def test_multiple_inputs_outputs_non_tensor_argument_and_second_derivatives():
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    report = check_gradients(mul_add, x, y, 2.5, gradgrad=True)
    assert report.passed and report.gradgrad_passed
    assert [r.index for r in report.inputs] == [0, 1]
    assert max(r.max_abs_error for r in report.inputs) < 1e-6
    prod, total = mul_add(x, y, scale=2.5)  # keyword arguments bind by forward's signature
    torch.testing.assert_close(prod, x * y * 2.5)
    torch.testing.assert_close(total, x + y)


def test_a_wrong_backward_is_caught_naming_the_input_and_the_mismatch():
    wrong = custom_vjp(
        _mul_forward,
        lambda s, g: (g[0] * s[1] * s[2] + g[1], 1.1 * (g[0] * s[0] * s[2] + g[1]), None),
        name="wrong",
    )
    report = check_gradients(wrong, torch.randn(2, 3), torch.randn(2, 3), 1.0, raise_exception=False)
    assert not report.passed
    assert report.inputs[0].max_abs_error < 1e-6 < report.inputs[1].max_abs_error
    with pytest.raises(
        GradientCheckError, match=r"input 1: worst \|analytical - numerical\| = [0-9.]+e-0[1-3]"
    ):
        check_gradients(wrong, torch.randn(2, 3), torch.randn(2, 3), 1.0)


@pytest.mark.parametrize(
    ("backward", "match"),
    [
        (lambda s, g: (g[0], g[0]), "mul_add.*returned 2 gradient.*for 3 input"),
        (lambda s, g: (g[0][:, :2], g[0], None), r"mul_add.*input 0 has shape \(3, 2\).*\(3, 4\)"),
        (lambda s, g: (g[0], g[0].double(), None), "mul_add.*input 1 has dtype torch.float64.*float32"),
        (lambda s, g: (g[0], g[0], torch.zeros(())), "mul_add.*input 2 is a float"),
    ],
)
def test_bad_backward_results_name_the_op_and_the_input(backward, match):
    op = custom_vjp(_mul_forward, backward, name="mul_add")
    x, y = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    prod, _ = op(x, y, 1.0)
    with pytest.raises((ValueError, TypeError), match=match):
        prod.sum().backward()


@pytest.mark.parametrize("fn", [softplus, logsigmoid])
def test_stable_primitives_pass_the_gradient_check(fn):
    check_gradients(fn, torch.randn(6) * 5, gradgrad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_stable_softplus_and_logsigmoid_match_the_naive_formula_and_stay_finite(dtype):
    x = torch.linspace(-30, 30, 121, dtype=dtype)
    torch.testing.assert_close(softplus(x), torch.log(1 + torch.exp(x)))
    torch.testing.assert_close(logsigmoid(x), torch.log(torch.sigmoid(x)))
    extreme = torch.tensor([-1000.0, 1000.0], dtype=dtype, requires_grad=True)
    for fn, grad in ((softplus, [0.0, 1.0]), (logsigmoid, [1.0, 0.0])):
        value = fn(extreme)
        (g,) = torch.autograd.grad(value.sum(), extreme)
        assert torch.isfinite(value).all() and torch.isfinite(g).all()
        torch.testing.assert_close(g, torch.tensor(grad, dtype=dtype))
    torch.testing.assert_close(softplus(extreme).detach(), torch.tensor([0.0, 1000.0], dtype=dtype))


def test_surrogates_follow_their_documented_backward_rule():
    x = torch.tensor([-1.7, -0.2, 0.4, 2.6], requires_grad=True)
    upstream = torch.tensor([1.0, -2.0, 3.0, 0.5])
    for fn, value in (
        (round_ste, torch.round(x)),
        (sign_ste, torch.sign(x)),
        (lambda t: clamp_ste(t, -1.0, 1.0), torch.clamp(x, -1, 1)),
        (straight_through(torch.floor), torch.floor(x)),
    ):
        out = fn(x)
        assert torch.equal(out, value.detach())  # exact value, no rounding by x + (f(x) - x)
        (g,) = torch.autograd.grad(out, x, upstream)
        assert torch.equal(g, upstream)  # identity gradient, also outside the clamp range
    (g,) = torch.autograd.grad(scale_gradient(x, -0.5), x, upstream)
    assert torch.equal(g, -0.5 * upstream)
    assert torch.equal(scale_gradient(x, -0.5), x)
    assert not stop_gradient(x).requires_grad and torch.equal(stop_gradient(x), x)


def test_surrogates_fail_the_gradient_check_as_documented():
    with pytest.raises(GradientCheckError, match="round_ste is marked as a surrogate"):
        check_gradients(round_ste, torch.tensor([0.2, 1.3, -0.7]))


def test_custom_vjp_under_torch_compile_fullgraph_and_torch_func():
    x, y = torch.randn(5), torch.randn(5)

    def f(a, b):
        return (mul_add(a, b, 3.0)[0] + softplus(a)).sum()

    expected = torch.func.grad(f)(x, y)
    torch.testing.assert_close(expected, y * 3.0 + torch.sigmoid(x))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    a = x.clone().requires_grad_(True)
    compiled(a, y).backward()
    torch.testing.assert_close(a.grad, expected)


def test_custom_vjp_inside_a_lightning_training_step():
    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))
            self.seen = []

        def training_step(self, batch, batch_idx):
            loss = softplus(batch @ self.w).mean() + round_ste(self.w).pow(2).sum()
            return loss

        def on_before_optimizer_step(self, optimizer):
            self.seen.append(self.w.grad.clone())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    batch = torch.randn(4, 3)
    model = Model()
    w = model.w.detach().clone().requires_grad_(True)
    reference = torch.nn.functional.softplus(batch @ w).mean() + (2 * torch.round(w) * w).sum()
    (expected,) = torch.autograd.grad(reference, w)  # d/dw round(w)^2 with the straight-through rule
    trainer = L.Trainer(
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader([batch], batch_size=None))
    torch.testing.assert_close(model.seen[0], expected)
