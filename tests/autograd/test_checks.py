"""Gradient checks: a wrong backward is caught and located; surrogates fail as documented."""

from __future__ import annotations

import pytest
import torch

from lit_losses.autograd import GradientCheckError, check_gradients, custom_vjp, round_ste


def _mul_forward(x, y, scale: float = 1.0):
    return (x * y * scale, x + y), (x, y, scale)


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


def test_surrogates_fail_the_gradient_check_as_documented():
    with pytest.raises(GradientCheckError, match="round_ste is marked as a surrogate"):
        check_gradients(round_ste, torch.tensor([0.2, 1.3, -0.7]))
