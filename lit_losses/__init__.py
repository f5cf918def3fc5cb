"""lit_losses: PyTorch Lightning integration for language models trained with custom losses.

The public API, by concept (everything else is importable from its subpackage):

- models: `RegularizedLM` (subclass it), `TinyLM` (built-in), `HFCausalLM` (Hugging Face models),
  `OptimizerConfig`, `Schedule`
- the loss of a step: `LossContext`, `LossOutput`, `Objective`
- fused output head: `FusedLMHead`, `HeadOutput`
- global-denominator aggregation: `GlobalStatsLoader`, `GlobalStats`, `AggMode`, `aggregate`
- regularizers: `RegularizerSpec`, `RegularizerSet`, `RegularizerError`, `register_regularizer`
- base losses by name (cross-entropy, Tinker's RL losses, SAPO, VESPO): `register_base_loss`;
  TRL's GRPO losses as one option: `GRPOPreset`
- data: `TextDataModule`, `RLDataModule` (offline RL records)
- training controller: `TrainingController`, `register_metric_handlers`, `register_operation_handlers`
- extension points: `Registry`, `ConfigError`; custom gradients: the `autograd` subpackage
"""

from lit_losses import autograd  # the custom-gradient toolkit
from lit_losses.aggregation import AggMode, GlobalStats, GlobalStatsLoader, aggregate
from lit_losses.controller import TrainingController, register_metric_handlers, register_operation_handlers
from lit_losses.data import RLDataModule, TextDataModule
from lit_losses.errors import ConfigError
from lit_losses.heads import FusedLMHead, HeadOutput
from lit_losses.loss import LossContext, LossOutput
from lit_losses.loss.objective import Objective
from lit_losses.models import HFCausalLM, TinyLM
from lit_losses.module import RegularizedLM
from lit_losses.objectives import GRPOPreset, register_base_loss
from lit_losses.optim import OptimizerConfig
from lit_losses.registry import Registry
from lit_losses.regularizers import RegularizerError, RegularizerSet, RegularizerSpec, register_regularizer
from lit_losses.schedule import Schedule

__version__ = "0.1.0"

__all__ = [
    "AggMode",
    "ConfigError",
    "FusedLMHead",
    "GRPOPreset",
    "GlobalStats",
    "GlobalStatsLoader",
    "HFCausalLM",
    "HeadOutput",
    "LossContext",
    "LossOutput",
    "Objective",
    "OptimizerConfig",
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
    "register_base_loss",
    "register_metric_handlers",
    "register_operation_handlers",
    "register_regularizer",
]
