"""`orpo_loss`: TRL's ``ORPOTrainer`` loss (odds ratio plus the chosen NLL), reference-free, per pair.

With ``π_w, π_l`` the policy's *mean* log-probabilities over the chosen and rejected completions' tokens
(TRL's ``average_log_prob=True``), the log odds ratio is
``o = (π_w − π_l) − (log(1 − e^{π_w}) − log(1 − e^{π_l}))`` and each pair's loss is
``nll − β log σ(o)``: ``nll`` the chosen NLL's share of its token mean (`nll_shares`). TRL's chosen NLL
is the token mean over the whole chosen sequence, prompt and completion (its labels are every attended
token), whereas ``π_w`` covers the completion only. TRL logs ``log_odds_ratio`` (the mean of
``log σ(o)``) and ``log_odds_chosen`` (the mean of ``o``); the rewards are ``β π``, detached. TRL
computes in float32 (it casts the log-probabilities); here in their dtype, at least float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_losses.objectives.preference_checks import check_numbers, check_pair
from lit_losses.objectives.preference_sequences import nll_shares

LOG_HALF = -0.6931471805599453


class ORPOLoss(NamedTuple):
    """`orpo_loss`'s per-pair values ``[P]``; their mean over the pairs is TRL's loss and metrics."""

    losses: Tensor
    """``nll − β log σ(o)`` (with gradient)."""
    chosen_rewards: Tensor
    """``β π_w``, detached (TRL's ``rewards/chosen``)."""
    rejected_rewards: Tensor
    """``β π_l``, detached (TRL's ``rewards/rejected``)."""
    nll_loss: Tensor
    """The chosen NLL's share, detached (TRL's ``nll_loss``)."""
    log_odds_ratio: Tensor
    """``log σ(o)``, detached (TRL's ``log_odds_ratio``)."""
    log_odds_chosen: Tensor
    """``o``, detached (TRL's ``log_odds_chosen``)."""


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 − eˣ)`` for ``x ≤ 0``, without cancellation (``log1p(−eˣ)`` below ``−log 2``, else
    ``log(−expm1(x))``).

    Example:
        >>> import torch
        >>> log1mexp(torch.tensor([-1e-10, -50.0]))
        tensor([-2.3026e+01, -1.9287e-22])
    """
    return torch.where(x < LOG_HALF, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    chosen_nll: Tensor,
    chosen_nll_tokens: Tensor | float,
) -> ORPOLoss:
    """TRL's ORPO loss of each pair: the chosen NLL minus ``β`` times the log-sigmoid of the log odds ratio.

    The mean of ``losses`` over the pairs is TRL's ``nll_loss − mean(β log σ(o))`` for a micro-batch of
    these pairs.

    Args:
        chosen_logps: ``[P]`` the policy's mean log-probability over each chosen completion's tokens.
        rejected_logps: ``[P]`` likewise for the rejected completions.
        beta: ``β > 0``, the weight of the odds-ratio term (the ORPO paper's ``λ``).
        chosen_nll: ``[P]`` each chosen sequence's summed NLL ``Σ_t −ℓ_t`` over the tokens TRL trains
            (prompt and completion).
        chosen_nll_tokens: their token counts ``[P]``, or the mean count per pair of the whole batch.

    Returns:
        `ORPOLoss` ``(losses, chosen_rewards, rejected_rewards, nll_loss, log_odds_ratio,
        log_odds_chosen)``, each ``[P]``.

    Example:
        >>> import torch
        >>> out = orpo_loss(torch.tensor([-0.5]), torch.tensor([-1.0]), beta=0.1,
        ...                 chosen_nll=torch.tensor([3.0]), chosen_nll_tokens=torch.tensor([4]))
        >>> out.losses, out.log_odds_chosen
        (tensor([0.7820]), tensor([0.9741]))
    """
    check_pair(chosen_logps, rejected_logps, "orpo_loss")
    check_numbers(beta=beta, label_smoothing=0.0, where="")
    dtype = torch.promote_types(chosen_logps.dtype, torch.float32)
    chosen, rejected = chosen_logps.to(dtype), rejected_logps.to(dtype)
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    nll = nll_shares(chosen_nll.to(dtype), chosen_nll_tokens)
    return ORPOLoss(
        losses=nll - beta * ratio,
        chosen_rewards=beta * chosen.detach(),
        rejected_rewards=beta * rejected.detach(),
        nll_loss=nll.detach(),
        log_odds_ratio=ratio.detach(),
        log_odds_chosen=log_odds.detach(),
    )
