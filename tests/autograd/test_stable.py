"""Stable primitives: exact gradients, the naive formula's values, finite at |x| = 1000."""

from __future__ import annotations

import pytest
import torch

from lit_losses.autograd import check_gradients, logsigmoid, softplus


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
