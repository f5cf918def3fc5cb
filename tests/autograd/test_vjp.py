"""Custom VJPs: several inputs and outputs, checked backward results, torch.compile, torch.func, Lightning."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lit_losses.autograd import check_gradients, custom_vjp, round_ste, softplus


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
