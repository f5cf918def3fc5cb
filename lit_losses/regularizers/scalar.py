"""`scalar_value`: the one rule by which a scalar loss term enters an optimizer step.

A step is split into micro-batches ``m`` (gradient accumulation × data-parallel ranks), each normalized
by the step's global counts (`GlobalStats`). A term that returns a per-token matrix is aggregated
exactly (`lit_losses.aggregation.aggregate`); a term that returns a scalar ``r_m`` (every function in the
sequence form ``fn(data, logprobs_list)`` does) contributes ``c_m`` below, and the step's value is
``Σ_m c_m`` over every micro-batch and rank. With ``u_m`` the micro-batch's units of the term's mode
(valid tokens for ``token-*``, sequences with a valid token for ``seq-*``) and ``U = Σ_m u_m``:

==========  =====================================  ===================================================
rule        ``c_m``                                the step's value
==========  =====================================  ===================================================
``share``   ``r_m · u_m / U`` (mean modes),        the mean over the step's units when ``r_m`` is the
            ``r_m`` (``token-sum``)                mean over its own (a sum for ``token-sum``)
``sum``     ``r_m``                                ``Σ_m r_m``, as ``forward_backward_custom`` (gradients of
                                                   successive calls add up until the optimizer step)
==========  =====================================  ===================================================

Either way a step made of one micro-batch uses the value the term returned, in every mode. With a plain
``DataLoader`` (no global counts) each micro-batch is its own step's share and Lightning averages them.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from lit_losses.aggregation import AggMode, MaskStats, check_mode
from lit_losses.choices import check_choice

ScalarRule = Literal["share", "sum"]
"""How a term's scalar value enters a micro-batch's loss (the rule: this module's docstring)."""


def scalar_value(
    value: Tensor, rule: ScalarRule, mode: AggMode, local: MaskStats, stats: MaskStats
) -> Tensor:
    """``c_m``, this micro-batch's part of the step's value of a scalar term (see the module doc).

    Args:
        value: the scalar ``r_m`` the term returned.
        rule: ``share`` or ``sum``.
        mode: the term's aggregation mode.
        local: this micro-batch's counts of the term's mask.
        stats: the optimizer step's global counts of the same mask.

    Example:
        >>> import torch
        >>> from lit_losses.aggregation import MaskStats
        >>> r = torch.tensor(2.0)  # a mean over the 3 valid tokens of a micro-batch; the step has 4
        >>> scalar_value(r, "share", "token-mean", MaskStats(3, 1), MaskStats(4, 2))
        tensor(1.5000)
        >>> scalar_value(r, "share", "token-sum", MaskStats(3, 1), MaskStats(4, 2))  # a sum: as is
        tensor(2.)
        >>> scalar_value(r, "sum", "seq-mean-token-mean", MaskStats(3, 1), MaskStats(4, 2))
        tensor(2.)
    """
    check_choice(rule, ScalarRule, "scalar")
    check_mode(mode)
    if rule == "sum" or mode == "token-sum":
        return value
    if mode == "token-mean":
        return value * (local.num_tokens / max(stats.num_tokens, 1))
    return value * (local.num_sequences / max(stats.num_sequences, 1))
