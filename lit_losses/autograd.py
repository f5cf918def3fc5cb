"""Custom-gradient toolkit: custom VJPs, named surrogate gradients, stable primitives, gradient checks.

A custom gradient turns a function into a primitive: you give its value (``forward``) and its
vector-Jacobian product (``backward``), and autograd uses your rule instead of differentiating the
forward. Such rules bypass autograd, so check each one with `check_gradients`.

Surrogate gradients (straight-through estimators) are *by design* not the derivative of their
forward: `check_gradients` fails on them, and says so in its message when the function is marked with
``custom_vjp(..., surrogate=True)`` or `mark_surrogate`. Test a surrogate's backward against its
documented rule instead.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "CustomVJP",
    "GradientCheckError",
    "GradientReport",
    "check_gradients",
    "check_regularizer",
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

_IN, _OUT, _NEW = "input", "output", "new"


class CustomVJP:
    """A function with a user-given vector-Jacobian product, as a ``torch.autograd.Function``.

    ``forward(*inputs) -> (output, saved)``: ``output`` a tensor or a tuple of tensors; ``saved``
    anything (a tensor, a tuple of tensors and Python values, ``None``). ``backward(saved,
    grad_output) -> one gradient per input``: ``grad_output`` is shaped like ``output`` (a tuple for
    several outputs); return a tuple with one entry per positional input, ``None`` for inputs that are
    not differentiable (non-tensors, integer tensors, or on purpose). Keyword arguments are bound to
    positions by ``forward``'s signature.

    Built on the split-form ``torch.autograd.Function`` (``setup_context``), so it works under
    ``torch.compile`` and ``torch.func`` (grad, vjp) when both rules are made of PyTorch ops. Saved
    tensors that are inputs or outputs keep their graph (double backward flows through them);
    intermediate saved tensors are saved detached.

    Returned gradients are checked: their number, and each one's shape and dtype against its input;
    an error names the op and the input index.
    """

    def __init__(
        self,
        forward: Callable[..., tuple[Any, Any]],
        backward: Callable[[Any, Any], Any],
        name: str | None = None,
        surrogate: bool = False,
    ) -> None:
        self.forward_fn, self.backward_fn = forward, backward
        self.name = name or getattr(forward, "__name__", "custom_vjp")
        self.signature = inspect.signature(forward)
        self.is_surrogate = surrogate
        self._function = _make_function(forward, backward, self.name)
        functools.update_wrapper(self, forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if bound.kwargs:
            raise TypeError(
                f"custom_vjp {self.name!r}: keyword-only or **kwargs parameters are not supported"
            )
        result = self._function.apply(*bound.args)
        is_tuple, n_out = result[0], result[1]
        outputs = result[3 : 3 + n_out]
        return tuple(outputs) if is_tuple else outputs[0]


def _check_grads(name: str, inputs: Sequence[Any], grads: Any) -> tuple[Any, ...]:
    if not isinstance(grads, tuple):
        grads = (grads,) if isinstance(grads, Tensor) or grads is None else tuple(grads)
    if len(grads) != len(inputs):
        raise ValueError(
            f"custom_vjp {name!r}: backward returned {len(grads)} gradient(s) for "
            f"{len(inputs)} input(s); return one per input (None where there is none)"
        )
    for i, (x, g) in enumerate(zip(inputs, grads, strict=True)):
        if g is None:
            continue
        if not isinstance(x, Tensor):
            raise TypeError(
                f"custom_vjp {name!r}: input {i} is a {type(x).__name__}, not a tensor; its "
                f"gradient must be None, got {type(g).__name__}"
            )
        if not isinstance(g, Tensor):
            raise TypeError(f"custom_vjp {name!r}: gradient of input {i} is a {type(g).__name__}")
        if g.shape != x.shape:
            raise ValueError(
                f"custom_vjp {name!r}: gradient of input {i} has shape {tuple(g.shape)}, "
                f"the input has shape {tuple(x.shape)}"
            )
        if g.dtype != x.dtype:
            raise TypeError(
                f"custom_vjp {name!r}: gradient of input {i} has dtype {g.dtype}, the input "
                f"has dtype {x.dtype}"
            )
    return grads


def _make_function(forward_fn: Callable, backward_fn: Callable, name: str) -> type[torch.autograd.Function]:
    class _Function(torch.autograd.Function):
        @staticmethod
        def forward(*inputs: Any) -> Any:
            output, saved = forward_fn(*inputs)
            is_tuple = isinstance(output, tuple)
            outputs = output if is_tuple else (output,)
            saved_is_tuple = isinstance(saved, tuple)
            items = saved if saved_is_tuple else (saved,)
            layout, new = [], []
            for item in items:
                where = _locate(item, inputs, outputs)
                if where is not None:
                    layout.append(where)
                elif isinstance(item, Tensor):
                    layout.append((_NEW, len(new)))
                    new.append(item.detach())
                else:
                    layout.append(("value", item))
            return (is_tuple, len(outputs), (tuple(layout), saved_is_tuple), *outputs, *new)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            _, n_out, (layout, saved_is_tuple), *rest = output
            outputs, new = rest[:n_out], rest[n_out:]
            tensors = [t for t in (*inputs, *outputs, *new) if isinstance(t, Tensor)]
            ctx.save_for_backward(*tensors)
            ctx.layout, ctx.saved_is_tuple, ctx.n_out = layout, saved_is_tuple, n_out
            ctx.inputs_meta = [None if not isinstance(x, Tensor) else x for x in inputs]
            ctx.tensor_slots = (
                [("in", i) for i, x in enumerate(inputs) if isinstance(x, Tensor)]
                + [("out", j) for j in range(n_out)]
                + [("new", k) for k in range(len(new))]
            )
            ctx.n_inputs = len(inputs)
            ctx.non_tensor_inputs = {i: x for i, x in enumerate(inputs) if not isinstance(x, Tensor)}
            if new:
                ctx.mark_non_differentiable(*new)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
            by_slot = dict(zip(ctx.tensor_slots, ctx.saved_tensors, strict=True))
            inputs = [
                ctx.non_tensor_inputs[i] if i in ctx.non_tensor_inputs else by_slot[("in", i)]
                for i in range(ctx.n_inputs)
            ]
            saved = []
            for kind, ref in ctx.layout:
                if kind == _IN:
                    saved.append(inputs[ref])
                elif kind == _OUT:
                    saved.append(by_slot[("out", ref)])
                elif kind == _NEW:
                    saved.append(by_slot[("new", ref)])
                else:
                    saved.append(ref)
            saved_obj = tuple(saved) if ctx.saved_is_tuple else saved[0]
            grad_out = grads[3 : 3 + ctx.n_out]
            grad_obj = tuple(grad_out) if ctx.n_out > 1 else grad_out[0]
            result = _check_grads(name, inputs, backward_fn(saved_obj, grad_obj))
            return tuple(g if isinstance(x, Tensor) else None for x, g in zip(inputs, result, strict=True))

    _Function.__name__ = _Function.__qualname__ = f"CustomVJP_{name}"
    return _Function


def _locate(item: Any, inputs: Sequence[Any], outputs: Sequence[Any]) -> tuple[str, int] | None:
    if not isinstance(item, Tensor):
        return None
    for i, x in enumerate(inputs):
        if x is item:
            return (_IN, i)
    for j, y in enumerate(outputs):
        if y is item:
            return (_OUT, j)
    return None


def custom_vjp(
    forward: Callable[..., tuple[Any, Any]],
    backward: Callable[[Any, Any], Any],
    *,
    name: str | None = None,
    surrogate: bool = False,
) -> CustomVJP:
    """Make ``forward`` a primitive whose gradient is ``backward`` (see `CustomVJP`).

    Example::

        def forward(x, y):
            return x * y, (x, y)

        def backward(saved, g):
            x, y = saved
            return g * y, g * x

        mul = custom_vjp(forward, backward, name="mul")

    Args:
        forward: ``forward(*inputs) -> (output, saved)``.
        backward: ``backward(saved, grad_output) -> one gradient per input``.
        name: the op's name in error messages (default: ``forward.__name__``).
        surrogate: the backward is deliberately not the derivative (e.g. straight-through).
    """
    return CustomVJP(forward, backward, name=name, surrogate=surrogate)


def mark_surrogate(fn: Callable) -> Callable:
    """Mark ``fn`` as having a surrogate gradient (`check_gradients` then explains its expected failure)."""
    fn.is_surrogate = True  # type: ignore[attr-defined]
    return fn


def is_surrogate(fn: Callable) -> bool:
    return bool(getattr(fn, "is_surrogate", False))


# ---- named surrogates and gradient plumbing ---------------------------------------------------
def straight_through(forward_fn: Callable[[Tensor], Tensor], name: str | None = None) -> CustomVJP:
    """``forward_fn`` in the forward pass, identity in the backward pass: ``∂y/∂x := I``.

    The value is exactly ``forward_fn(x)`` (not ``x + (f(x) - x).detach()``, which rounds).
    """
    label = name or f"straight_through({getattr(forward_fn, '__name__', 'fn')})"

    def forward(x: Tensor) -> tuple[Tensor, None]:
        return forward_fn(x), None

    def backward(saved: None, grad: Tensor) -> tuple[Tensor]:
        return (grad,)

    return custom_vjp(forward, backward, name=label, surrogate=True)


round_ste = straight_through(torch.round, name="round_ste")
round_ste.__doc__ = "``round(x)``, with the straight-through gradient ``∂/∂x = 1``."
sign_ste = straight_through(torch.sign, name="sign_ste")
sign_ste.__doc__ = "``sign(x)``, with the straight-through gradient ``∂/∂x = 1``."


def _clamp_forward(x: Tensor, min: float | None = None, max: float | None = None) -> tuple[Tensor, None]:
    return torch.clamp(x, min, max), None


def _pass_through_first(saved: None, grad: Tensor) -> tuple[Tensor, None, None]:
    return grad, None, None


clamp_ste = custom_vjp(_clamp_forward, _pass_through_first, name="clamp_ste", surrogate=True)
clamp_ste.__doc__ = "``clamp(x, min, max)``, with the gradient passed through unchanged everywhere."


def stop_gradient(x: Tensor) -> Tensor:
    """``x`` as a constant: the same value, no gradient (``x.detach()``)."""
    return x.detach()


def _scale_forward(x: Tensor, scale: float) -> tuple[Tensor, float]:
    return x.view_as(x), scale


def _scale_backward(scale: float, grad: Tensor) -> tuple[Tensor, None]:
    return grad * scale, None


scale_gradient = custom_vjp(_scale_forward, _scale_backward, name="scale_gradient", surrogate=True)
scale_gradient.__doc__ = "Identity in the forward pass; the gradient is multiplied by ``scale`` (a number)."


# ---- numerically stable primitives ------------------------------------------------------------
def _softplus_forward(x: Tensor) -> tuple[Tensor, Tensor]:
    return torch.clamp_min(x, 0) + torch.log1p(torch.exp(-torch.abs(x))), x


def _softplus_backward(x: Tensor, grad: Tensor) -> tuple[Tensor]:
    return (grad * torch.sigmoid(x),)


softplus = custom_vjp(_softplus_forward, _softplus_backward, name="softplus")
softplus.__doc__ = """``log(1 + exp(x))`` as ``max(x, 0) + log1p(exp(-|x|))``; derivative ``sigmoid(x)``.

