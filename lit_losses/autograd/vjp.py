"""Custom vector-Jacobian products: `custom_vjp` turns a forward and a backward rule into a primitive.

A custom gradient turns a function into a primitive: you give its value (``forward``) and its
vector-Jacobian product (``backward``), and autograd uses your rule instead of differentiating the
forward. Such rules bypass autograd, so check each one with `check_gradients`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["CustomVJP", "custom_vjp"]

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

    Usually made with `custom_vjp`.

    Args:
        forward: ``forward(*inputs) -> (output, saved)``.
        backward: ``backward(saved, grad_output) -> one gradient per input``.
        name: the op's name in error messages (default: ``forward.__name__``).
        surrogate: the backward is deliberately not the derivative (e.g. straight-through).

    Example:
        >>> import torch
        >>> double = CustomVJP(lambda x: (2 * x, None), lambda saved, g: (2 * g,), name="double")
        >>> x = torch.tensor([0.4, 1.6], requires_grad=True)
        >>> double(x).sum().backward()
        >>> x.grad
        tensor([2., 2.])
        >>> double.name, double.is_surrogate
        ('double', False)
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
            layout, new = _saved_layout(saved if saved_is_tuple else (saved,), inputs, outputs)
            return (is_tuple, len(outputs), (layout, saved_is_tuple), *outputs, *new)

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
            saved = [_restore_saved(kind, ref, inputs, by_slot) for kind, ref in ctx.layout]
            saved_obj = tuple(saved) if ctx.saved_is_tuple else saved[0]
            grad_out = grads[3 : 3 + ctx.n_out]
            grad_obj = tuple(grad_out) if ctx.n_out > 1 else grad_out[0]
            result = _check_grads(name, inputs, backward_fn(saved_obj, grad_obj))
            return tuple(g if isinstance(x, Tensor) else None for x, g in zip(inputs, result, strict=True))

    _Function.__name__ = _Function.__qualname__ = f"CustomVJP_{name}"
    return _Function


def _saved_layout(
    items: Sequence[Any], inputs: Sequence[Any], outputs: Sequence[Any]
) -> tuple[tuple[tuple[str, Any], ...], list[Tensor]]:
    """Where each saved item lives: ``(input, i)``, ``(output, j)``, ``(new, k)`` for the ``k``-th
    intermediate tensor (returned detached in the list), or ``(value, item)`` for a Python value."""
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
    return tuple(layout), new


def _restore_saved(kind: str, ref: Any, inputs: Sequence[Any], by_slot: dict[tuple[str, int], Tensor]) -> Any:
    """The saved item that `_saved_layout` recorded as ``(kind, ref)``, from backward's tensors."""
    if kind == _IN:
        return inputs[ref]
    if kind in (_OUT, _NEW):
        return by_slot[("out" if kind == _OUT else "new", ref)]
    return ref


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
    """Make ``forward`` a primitive whose gradient is ``backward``; the arguments are `CustomVJP`'s.

    Returns:
        the primitive, a `CustomVJP` called like ``forward`` and returning its ``output``.

    Example:
        >>> import torch
        >>> def forward(x, y):
        ...     return x * y, (x, y)
        >>> def backward(saved, g):
        ...     x, y = saved
        ...     return g * y, g * x
        >>> mul = custom_vjp(forward, backward, name="mul")
        >>> x = torch.tensor([0.4, 1.6], requires_grad=True)
        >>> y = torch.tensor([2.0, 3.0])
        >>> out = mul(x, y)
        >>> out.detach()
        tensor([0.8000, 4.8000])
        >>> out.sum().backward()
        >>> x.grad
        tensor([2., 3.])
    """
    return CustomVJP(forward, backward, name=name, surrogate=surrogate)
