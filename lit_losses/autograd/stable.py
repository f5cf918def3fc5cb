"""Numerically stable primitives with hand-written gradients: `softplus` and `logsigmoid`."""

from __future__ import annotations

import torch
from torch import Tensor

from lit_losses.autograd.vjp import custom_vjp

__all__ = ["logsigmoid", "softplus"]


def _softplus_forward(x: Tensor) -> tuple[Tensor, Tensor]:
    return torch.clamp_min(x, 0) + torch.log1p(torch.exp(-torch.abs(x))), x


def _softplus_backward(x: Tensor, grad: Tensor) -> tuple[Tensor]:
    return (grad * torch.sigmoid(x),)


softplus = custom_vjp(_softplus_forward, _softplus_backward, name="softplus")
softplus.__doc__ = """``log(1 + exp(x))`` as ``max(x, 0) + log1p(exp(-|x|))``; derivative ``sigmoid(x)``.

Finite value and gradient for every finite ``x`` (``|x| = 1000`` included) in float32 and float64.

Args:
    x: a floating-point tensor.

Returns:
    ``softplus(x)``, elementwise.

Example:
    >>> import torch
    >>> x = torch.tensor([-1000.0, 0.0, 1000.0], requires_grad=True)
    >>> y = softplus(x)
    >>> y.detach()
    tensor([0.0000e+00, 6.9315e-01, 1.0000e+03])
    >>> y.sum().backward()
    >>> x.grad
    tensor([0.0000, 0.5000, 1.0000])
"""


def _logsigmoid_forward(x: Tensor) -> tuple[Tensor, Tensor]:
    return -(torch.clamp_min(-x, 0) + torch.log1p(torch.exp(-torch.abs(x)))), x


def _logsigmoid_backward(x: Tensor, grad: Tensor) -> tuple[Tensor]:
    return (grad * torch.sigmoid(-x),)


logsigmoid = custom_vjp(_logsigmoid_forward, _logsigmoid_backward, name="logsigmoid")
logsigmoid.__doc__ = """``log(sigmoid(x)) = -softplus(-x)``, stable; derivative ``sigmoid(-x)``.

Finite value and gradient for every finite ``x`` (``|x| = 1000`` included) in float32 and float64.

Args:
    x: a floating-point tensor.

Returns:
    ``log(sigmoid(x))``, elementwise.

Example:
    >>> import torch
    >>> x = torch.tensor([-1000.0, 0.0, 1000.0], requires_grad=True)
    >>> y = logsigmoid(x)
    >>> y.detach()
    tensor([-1.0000e+03, -6.9315e-01, -0.0000e+00])
    >>> y.sum().backward()
    >>> x.grad
    tensor([1.0000, 0.5000, 0.0000])
"""
