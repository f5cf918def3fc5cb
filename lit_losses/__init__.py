"""lit_losses: PyTorch Lightning integration for language models trained with custom losses.

The public API, by concept (everything else is importable from its subpackage):

- models: `RegularizedLM` (subclass it), `TinyLM` (built-in), `HFCausalLM` (Hugging Face models),
  `FrozenModel` (a frozen reference or teacher beside the policy), `OptimizerConfig`, `Schedule`
- the loss of a step: `LossContext`, `LossOutput`, `Objective`
- fused output head: `FusedLMHead`, `HeadOutput`; functional: `linear_logprobs`, `linear_cross_entropy`;
  distillation without logits: `linear_distillation`, `topk_distillation`
- global-denominator aggregation: `GlobalStatsLoader`, `GlobalStats`, `AggMode`, `aggregate`
- regularizers: `RegularizerSpec`, `RegularizerSet`, `RegularizerError`, `register_regularizer`
- base losses by name (cross-entropy, Tinker's RL losses, SAPO, VESPO): `register_base_loss`;
  TRL's GRPO losses as one option: `GRPOPreset`
- preference losses (TRL's DPO family, KTO, CPO/SimPO, ORPO): `dpo_loss`, `kto_loss`, `cpo_loss`,
  `simpo_loss`, `orpo_loss`, and their options `DPOPreset`, `KTOPreset`, `CPOPreset`, `ORPOPreset`
- data: `TextDataModule` (text, prompt-completion SFT), `PreferenceDataModule` (TRL's preference
  formats), `RLDataModule` (offline RL records)
- training controller: `TrainingController`, `register_metric_handlers`, `register_operation_handlers`
- preemption: `PreemptionCheckpoint` (``SIGTERM``: finish the step, checkpoint, exit ``128 + signal``)
- extension points: `Registry`, `ConfigError`; custom gradients: the `autograd` subpackage

Names are imported on first use (PEP 562 ``__getattr__``): ``import lit_losses.heads`` or
``lit_losses.autograd`` loads torch alone, not Lightning or transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lit_losses import autograd
    from lit_losses.aggregation import AggMode, GlobalStats, GlobalStatsLoader, aggregate
    from lit_losses.checkpoint.preemption import PreemptionCheckpoint
    from lit_losses.controller import (
        TrainingController,
        register_metric_handlers,
        register_operation_handlers,
    )
    from lit_losses.data import PreferenceDataModule, RLDataModule, TextDataModule
    from lit_losses.errors import ConfigError
    from lit_losses.heads import (
        FusedLMHead,
        HeadOutput,
        linear_cross_entropy,
        linear_distillation,
        linear_logprobs,
        topk_distillation,
    )
    from lit_losses.loss import LossContext, LossOutput
    from lit_losses.loss.objective import Objective
    from lit_losses.models.frozen import FrozenModel
    from lit_losses.models.hf import HFCausalLM
    from lit_losses.models.tiny_lm import TinyLM
    from lit_losses.module import RegularizedLM
    from lit_losses.objectives import (
        CPOPreset,
        DPOPreset,
        GRPOPreset,
        KTOPreset,
        ORPOPreset,
        cpo_loss,
        dpo_loss,
        kto_loss,
        orpo_loss,
        register_base_loss,
        simpo_loss,
    )
    from lit_losses.optim import OptimizerConfig
    from lit_losses.registry import Registry
    from lit_losses.regularizers import (
        RegularizerError,
        RegularizerSet,
        RegularizerSpec,
        register_regularizer,
    )
    from lit_losses.schedule import Schedule

from lit_losses import moved
from lit_losses.lazy import lazy_exports

moved.install()  # old module paths (lit_losses.preemption, lit_losses.report, ...) stay importable

__version__ = "0.1.0"

__all__ = [
    "AggMode",
    "CPOPreset",
    "ConfigError",
    "DPOPreset",
    "FrozenModel",
    "FusedLMHead",
    "GRPOPreset",
    "GlobalStats",
    "GlobalStatsLoader",
    "HFCausalLM",
    "HeadOutput",
    "KTOPreset",
    "LossContext",
    "LossOutput",
    "ORPOPreset",
    "Objective",
    "OptimizerConfig",
    "PreemptionCheckpoint",
    "PreferenceDataModule",
    "RLDataModule",
    "Registry",
    "RegularizedLM",
    "RegularizerError",
    "RegularizerSet",
    "RegularizerSpec",
    "Schedule",
    "TextDataModule",
    "TinyLM",
    "TrainingController",
    "aggregate",
    "autograd",
    "cpo_loss",
    "dpo_loss",
    "kto_loss",
    "linear_cross_entropy",
    "linear_distillation",
    "linear_logprobs",
    "orpo_loss",
    "register_base_loss",
    "register_metric_handlers",
    "register_operation_handlers",
    "register_regularizer",
    "simpo_loss",
    "topk_distillation",
]

#: The module each public name is imported from, on first access.
_EXPORTS = {
    "AggMode": "lit_losses.aggregation",
    "GlobalStats": "lit_losses.aggregation",
    "GlobalStatsLoader": "lit_losses.aggregation",
    "aggregate": "lit_losses.aggregation",
    "TrainingController": "lit_losses.controller",
    "register_metric_handlers": "lit_losses.controller",
    "register_operation_handlers": "lit_losses.controller",
    "PreferenceDataModule": "lit_losses.data",
    "RLDataModule": "lit_losses.data",
    "TextDataModule": "lit_losses.data",
    "ConfigError": "lit_losses.errors",
    "FusedLMHead": "lit_losses.heads",
    "HeadOutput": "lit_losses.heads",
    "linear_cross_entropy": "lit_losses.heads",
    "linear_distillation": "lit_losses.heads",
    "topk_distillation": "lit_losses.heads",
    "linear_logprobs": "lit_losses.heads",
    "LossContext": "lit_losses.loss",
    "LossOutput": "lit_losses.loss",
    "Objective": "lit_losses.loss.objective",
    "FrozenModel": "lit_losses.models.frozen",
    "HFCausalLM": "lit_losses.models.hf",
    "TinyLM": "lit_losses.models.tiny_lm",
    "RegularizedLM": "lit_losses.module",
    "GRPOPreset": "lit_losses.objectives",
    "DPOPreset": "lit_losses.objectives",
    "KTOPreset": "lit_losses.objectives",
    "CPOPreset": "lit_losses.objectives",
    "ORPOPreset": "lit_losses.objectives",
    "dpo_loss": "lit_losses.objectives",
    "kto_loss": "lit_losses.objectives",
    "cpo_loss": "lit_losses.objectives",
    "simpo_loss": "lit_losses.objectives",
    "orpo_loss": "lit_losses.objectives",
    "register_base_loss": "lit_losses.objectives",
    "PreemptionCheckpoint": "lit_losses.checkpoint.preemption",
    "OptimizerConfig": "lit_losses.optim",
    "Registry": "lit_losses.registry",
    "RegularizerError": "lit_losses.regularizers",
    "RegularizerSet": "lit_losses.regularizers",
    "RegularizerSpec": "lit_losses.regularizers",
    "register_regularizer": "lit_losses.regularizers",
    "Schedule": "lit_losses.schedule",
}


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS, subpackages=True)
