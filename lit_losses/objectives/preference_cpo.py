"""`cpo_loss` and `simpo_loss`: TRL's ``CPOTrainer`` losses (CPO, SimPO, AlphaPO), reference-free, per pair.

TRL's ``CPOTrainer.cpo_loss`` takes the policy's sequence log-probabilities ``π_w, π_l`` of the chosen
and rejected completions: sums over completion tokens for ``sigmoid`` and ``hinge``, means for ``ipo``
and ``simpo`` (its ``average_log_prob``). AlphaPO (``alpha = a ≠ 0``) replaces them by the rewards
``u = (1 − e^{−aπ}) / a`` (TRL's ``(1 − p^{−a}) / a`` with ``p = e^{π}``, here without forming ``p``,
which underflows for long sums). `cpo_loss`'s table gives each loss type; ``cpo_alpha`` times the chosen
completions' NLL is added, each pair's share of its token mean (`nll_shares`: TRL's ``nll_loss`` is one
token mean over the micro-batch's chosen completions). The rewards are ``β π`` (``β u`` with AlphaPO),
detached. SimPO is ``simpo`` without the NLL term (``cpo_alpha = 0``); TRL's ``loss_type="alphapo"`` is
``simpo`` with ``cpo_alpha = 0`` and ``alpha ≠ 0``.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_losses.choices import check_choice
from lit_losses.objectives.preference_checks import check_numbers, check_pair
from lit_losses.objectives.preference_sequences import nll_shares

CPOLossType = Literal["sigmoid", "hinge", "ipo", "simpo"]
"""The loss types of TRL's ``CPOTrainer.cpo_loss`` (its config's ``alphapo`` maps to ``simpo``)."""


class CPOLoss(NamedTuple):
    """`cpo_loss`'s per-pair values ``[P]``; their mean over the pairs is TRL's loss and metrics."""

    losses: Tensor
    """The preference loss plus ``cpo_alpha`` times the NLL share (with gradient)."""
    chosen_rewards: Tensor
    """``β π_w`` (``β u_w`` with AlphaPO), detached (TRL's ``rewards/chosen``)."""
    rejected_rewards: Tensor
    """``β π_l`` (``β u_l``), detached (TRL's ``rewards/rejected``)."""
    nll_loss: Tensor
    """The chosen NLL's share (`nll_shares`), detached; zeros when ``cpo_alpha = 0`` (TRL's ``nll_loss``)."""


def alphapo_rewards(logps: Tensor, alpha: float) -> Tensor:
    """AlphaPO's ``u = (1 − e^{−a π}) / a`` of sequence log-probabilities ``π`` (``π`` itself for ``a = 0``).

    Example:
        >>> import torch
        >>> alphapo_rewards(torch.tensor([-1.0, 0.0]), alpha=0.5)
        tensor([-1.2974,  0.0000])
    """
    if alpha == 0:
        return logps
    return -torch.expm1(-alpha * logps) / alpha


def cpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    *,
    loss_type: CPOLossType = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    alpha: float = 0.0,
    cpo_alpha: float = 1.0,
    chosen_nll: Tensor | None = None,
    chosen_nll_tokens: Tensor | float | None = None,
) -> CPOLoss:
    """TRL's CPO loss of each pair (``CPOTrainer.cpo_loss`` plus its ``cpo_alpha`` NLL term).

    With ``x = u_w − u_l`` (AlphaPO's rewards; ``π_w − π_l`` when ``alpha = 0``) and ``ε`` the
    ``label_smoothing``, each pair's loss is that of its type plus ``cpo_alpha`` times its NLL share:

    | ``loss_type`` | per-pair loss |
    | --- | --- |
    | ``sigmoid`` | ``−(1−ε) log σ(βx) − ε log σ(−βx)`` |
    | ``simpo`` | the same with ``x − γ/β`` (``γ = simpo_gamma``) |
    | ``hinge`` | ``relu(1 − βx)`` |
    | ``ipo`` | ``(x − 1/(2β))²`` |

    The mean of ``losses`` over the pairs is TRL's ``losses.mean() + cpo_alpha * nll_loss`` for a
    micro-batch of these pairs. Options a loss type does not read are ignored (the ``model.cpo``
    preset refuses them).

    Args:
        chosen_logps: ``[P]`` the policy's ``π_w``: sums over completion tokens (``sigmoid``,
            ``hinge``) or means (``ipo``, ``simpo``), as TRL forms them.
        rejected_logps: ``[P]`` ``π_l``, likewise.
        loss_type: ``sigmoid``, ``hinge``, ``ipo`` or ``simpo``.
        beta: ``β > 0``.
        label_smoothing: ``ε`` in ``[0, 0.5)`` (``sigmoid`` and ``simpo``).
        simpo_gamma: SimPO's target margin ``γ`` (``simpo``).
        alpha: AlphaPO's ``a`` (0: the log-probabilities themselves).
        cpo_alpha: the weight of the chosen NLL term (0: none).
        chosen_nll: ``[P]`` the chosen completions' summed NLL ``Σ_t −ℓ_t`` (needed when
            ``cpo_alpha ≠ 0``).
        chosen_nll_tokens: their token counts ``[P]``, or the mean count per pair of the whole batch.

    Returns:
        `CPOLoss` ``(losses, chosen_rewards, rejected_rewards, nll_loss)``, each ``[P]``.

    Example:
        >>> import torch
        >>> out = cpo_loss(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]), loss_type="simpo",
        ...                beta=2.0, cpo_alpha=0.0)
        >>> out.losses, out.chosen_rewards
        (tensor([0.4741, 2.5789]), tensor([-2., -4.]))
    """
    check_pair(chosen_logps, rejected_logps, "cpo_loss")
    check_choice(loss_type, CPOLossType, "loss_type")
    check_numbers(beta=beta, label_smoothing=label_smoothing, where="")
    chosen_rewards = alphapo_rewards(chosen_logps, alpha)
    rejected_rewards = alphapo_rewards(rejected_logps, alpha)
    x = chosen_rewards - rejected_rewards
    if loss_type == "simpo":
        x = x - simpo_gamma / beta
    if loss_type in ("sigmoid", "simpo"):
        losses = -F.logsigmoid(beta * x) * (1 - label_smoothing) - F.logsigmoid(-beta * x) * label_smoothing
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * x)
    else:
        losses = (x - 1 / (2 * beta)) ** 2
    nll = torch.zeros_like(losses)
    if cpo_alpha != 0:
        if chosen_nll is None or chosen_nll_tokens is None:
            raise ValueError(f"cpo_loss: cpo_alpha={cpo_alpha} needs chosen_nll and chosen_nll_tokens")
        nll = nll_shares(chosen_nll, chosen_nll_tokens)
        losses = losses + cpo_alpha * nll
    return CPOLoss(
        losses=losses,
        chosen_rewards=beta * chosen_rewards.detach(),
        rejected_rewards=beta * rejected_rewards.detach(),
        nll_loss=nll.detach(),
    )


def simpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    alpha: float = 0.0,
    cpo_alpha: float = 0.0,
    chosen_nll: Tensor | None = None,
    chosen_nll_tokens: Tensor | float | None = None,
) -> CPOLoss:
    """SimPO's loss of each pair: `cpo_loss` with ``loss_type="simpo"``, margin ``gamma``, no NLL term.

    ``−(1−ε) log σ(β(π_w − π_l) − γ) − ε log σ(−β(π_w − π_l) + γ)`` on the length-averaged
    log-probabilities ``π`` (TRL: ``CPOTrainer`` with ``loss_type="simpo"``, ``simpo_gamma = γ``,
    ``cpo_alpha = 0``; AlphaPO with ``alpha ≠ 0``; CPO-SimPO with ``cpo_alpha > 0``).

    Args:
        chosen_logps: ``[P]`` means over the chosen completions' tokens.
        rejected_logps: ``[P]`` means over the rejected completions' tokens.
        beta: ``β > 0``.
        gamma: the target reward margin ``γ`` (TRL's ``simpo_gamma``).
        label_smoothing: ``ε`` in ``[0, 0.5)``.
        alpha: AlphaPO's ``a``.
        cpo_alpha: the weight of the chosen NLL term.
        chosen_nll: ``[P]`` the chosen NLL sums (when ``cpo_alpha ≠ 0``).
        chosen_nll_tokens: their token counts, or the mean count per pair.

    Returns:
        `CPOLoss`.

    Example:
        >>> import torch
        >>> simpo_loss(torch.tensor([-1.0]), torch.tensor([-1.5]), beta=2.0, gamma=1.0).losses
        tensor([0.6931])
    """
    return cpo_loss(
        chosen_logps,
        rejected_logps,
        loss_type="simpo",
        beta=beta,
        label_smoothing=label_smoothing,
        simpo_gamma=gamma,
        alpha=alpha,
        cpo_alpha=cpo_alpha,
        chosen_nll=chosen_nll,
        chosen_nll_tokens=chosen_nll_tokens,
    )
