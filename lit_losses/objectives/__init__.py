"""Base losses by name: Tinker's loss types as per-token functions of the current log-probability.

`registry` (`register_base_loss`, `BASE_LOSSES`, `BaseLoss`: a function ``fn(logprobs, inputs,
**params)`` and the batch keys it reads) → `ratios` (token or sequence-level importance ratios, GSPO) →
`builtins` (Tinker's ``cross_entropy``, ``importance_sampling``, ``ppo``, ``cispo``, ``dro``) → `soft`
(``sapo``, ``vespo``) → `correction` (`RolloutCorrectionOptions`: TRL's and verl's rollout–training
mismatch corrections, among an RL base loss's arguments) → `mismatch` (their weights and masks) →
`correction_batch` (a correction bound to one micro-batch) and `rejection` (verl's rejection sampling,
applied to the labels before a step is counted) → `bound` (`BoundBaseLoss`: a base loss with checked
parameters, the ``model.base_loss`` / ``model.base_loss_args`` options; `BaseLossBatch`: bound to one
micro-batch, with its RL telemetry); `inputs` names and checks the batch keys of RL micro-batches;
`presets` (`GRPOPreset`, ``model.grpo``) maps TRL's GRPO ``loss_type`` and arguments to these options.
`lit_losses.loss.objective` runs a base loss on the head's fused pointwise path (gradients in forward) or
on the general path.
"""

from typing import get_args

from lit_losses.objectives import builtins, soft
from lit_losses.objectives.bound import TELEMETRY, BaseLossBatch, BoundBaseLoss
from lit_losses.objectives.builtins import BaseLossName
from lit_losses.objectives.correction import (
    RolloutCorrection,
    RolloutCorrectionOptions,
    RolloutCorrectionPreset,
    RolloutISLevel,
    RolloutRSOption,
    VLLMImportanceSamplingMode,
)
from lit_losses.objectives.inputs import (
    ADVANTAGES,
    LOSS_WEIGHTS,
    OLD_LOGPROBS,
    REF_LOGPROBS,
    RL_KEYS,
    SAMPLE_WEIGHTS,
    SAMPLING_LOGPROBS,
    token_values,
)
from lit_losses.objectives.presets import GRPOPreset, TRLLossType
from lit_losses.objectives.ratios import ImportanceSamplingLevel
from lit_losses.objectives.registry import BASE_LOSSES, BaseLoss, BaseLossArgError, register_base_loss

if set(get_args(BaseLossName)) - set(BASE_LOSSES.names()):  # pragma: no cover - a maintenance error
    raise RuntimeError(f"BaseLossName lists {get_args(BaseLossName)}; registered: {BASE_LOSSES.names()}")

__all__ = [
    "ADVANTAGES",
    "BASE_LOSSES",
    "LOSS_WEIGHTS",
    "OLD_LOGPROBS",
    "REF_LOGPROBS",
    "RL_KEYS",
    "SAMPLE_WEIGHTS",
    "SAMPLING_LOGPROBS",
    "TELEMETRY",
    "BaseLoss",
    "BaseLossArgError",
    "BaseLossBatch",
    "BaseLossName",
    "BoundBaseLoss",
    "GRPOPreset",
    "ImportanceSamplingLevel",
    "RolloutCorrection",
    "RolloutCorrectionOptions",
    "RolloutCorrectionPreset",
    "RolloutISLevel",
    "RolloutRSOption",
    "TRLLossType",
    "VLLMImportanceSamplingMode",
    "builtins",
    "register_base_loss",
    "soft",
    "token_values",
]
