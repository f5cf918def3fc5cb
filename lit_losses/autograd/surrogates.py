"""Surrogate gradients (straight-through estimators) and gradient plumbing.

A surrogate's backward is *by design* not the derivative of its forward: `check_gradients` fails on
it, and says so in its message when the function is marked with ``custom_vjp(..., surrogate=True)``
or `mark_surrogate`. Test a surrogate's backward against its documented rule instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lit_losses.autograd.vjp import CustomVJP, custom_vjp

__all__ = [
    "clamp_ste",
    "is_surrogate",
    "mark_surrogate",
    "round_ste",
    "scale_gradient",
    "sign_ste",
    "stop_gradient",
    "straight_through",
]


def mark_surrogate(fn: Callable) -> Callable:
    """Mark ``fn`` as having a surrogate gradient (`check_gradients` then explains its expected failure).

    Args:
        fn: the function; it gets an ``is_surrogate = True`` attribute.

    Returns:
        ``fn`` itself, so that this works as a decorator.

    Example:
        >>> @mark_surrogate
        ... def hard_threshold(x):
        ...     return x
        >>> is_surrogate(hard_threshold)
        True
    """
    fn.is_surrogate = True  # type: ignore[attr-defined]
    return fn


def is_surrogate(fn: Callable) -> bool:
    """Whether ``fn`` is marked as having a surrogate gradient (its ``is_surrogate`` attribute).

    Args:
        fn: a function, a `CustomVJP` (``custom_vjp(..., surrogate=True)``) or any object.

    Returns:
        ``True`` for `mark_surrogate`-ed functions and surrogate `CustomVJP`\\ s, else ``False``.

    Example:
        >>> import torch
        >>> is_surrogate(round_ste), is_surrogate(torch.round)
        (True, False)
    """
    return bool(getattr(fn, "is_surrogate", False))


# ---- named surrogates and gradient plumbing ---------------------------------------------------
def straight_through(forward_fn: Callable[[Tensor], Tensor], name: str | None = None) -> CustomVJP:
    """``forward_fn`` in the forward pass, identity in the backward pass: ``∂y/∂x := I``.

    The value is exactly ``forward_fn(x)`` (not ``x + (f(x) - x).detach()``, which rounds).

    Args:
        forward_fn: a one-tensor function, e.g. ``torch.floor``.
        name: the op's name in messages (default: ``straight_through(<forward_fn's name>)``).

    Returns:
        a surrogate `CustomVJP` of one tensor.

    Example:
        >>> import torch
        >>> floor_ste = straight_through(torch.floor)
        >>> x = torch.tensor([0.4, 1.6], requires_grad=True)
        >>> y = floor_ste(x)
        >>> y.detach()
        tensor([0., 1.])
        >>> y.sum().backward()
        >>> x.grad
        tensor([1., 1.])
        >>> floor_ste.name
        'straight_through(floor)'
    """
    label = name or f"straight_through({getattr(forward_fn, '__name__', 'fn')})"

    def forward(x: Tensor) -> tuple[Tensor, None]:
        return forward_fn(x), None

    def backward(saved: None, grad: Tensor) -> tuple[Tensor]:
        return (grad,)

    return custom_vjp(forward, backward, name=label, surrogate=True)


round_ste = straight_through(torch.round, name="round_ste")
round_ste.__doc__ = """``round(x)``, with the straight-through gradient ``∂/∂x = 1``.

Args:
    x: a tensor.

Returns:
    ``torch.round(x)``.

Example:
    >>> import torch
    >>> x = torch.tensor([0.4, 1.6], requires_grad=True)
    >>> (round_ste(x) * torch.tensor([1.0, 3.0])).sum().backward()  # y = [0, 2]
    >>> x.grad  # the upstream gradient, passed straight through
    tensor([1., 3.])
"""
sign_ste = straight_through(torch.sign, name="sign_ste")
sign_ste.__doc__ = """``sign(x)``, with the straight-through gradient ``∂/∂x = 1``.

``x`` is any tensor; returns ``torch.sign(x)`` (0 at 0, where the gradient is still 1).

Example:
    >>> import torch
    >>> x = torch.tensor([-0.4, 1.6], requires_grad=True)
    >>> y = sign_ste(x)
    >>> y.detach()
    tensor([-1.,  1.])
    >>> y.sum().backward()
    >>> x.grad
    tensor([1., 1.])
"""


def _clamp_forward(x: Tensor, min: float | None = None, max: float | None = None) -> tuple[Tensor, None]:
    return torch.clamp(x, min, max), None


def _pass_through_first(saved: None, grad: Tensor) -> tuple[Tensor, None, None]:
    return grad, None, None


clamp_ste = custom_vjp(_clamp_forward, _pass_through_first, name="clamp_ste", surrogate=True)
clamp_ste.__doc__ = """``clamp(x, min, max)``, with the gradient passed through unchanged everywhere.

Args:
    x: a tensor.
    min: the lower bound (``None``: none).
    max: the upper bound (``None``: none).

Returns:
    ``torch.clamp(x, min, max)``; its gradient is ``1`` also outside ``[min, max]``.

Example:
    >>> import torch
    >>> x = torch.tensor([-2.0, 0.5, 3.0], requires_grad=True)
    >>> y = clamp_ste(x, -1.0, 1.0)
    >>> y.detach()
    tensor([-1.0000,  0.5000,  1.0000])
    >>> y.sum().backward()
    >>> x.grad
    tensor([1., 1., 1.])
"""


def stop_gradient(x: Tensor) -> Tensor:
    """``x`` as a constant: the same value, no gradient (``x.detach()``).

    Args:
        x: a tensor.

    Returns:
        ``x.detach()``.

    Example:
        >>> import torch
        >>> x = torch.tensor([0.4, 1.6], requires_grad=True)
        >>> y = stop_gradient(x)
        >>> y, y.requires_grad
        (tensor([0.4000, 1.6000]), False)
    """
    return x.detach()


def _scale_forward(x: Tensor, scale: float) -> tuple[Tensor, float]:
    return x.view_as(x), scale


def _scale_backward(scale: float, grad: Tensor) -> tuple[Tensor, None]:
    return grad * scale, None


scale_gradient = custom_vjp(_scale_forward, _scale_backward, name="scale_gradient", surrogate=True)
scale_gradient.__doc__ = """Identity in the forward pass; the gradient is multiplied by ``scale`` (a number).

Args:
    x: a tensor.
    scale: the gradient's factor (a Python number; ``-1`` reverses the gradient).

Returns:
    ``x``'s value; ``∂/∂x = scale``.

Example:
    >>> import torch
    >>> x = torch.tensor([0.4, 1.6], requires_grad=True)
    >>> y = scale_gradient(x, 0.5)
    >>> y.detach()
    tensor([0.4000, 1.6000])
    >>> y.sum().backward()
    >>> x.grad
    tensor([0.5000, 0.5000])
"""
