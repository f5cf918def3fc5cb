"""Custom-gradient toolkit: custom VJPs, named surrogate gradients, stable primitives, gradient checks.

A custom gradient turns a function into a primitive: you give its value (``forward``) and its
vector-Jacobian product (``backward``), and autograd uses your rule instead of differentiating the
forward. Such rules bypass autograd, so check each one with `check_gradients`.

Surrogate gradients (straight-through estimators) are *by design* not the derivative of their
forward: `check_gradients` fails on them, and says so in its message when the function is marked with
``custom_vjp(..., surrogate=True)`` or `mark_surrogate`. Test a surrogate's backward against its
documented rule instead.

Modules (this package imports only ``torch`` and the standard library):

- `lit_losses.autograd.vjp`: `CustomVJP`, `custom_vjp`.
- `lit_losses.autograd.surrogates`: `straight_through`, `round_ste`, `sign_ste`, `clamp_ste`,
  `scale_gradient`, `stop_gradient`, `mark_surrogate`, `is_surrogate`.
- `lit_losses.autograd.stable`: `softplus`, `logsigmoid`.
- `lit_losses.autograd.checks`: `check_gradients`, `GradientReport`, `InputReport`, `GradientCheckError`.
"""

from __future__ import annotations

from lit_losses.autograd.checks import GradientCheckError, GradientReport, InputReport, check_gradients
from lit_losses.autograd.stable import logsigmoid, softplus
from lit_losses.autograd.surrogates import (
    clamp_ste,
    is_surrogate,
    mark_surrogate,
    round_ste,
    scale_gradient,
    sign_ste,
    stop_gradient,
    straight_through,
)
from lit_losses.autograd.vjp import CustomVJP, custom_vjp

__all__ = [
    "CustomVJP",
    "GradientCheckError",
    "GradientReport",
    "InputReport",
    "check_gradients",
    "clamp_ste",
    "custom_vjp",
    "is_surrogate",
    "logsigmoid",
    "mark_surrogate",
    "round_ste",
    "scale_gradient",
    "sign_ste",
    "softplus",
    "stop_gradient",
    "straight_through",
]
