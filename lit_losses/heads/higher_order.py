"""Double backward (``create_graph=True``) through the head: exact, or one clear refusal.

Every head path either supports it exactly or raises `DoubleBackwardError` when it is asked for; none
returns first-order gradients that silently do not require grad (a gradient penalty built on them would be
dropped without a word):

=============================================  ===========================================================
path                                           double backward
=============================================  ===========================================================
``chunked`` per-token outputs                  exact: backward recomputes each chunk with differentiable ops
``chunked`` ``weighted_ce``                    exact: the same recompute (instead of the forward gradients)
``chunked`` ``pointwise_loss``                 refused: the chunk loss ran in forward; its second
                                               derivatives are gone
``naive``                                      exact (autograd through materialized logits)
``torch`` (``F.linear_cross_entropy``)         refused: torch's kernel is first-order only
``liger``                                      refused: gradients computed in forward by the kernel
``liger_scaled``, ``cce``                      refused: the kernels' backward is first-order only
=============================================  ===========================================================
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class DoubleBackwardError(RuntimeError):
    """A head path that computes first-order gradients only was differentiated with ``create_graph=True``."""


def refuse_double_backward(what: str, instead: str) -> None:
    """Raise `DoubleBackwardError` when called in a backward pass that builds a graph (``create_graph=True``).

    Args:
        what: the path that cannot, e.g. ``"head backend 'torch'"``.
        instead: what to use instead.
    """
    if torch.is_grad_enabled():
        raise DoubleBackwardError(
            f"{what} computes first-order gradients only, so it cannot be differentiated twice "
            f"(create_graph=True); {instead}"
        )


class _FirstOrderOnly(torch.autograd.Function):
    """Identity whose backward refuses to build a graph (see `first_order_only`)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, what: str, instead: str) -> Tensor:
        ctx.what = what
        ctx.instead = instead
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        refuse_double_backward(ctx.what, ctx.instead)
        return grad, None, None


def first_order_only(x: Tensor, what: str, instead: str) -> Tensor:
    """``x``, with a backward that raises `DoubleBackwardError` under ``create_graph=True``.

    Put on the output of a computation whose own backward is first-order only (a fused kernel), it turns a
    silently first-order gradient into a clear error.

    Example:
        >>> import torch
        >>> from lit_losses.heads.higher_order import DoubleBackwardError, first_order_only
        >>> x = torch.ones(2, requires_grad=True)
        >>> y = first_order_only(x * 3, "this kernel", "use another").sum()
        >>> torch.autograd.grad(y, x, retain_graph=True)[0].tolist()
        [3.0, 3.0]
        >>> try:
        ...     torch.autograd.grad(y, x, create_graph=True)
        ... except DoubleBackwardError as err:
        ...     print(str(err).split(", so")[0])
        this kernel computes first-order gradients only
    """
    return _FirstOrderOnly.apply(x, what, instead)
