"""Gradient checks: a custom gradient against central finite differences in float64.

Custom gradients bypass autograd, so check each one with `check_gradients`. Surrogate gradients fail
the check by design; the message says so when the function is marked as a surrogate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lit_losses.autograd.surrogates import is_surrogate

__all__ = ["GradientCheckError", "GradientReport", "InputReport", "check_gradients"]


class GradientCheckError(AssertionError):
    """A custom gradient disagrees with finite differences (the message has the worst mismatch per input).

    Raised by `check_gradients` (unless ``raise_exception=False``); an ``AssertionError``, so that a
    failed check reads as a failed test.

    Example:
        >>> import torch
        >>> from lit_losses.autograd import round_ste
        >>> try:
        ...     check_gradients(round_ste, torch.tensor([0.2, 1.3]))
        ... except GradientCheckError as error:
        ...     print(str(error).splitlines()[0])
        check_gradients(round_ste): FAILED
    """


@dataclass
class InputReport:
    """Worst mismatch between the analytical and the numerical Jacobian of one input.

    Attributes:
        index: the input's position among the function's arguments.
        max_abs_error: ``max |analytical - numerical|`` over the Jacobian's entries (``inf`` if not finite).
        analytical: the analytical Jacobian's entry there.
        numerical: the numerical (finite-difference) Jacobian's entry there.
        where: (output element, input element) of the worst mismatch, flat indices.

    Example:
        >>> import torch
        >>> from lit_losses.autograd import round_ste
        >>> report = check_gradients(round_ste, torch.tensor([0.2, 1.3]), raise_exception=False)
        >>> report.inputs[0]
        InputReport(index=0, max_abs_error=1.0, analytical=1.0, numerical=0.0, where=(0, 0))
    """

    index: int
    max_abs_error: float
    analytical: float
    numerical: float
    where: tuple[int, ...]
    """(output element, input element) of the worst mismatch, flat indices."""


@dataclass
class GradientReport:
    """What `check_gradients` found.

    Attributes:
        name: the function's name.
        passed: the verdict (``gradcheck``'s, and ``gradgradcheck``'s when it ran).
        inputs: one `InputReport` per differentiable input.
        gradgrad_passed: ``gradgradcheck``'s verdict (``None``: not run).
        message: a readable summary, one line per input.

    Example:
        >>> import torch
        >>> from lit_losses.autograd import softplus
        >>> report = check_gradients(softplus, torch.tensor([0.4, 1.6]), gradgrad=True)
        >>> report.name, report.passed, report.gradgrad_passed, len(report.inputs)
        ('softplus', True, True, 1)
    """

    name: str
    passed: bool
    inputs: list[InputReport] = field(default_factory=list)
    gradgrad_passed: bool | None = None
    message: str = ""


def check_gradients(
    fn: Callable[..., Any],
    *example_inputs: Any,
    gradgrad: bool = False,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    name: str | None = None,
    raise_exception: bool = True,
) -> GradientReport:
    """Check ``fn``'s gradients against central finite differences in float64 (``torch.autograd.gradcheck``).

    Floating-point tensor inputs are copied to float64 leaves that require grad; integer tensors and
    non-tensor arguments are passed through unchanged. The verdict is ``torch.autograd.gradcheck``'s
    (and ``gradgradcheck``'s with ``gradgrad=True``); the report adds, per differentiable input, the
    worst mismatch between the analytical and the numerical Jacobian and where it is.

    Args:
        fn: the function; it returns a tensor or a tuple of tensors.
        *example_inputs: its arguments (keep them small: the Jacobian is built column by column).
        gradgrad: also check second derivatives.
        eps: finite-difference step.
        atol: absolute tolerance.
        rtol: relative tolerance.
        name: the function's name in messages.
        raise_exception: raise `GradientCheckError` on failure (else return the report).

    Returns:
        a `GradientReport` (``passed`` tells the verdict).

    Raises:
        GradientCheckError: the check failed and ``raise_exception`` is true.
        ValueError: no floating-point tensor input, or an input × output Jacobian too large.

    Example:
        >>> import torch
        >>> from lit_losses.autograd import custom_vjp, round_ste
        >>> mul = custom_vjp(lambda x, y: (x * y, (x, y)), lambda s, g: (g * s[1], g * s[0]), name="mul")
        >>> report = check_gradients(mul, torch.tensor([0.4, 1.6]), torch.tensor([2.0, 3.0]))
        >>> report.passed, [r.index for r in report.inputs]
        (True, [0, 1])
        >>> report = check_gradients(round_ste, torch.tensor([0.2, 1.3]), raise_exception=False)
        >>> print(report.message.splitlines()[-1])
          round_ste is marked as a surrogate gradient: a mismatch is expected by design
    """
    label = name or getattr(fn, "name", None) or getattr(fn, "__name__", repr(fn))
    inputs = tuple(
        x.detach().to(torch.float64).requires_grad_(True)
        if isinstance(x, Tensor) and x.is_floating_point()
        else x
        for x in example_inputs
    )
    diff_idx = [i for i, x in enumerate(inputs) if isinstance(x, Tensor) and x.requires_grad]
    if not diff_idx:
        raise ValueError(f"check_gradients({label}): no floating-point tensor input to differentiate")
    reports = [_jacobian_mismatch(fn, inputs, i, eps=eps) for i in diff_idx]
    passed = torch.autograd.gradcheck(fn, inputs, eps=eps, atol=atol, rtol=rtol, raise_exception=False)
    gradgrad_passed = None
    if gradgrad:
        gradgrad_passed = torch.autograd.gradgradcheck(
            fn, inputs, eps=eps, atol=atol, rtol=rtol, raise_exception=False
        )
    ok = passed and gradgrad_passed is not False
    lines = [f"check_gradients({label}): {'passed' if ok else 'FAILED'}"]
    for r in reports:
        lines.append(
            f"  input {r.index}: worst |analytical - numerical| = {r.max_abs_error:.3e} at (output, input) "
            f"element {r.where}: analytical {r.analytical:.6g}, numerical {r.numerical:.6g}"
        )
    if gradgrad_passed is False:
        lines.append("  second derivatives (gradgradcheck) disagree with finite differences")
    if not ok and is_surrogate(fn):
        lines.append(f"  {label} is marked as a surrogate gradient: a mismatch is expected by design")
    report = GradientReport(label, ok, reports, gradgrad_passed=gradgrad_passed, message="\n".join(lines))
    if not ok and raise_exception:
        raise GradientCheckError(report.message)
    return report


def _flat_outputs(fn: Callable[..., Any], inputs: Sequence[Any]) -> Tensor:
    out = fn(*inputs)
    outs = out if isinstance(out, tuple | list) else (out,)
    tensors = [o.reshape(-1) for o in outs if isinstance(o, Tensor) and o.is_floating_point()]
    if not tensors:
        raise TypeError("check_gradients: the function returned no floating-point tensor")
    return torch.cat([t.to(torch.float64) for t in tensors])


def _jacobian_mismatch(
    fn: Callable[..., Any], inputs: tuple[Any, ...], index: int, eps: float
) -> InputReport:
    x = inputs[index]
    out = _flat_outputs(fn, inputs)
    if out.numel() * x.numel() > 4_000_000:
        raise ValueError(
            f"check_gradients: input {index} ({x.numel()} elements) × output ({out.numel()} elements) "
            "is too large for a full Jacobian; use smaller example inputs"
        )
    analytical = torch.zeros(out.numel(), x.numel(), dtype=torch.float64)
    for j in range(out.numel()):
        (g,) = torch.autograd.grad(out[j], x, retain_graph=True, allow_unused=True)
        if g is not None:
            analytical[j] = g.reshape(-1).to(torch.float64)
    numerical = torch.zeros_like(analytical)
    with torch.no_grad():
        flat = x.detach().reshape(-1)
        for k in range(x.numel()):
            shifted = []
            for sign in (1.0, -1.0):
                probe = flat.clone()
                probe[k] += sign * eps
                args = list(inputs)
                args[index] = probe.reshape(x.shape)
                shifted.append(_flat_outputs(fn, args))
            numerical[:, k] = (shifted[0] - shifted[1]) / (2 * eps)
    diff = (analytical - numerical).abs()
    worst = int(torch.argmax(diff)) if diff.numel() else 0
    j, k = divmod(worst, max(x.numel(), 1))
    err = float(diff.reshape(-1)[worst]) if diff.numel() else 0.0
    return InputReport(
        index,
        err if math.isfinite(err) else float("inf"),
        float(analytical[j, k]) if diff.numel() else 0.0,
        numerical=float(numerical[j, k]) if diff.numel() else 0.0,
        where=(j, k),
    )
