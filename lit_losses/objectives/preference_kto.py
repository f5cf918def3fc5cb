"""`kto_loss`: TRL's ``KTOTrainer`` losses (``kto``, ``apo_zero_unpaired``), one value per sequence.

Unpaired data: each sequence is a prompt with one completion, desirable (``label`` true) or not, and
its loss a function of its log-ratio ``r = π − ρ`` (policy minus reference sums of completion-token
log-probabilities; `kto_loss`'s table). KTO's reference point is the KL estimate
``z = max(0, mean(π_KL − ρ_KL))`` over mismatched pairs (each prompt with another record's completion),
detached: TRL's estimate over one micro-batch, averaged over the processes. Pass the rows' values
(``kl_logps``, ``ref_kl_logps``: their mean is taken here) or the estimate ``kl`` itself (e.g. averaged
over processes). TRL's loss is the mean of ``losses`` over the sequences; it logs ``kl``, and the
rewards ``β r`` (detached) and log-probabilities averaged over the desirable and the undesirable
sequences apart.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lit_losses.choices import check_choice
from lit_losses.objectives.options import check_number
from lit_losses.objectives.preference_checks import check_numbers
from lit_losses.trl_fields import KTOLossType


class KTOLoss(NamedTuple):
    """`kto_loss`'s values: per sequence ``[B]``, and the KL estimate."""

    losses: Tensor
    """The weighted loss of each sequence (with gradient); TRL's loss is their mean."""
    rewards: Tensor
    """``β r``, detached (TRL's ``rewards/chosen`` and ``rewards/rejected``: means over each label)."""
    kl: Tensor
    """``z``, 0-d, detached (TRL's ``kl``; 0 for ``apo_zero_unpaired``)."""


def kl_estimate(kl_logps: Tensor | None, ref_kl_logps: Tensor | None, kl: Tensor | float | None) -> Tensor:
    """KTO's reference point ``z = max(0, mean(π_KL − ρ_KL))`` or ``max(0, kl)``, detached (0-d).

    Example:
        >>> import torch
        >>> kl_estimate(torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -4.5]), None)
        tensor(0.2500)
        >>> kl_estimate(None, None, -0.1)
        tensor(0.)
    """
    if kl is not None:
        if kl_logps is not None or ref_kl_logps is not None:
            raise ValueError("kto_loss: give kl or (kl_logps, ref_kl_logps), not both")
        return torch.as_tensor(kl).detach().clamp_min(0)
    if kl_logps is None or ref_kl_logps is None:
        raise ValueError("kto_loss: loss_type 'kto' needs kl_logps and ref_kl_logps (or the estimate kl)")
    return (kl_logps - ref_kl_logps).mean().detach().clamp_min(0)


def kto_loss(
    logps: Tensor,
    ref_logps: Tensor,
    label: Tensor,
    *,
    loss_type: KTOLossType = "kto",
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    kl_logps: Tensor | None = None,
    ref_kl_logps: Tensor | None = None,
    kl: Tensor | float | None = None,
) -> KTOLoss:
    """TRL's KTO loss of each sequence, weighted by its kind.

    With ``r = π − ρ`` the sequence's log-ratio and ``z`` the KL estimate:

    | ``loss_type`` | desirable (× ``desirable_weight``) | undesirable (× ``undesirable_weight``) |
    | --- | --- | --- |
    | ``kto`` | ``1 − σ(β(r − z))`` | ``1 − σ(β(z − r))`` |
    | ``apo_zero_unpaired`` | ``1 − σ(βr)`` | ``σ(βr)`` |

    Args:
        logps: ``[B]`` the policy's sums of completion-token log-probabilities ``π``.
        ref_logps: ``[B]`` the reference's ``ρ`` (no gradient flows into them).
        label: ``[B]`` bool, desirable (TRL's ``label``).
        loss_type: ``kto`` or ``apo_zero_unpaired``.
        beta: ``β > 0``.
        desirable_weight: the weight of desirable sequences' losses (``> 0``).
        undesirable_weight: the weight of undesirable sequences' losses (``> 0``).
        kl_logps: ``[B']`` the policy's sums over the mismatched pairs' completions (``kto``).
        ref_kl_logps: ``[B']`` the reference's.
        kl: the estimate instead of the rows (a number or 0-d tensor; clamped at 0, detached).

    Returns:
        `KTOLoss` ``(losses, rewards, kl)``.

    Example:
        >>> import torch
        >>> out = kto_loss(torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -4.5]),
        ...                torch.tensor([True, False]), beta=1.0, kl=0.25)
        >>> out.losses, out.rewards
        (tensor([0.3208, 0.3208]), tensor([ 1.0000, -0.5000]))
    """
    check_choice(loss_type, KTOLossType, "loss_type")
    check_numbers(beta=beta, label_smoothing=0.0, where="")
    check_number(desirable_weight, "desirable_weight", "> 0")
    check_number(undesirable_weight, "undesirable_weight", "> 0")
    if logps.dim() != 1 or logps.shape != ref_logps.shape or label.shape != logps.shape:
        raise ValueError(
            f"kto_loss takes one value per sequence [B]: logps {tuple(logps.shape)}, ref_logps "
            f"{tuple(ref_logps.shape)}, label {tuple(label.shape)}"
        )
    logratios = logps - ref_logps.detach()
    if loss_type == "kto":
        z = kl_estimate(kl_logps, ref_kl_logps, kl).to(logratios)
        desirable = 1 - torch.sigmoid(beta * (logratios - z))
        undesirable = 1 - torch.sigmoid(beta * (z - logratios))
    else:
        z = logratios.new_zeros(())
        desirable = 1 - torch.sigmoid(beta * logratios)
        undesirable = torch.sigmoid(beta * logratios)
    losses = torch.where(label.bool(), desirable_weight * desirable, undesirable_weight * undesirable)
    return KTOLoss(losses=losses, rewards=beta * logratios.detach(), kl=z)
