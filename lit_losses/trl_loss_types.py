"""The ``loss_type`` values of TRL's trainer configs, as the ``Literal`` types of the options that take them.

They live apart from the losses (`lit_losses.objectives`) because ``lit-losses from-trl`` reads them
without importing torch (`lit_losses.cli.trl_schema`).

Example:
    >>> from typing import get_args
    >>> get_args(KTOLossType)
    ('kto', 'apo_zero_unpaired')
"""

from __future__ import annotations

from typing import Literal

DPOLossType = Literal[
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
]
"""TRL's ``DPOConfig.loss_type`` values."""

KTOLossType = Literal["kto", "apo_zero_unpaired"]
"""TRL's ``KTOConfig.loss_type`` values."""

CPOConfigLossType = Literal["sigmoid", "hinge", "ipo", "simpo", "alphapo"]
"""TRL's ``CPOConfig.loss_type`` (``alphapo``: ``simpo`` with ``cpo_alpha = 0``)."""

TRLLossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
"""TRL's ``GRPOConfig.loss_type`` (also Liger-Kernel's ``LigerFusedLinearGRPOLoss``)."""
