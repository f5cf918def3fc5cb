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
`presets` (`GRPOPreset`, ``model.grpo``) maps TRL's GRPO ``loss_type`` and arguments to these options;
`options` holds the checks that the presets' option dataclasses share (a bounded number, a flag, a preset
from a mapping of its fields, the options a preset replaces).

The preference losses are per-pair (or per-sequence) functions of sequence log-probabilities:
`preference_sequences` (sums, means, LD-DPO, WPO weights, NLL shares) → `preference_dpo` (`dpo_loss`,
every TRL ``DPOTrainer`` loss type) · `preference_cpo` (`cpo_loss`, `simpo_loss`) · `preference_orpo`
(`orpo_loss`) · `preference_kto` (`kto_loss`) → `preference_presets` (``model.dpo``, ``model.kto``,
``model.cpo``, ``model.orpo``: TRL's config fields, and what each loss reads from the module).
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
from lit_losses.objectives.preference_cpo import CPOLoss, CPOLossType, cpo_loss, simpo_loss
from lit_losses.objectives.preference_dpo import DPOLoss, FDivergenceType, dpo_loss
from lit_losses.objectives.preference_kto import KTOLoss, kto_loss
from lit_losses.objectives.preference_orpo import ORPOLoss, orpo_loss
from lit_losses.objectives.preference_presets import (
    PREFERENCE_PRESETS,
    CPOPreset,
    DPOPreset,
    KTOPreset,
    ORPOPreset,
    PreferencePreset,
    PreferenceTrainer,
    select_preset,
)
from lit_losses.objectives.preference_sequences import (
    ld_sequence_logps,
    nll_shares,
    sequence_logps,
    wpo_weights,
)
from lit_losses.objectives.presets import GRPOPreset
from lit_losses.objectives.ratios import ImportanceSamplingLevel
from lit_losses.objectives.registry import BASE_LOSSES, BaseLoss, BaseLossArgError, register_base_loss
from lit_losses.trl_fields import DPOLossType, KTOLossType, TRLLossType

if set(get_args(BaseLossName)) - set(BASE_LOSSES.names()):  # pragma: no cover - a maintenance error
    raise RuntimeError(f"BaseLossName lists {get_args(BaseLossName)}; registered: {BASE_LOSSES.names()}")

__all__ = [
    "ADVANTAGES",
    "BASE_LOSSES",
    "LOSS_WEIGHTS",
    "OLD_LOGPROBS",
    "PREFERENCE_PRESETS",
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
    "CPOLoss",
    "CPOLossType",
    "CPOPreset",
    "DPOLoss",
    "DPOLossType",
    "DPOPreset",
    "FDivergenceType",
    "GRPOPreset",
    "ImportanceSamplingLevel",
    "KTOLoss",
    "KTOLossType",
    "KTOPreset",
    "ORPOLoss",
    "ORPOPreset",
    "PreferencePreset",
    "PreferenceTrainer",
    "RolloutCorrection",
    "RolloutCorrectionOptions",
    "RolloutCorrectionPreset",
    "RolloutISLevel",
    "RolloutRSOption",
    "TRLLossType",
    "VLLMImportanceSamplingMode",
    "builtins",
    "cpo_loss",
    "dpo_loss",
    "kto_loss",
    "ld_sequence_logps",
    "nll_shares",
    "orpo_loss",
    "register_base_loss",
    "select_preset",
    "sequence_logps",
    "simpo_loss",
    "soft",
    "token_values",
    "wpo_weights",
]
