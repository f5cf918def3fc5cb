"""The argument checks that the preference losses share: one value per pair, ``beta``, ``label_smoothing``."""

from __future__ import annotations

from torch import Tensor

from lit_losses.errors import ConfigError
from lit_losses.objectives.options import check_number, is_number


def check_pair(chosen_logps: Tensor, rejected_logps: Tensor, where: str) -> None:
    """Both ``[P]``, of one shape (`ValueError` naming ``where``, the function).

    Example:
        >>> import torch
        >>> check_pair(torch.zeros(2), torch.zeros(3), "cpo_loss")
        Traceback (most recent call last):
        ...
        ValueError: cpo_loss takes one value per pair [P]: chosen_logps (2,), rejected_logps (3,)
    """
    if chosen_logps.dim() != 1 or chosen_logps.shape != rejected_logps.shape:
        raise ValueError(
            f"{where} takes one value per pair [P]: chosen_logps {tuple(chosen_logps.shape)}, "
            f"rejected_logps {tuple(rejected_logps.shape)}"
        )


def check_numbers(*, beta: float, label_smoothing: float, where: str) -> None:
    """``beta`` finite ``> 0``, ``label_smoothing`` in ``[0, 0.5)`` (`ConfigError`; ``where`` prefixes
    the names: ``"model.dpo."``, or ``""`` for a function's arguments).

    Example:
        >>> check_numbers(beta=0.0, label_smoothing=0.0, where="model.dpo.")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.dpo.beta must be a finite number > 0, got 0.0
    """
    check_number(beta, f"{where}beta", "> 0")
    if not (is_number(label_smoothing) and 0 <= label_smoothing < 0.5):
        raise ConfigError(
            f"{where}label_smoothing must lie in [0, 0.5) (the probability that a preference label is "
            f"flipped), got {label_smoothing!r}"
        )