Finite value and gradient for every finite ``x`` (``|x| = 1000`` included) in float32 and float64.
"""


def _logsigmoid_forward(x: Tensor) -> tuple[Tensor, Tensor]:
    return -(torch.clamp_min(-x, 0) + torch.log1p(torch.exp(-torch.abs(x)))), x


def _logsigmoid_backward(x: Tensor, grad: Tensor) -> tuple[Tensor]:
    return (grad * torch.sigmoid(-x),)


logsigmoid = custom_vjp(_logsigmoid_forward, _logsigmoid_backward, name="logsigmoid")
logsigmoid.__doc__ = """``log(sigmoid(x)) = -softplus(-x)``, stable; derivative ``sigmoid(-x)``."""


# ---- gradient checks --------------------------------------------------------------------------
class GradientCheckError(AssertionError):
    """A custom gradient disagrees with finite differences (the message has the worst mismatch per input)."""


@dataclass
class InputReport:
    """Worst mismatch between the analytical and the numerical Jacobian of one input."""

    index: int
    max_abs_error: float
    analytical: float
    numerical: float
    where: tuple[int, ...]
    """(output element, input element) of the worst mismatch, flat indices."""


@dataclass
class GradientReport:
    """What `check_gradients` found."""

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
        eps, atol, rtol: finite-difference step and tolerances.
        name: the function's name in messages.
        raise_exception: raise `GradientCheckError` on failure (else return the report).

    Returns:
        a `GradientReport` (``passed`` tells the verdict).
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
    reports = [_jacobian_mismatch(fn, inputs, i, eps) for i in diff_idx]
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
    report = GradientReport(label, ok, reports, gradgrad_passed, "\n".join(lines))
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
        float(numerical[j, k]) if diff.numel() else 0.0,
        (j, k),
    )


def check_regularizer(
    term: Any,
    logprobs: Tensor,
    mask: Tensor | None = None,
    *,
    lse: Tensor | None = None,
    entropy: Tensor | None = None,
    hidden: Tensor | None = None,
    batch: dict[str, Any] | None = None,
    agg: str = "token-mean",
    **kwargs: Any,
) -> GradientReport:
    """`check_gradients` for a loss term, against its inputs (log-probabilities and the rest).

    The term (a registry name, a callable ``fn(ctx)`` or a `RegularizerSpec`) is run the way
    `RegularizerSet` runs it (output checks, aggregation with ``agg`` over ``mask``), as a function of
    the float64 tensors given among ``logprobs``, ``lse``, ``entropy`` and ``hidden``. ``batch`` supplies
    the other keys the term reads (``labels`` is derived from ``mask`` when absent).
    """
    from lit_losses.aggregation import GlobalStats
    from lit_losses.heads import HeadOutput
    from lit_losses.module import LossContext
    from lit_losses.regularizers import RegularizerSet, RegularizerSpec

    spec = term if isinstance(term, RegularizerSpec) else None
    if spec is None:
        spec = RegularizerSpec(
            name=term if isinstance(term, str) else getattr(term, "__name__", "term"), fn=term
        )
    mask = torch.ones(logprobs.shape, dtype=torch.bool) if mask is None else mask.bool()
    data = dict(batch or {})
    data.setdefault("labels", torch.where(mask, 0, -100))
    terms = RegularizerSet([spec], default_agg=agg)
    stats = GlobalStats.local_only(data, ("labels", *terms.mask_keys()))
    names = [
        n
        for n, t in (("logprobs", logprobs), ("lse", lse), ("entropy", entropy), ("hidden", hidden))
        if t is not None
    ]

    def fn(*tensors: Tensor) -> Tensor:
        values = dict(zip(names, tensors, strict=True))
        head = HeadOutput(values.get("logprobs"), values.get("lse"), values.get("entropy"))
        hidden_ = values.get("hidden", torch.zeros((*logprobs.shape, 1), dtype=torch.float64))
        ctx = LossContext(data, head, hidden_, mask, stats, 0, "train")
        total, _ = terms(ctx)
        return total

    inputs = [t for t in (logprobs, lse, entropy, hidden) if t is not None]
    return check_gradients(fn, *inputs, name=f"regularizer {spec.name!r}", **kwargs)
