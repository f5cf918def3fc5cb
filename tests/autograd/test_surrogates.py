"""Named surrogate gradients and gradient plumbing follow their documented backward rule."""

from __future__ import annotations

import torch

from lit_losses.autograd import (
    clamp_ste,
    round_ste,
    scale_gradient,
    sign_ste,
    stop_gradient,
    straight_through,
)


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
