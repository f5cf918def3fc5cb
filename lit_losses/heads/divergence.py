"""The per-token divergences of distillation between two distributions given as log-probabilities, and
their gradients with respect to the student's logits, computed over tiles of ``[rows, V]`` columns.

Notation for one token: ``log p`` the student's log-probabilities, ``log q`` the teacher's (both
``log_softmax`` of logits already divided by the temperature), ``β ∈ [0, 1]``,
``m = (1 − β) p + β q`` and ``log m = log(1 − β) + logaddexp(log p, log q + log(β / (1 − β)))`` (no
``exp`` that could underflow to ``log 0``):

=============  =================================================  ========================================
``loss``       per-token value ``ℓ``                               ``∂ℓ/∂a_v`` (``a`` the student's logits)
=============  =================================================  ========================================
``forward_kl`` ``KL(q ‖ p) = Σ_v q_v (log q_v − log p_v)``         ``p_v − q_v``
``reverse_kl`` ``KL(p ‖ q) = Σ_v p_v (log p_v − log q_v)``         ``p_v (log p_v − log q_v − ℓ)``
``jsd``        ``β KL(q ‖ m) + (1 − β) KL(p ‖ m)``                 ``(1 − β) p_v (log p_v − log m_v − S)``
=============  =================================================  ========================================

with ``S = KL(p ‖ m)`` per token. ``jsd`` at ``β = 0`` is exactly ``forward_kl`` and at ``β = 1``
exactly ``reverse_kl`` (TRL's and Liger-Kernel's convention; the mixture formula itself tends to 0 at
both ends). The ``jsd`` gradient: the loss is ``β Σ q log q + (1 − β) Σ p log p − Σ m log m``, whose
derivative with respect to ``p_v`` is ``(1 − β)(log p_v − log m_v)``; the softmax's Jacobian subtracts its
``p``-weighted mean, ``S``.

Every sum is taken over blocks of rows of at most `STRIP_ELEMENTS` values (each block's temporaries are
that small; `row_dot` reads the products without forming them), in the tiles' dtype; the gradient is
written over the student's tile in place, block by block. `Divergence.terms` writes nothing in place:
autograd can differentiate its values, which the ``naive`` path and `lit_losses.heads.topk_distillation`
do.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from lit_losses.choices import check_choice
from lit_losses.errors import ConfigError
from lit_losses.heads.chunked_ops import row_dot

#: The divergences `linear_distillation` and `topk_distillation` compute.
DistillationLoss = Literal["forward_kl", "reverse_kl", "jsd"]
DISTILLATION_LOSSES: tuple[str, ...] = get_args(DistillationLoss)

#: At most this many values per block of rows of a tile (4 MiB of fp32): the temporaries of one block.
STRIP_ELEMENTS = 2**20


def row_strips(rows: int, columns: int) -> Iterator[slice]:
    """Slices of ``rows`` of at most `STRIP_ELEMENTS` values each (at least one row): contiguous blocks of
    a row-major tile whose temporaries stay small.

    Example:
        >>> [(s.start, s.stop) for s in row_strips(5, 2**19)]
        [(0, 2), (2, 4), (4, 5)]
    """
    height = max(1, STRIP_ELEMENTS // max(columns, 1))
    for start in range(0, rows, height):
        yield slice(start, min(start + height, rows))


def check_beta(beta: float, where: str = "beta") -> float:
    """``beta`` as a float if it is a number in ``[0, 1]``, else a `ConfigError` naming it and ``where``.

    Example:
        >>> check_beta(1.5, "model.distillation.beta")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.distillation.beta must be in [0, 1], got 1.5
    """
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise ConfigError(f"{where} must be a number in [0, 1], got {beta!r}")
    if not (0.0 <= beta <= 1.0):  # also refuses NaN
        raise ConfigError(f"{where} must be in [0, 1], got {beta!r}")
    return float(beta)


@dataclass(frozen=True)
class Divergence:
    """One divergence of the module docstring's table, with ``jsd`` at ``β ∈ {0, 1}`` already taken as
    ``forward_kl`` / ``reverse_kl`` (build it with `Divergence.of`).

    Attributes:
        loss: ``forward_kl``, ``reverse_kl`` or ``jsd``.
        beta: ``β`` of ``jsd`` (unused by the two KLs).

    Example:
        >>> import torch
        >>> lp = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.float64), -1)
        >>> lq = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0]], dtype=torch.float64), -1)
        >>> Divergence.of("jsd", 0.0) == Divergence.of("forward_kl")
        True
        >>> value, _ = Divergence.of("forward_kl").terms(lp, lq)
        >>> torch.allclose(value, (lq.exp() * (lq - lp)).sum(-1))
        True
    """

    loss: DistillationLoss
    beta: float = 0.5

    @classmethod
    def of(cls, loss: str, beta: float = 0.5) -> Divergence:
        """The divergence named ``loss`` (checked: `check_choice`, `check_beta`); ``jsd`` at ``β = 0`` is
        ``forward_kl`` and at ``β = 1`` ``reverse_kl``."""
        check_choice(loss, DistillationLoss, "loss")
        beta = check_beta(beta)
        if loss == "jsd" and beta in (0.0, 1.0):
            return cls("forward_kl" if beta == 0.0 else "reverse_kl")
        return cls(loss, beta if loss == "jsd" else 0.5)

    @property
    def needs_stat(self) -> bool:
        """Whether the gradient needs the per-token ``S`` of `terms` (``reverse_kl``: ``ℓ``; ``jsd``:
        ``KL(p ‖ m)``)."""
        return self.loss != "forward_kl"

    def log_mixture(self, lp: Tensor, lq: Tensor) -> Tensor:
        """``log m`` of one strip (``jsd`` only)."""
        shift = math.log(self.beta) - math.log1p(-self.beta)
        return torch.logaddexp(lp, lq + shift).add_(math.log1p(-self.beta))  # its backward reads the inputs

    def terms(self, lp: Tensor, lq: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(ℓ, S)`` per row of tiles ``lp``, ``lq`` ``[rows, V]`` (``S`` ``None`` for ``forward_kl``).

        Nothing is written in place: autograd can differentiate the result.
        """
        values, stats = [], []
        for rows in row_strips(lp.shape[0], lp.shape[1]):
            a, b = lp[rows], lq[rows]
            if self.loss == "forward_kl":
                values.append(row_dot(b.exp(), b - a))
            elif self.loss == "reverse_kl":
                values.append(row_dot(a.exp(), a - b))
            else:
                lm = self.log_mixture(a, b)
                stats.append(row_dot(a.exp(), a - lm))
                values.append(self.beta * row_dot(b.exp(), b - lm) + (1 - self.beta) * stats[-1])
        value = torch.cat(values) if values else lp.new_zeros(0)
        if self.loss == "forward_kl":
            return value, None
        return value, value if self.loss == "reverse_kl" else torch.cat(stats)

    def logit_grad_(self, lp: Tensor, lq: Tensor, stat: Tensor | None, upstream: Tensor) -> Tensor:
        """``g ⊙ ∂ℓ/∂a`` (the module docstring's table) written over ``lp``, strip by strip; returns ``lp``.

        Args:
            lp: ``[rows, V]`` student log-probabilities (overwritten).
            lq: ``[rows, V]`` teacher log-probabilities (read only).
            stat: ``[rows]`` ``S`` from `terms` (``None`` for ``forward_kl``).
            upstream: ``[rows]`` ``g``, the upstream gradient of each token's value.
        """
        g = upstream[:, None] * (1 - self.beta) if self.loss == "jsd" else upstream[:, None]
        for rows in row_strips(lp.shape[0], lp.shape[1]):
            a, b = lp[rows], lq[rows]
            if self.loss == "forward_kl":
                a.exp_().sub_(b.exp())
            else:
                log_ratio = a - b if self.loss == "reverse_kl" else a - self.log_mixture(a, b)
                a.exp_().mul_(log_ratio.sub_(stat[rows, None]))
            a.mul_(g[rows])
        return lp


__all__ = [
    "DISTILLATION_LOSSES",
    "STRIP_ELEMENTS",
    "DistillationLoss",
    "Divergence",
    "check_beta",
    "row_strips",
]
