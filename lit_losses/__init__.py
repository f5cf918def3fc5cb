"""lit_losses: PyTorch Lightning integration for language models trained with custom losses."""

from lit_losses import autograd  # the custom-gradient toolkit
from lit_losses.aggregation import (
    AGG_MODES,
    GlobalStats,
    GlobalStatsLoader,
    MaskStats,
    StepSums,
    aggregate,
    reweight_mean,
    token_weights,
)
from lit_losses.controller import TrainingController, register_metric_handlers, register_operation_handlers
from lit_losses.data import TextDataModule
from lit_losses.heads import FusedLMHead, HeadOutput
from lit_losses.models import TinyLM, TinyTransformer
from lit_losses.module import LossContext, LossOutput, RegularizedLM
from lit_losses.optim import OptimizerConfig
from lit_losses.regularizers import (
    RegularizerError,
    RegularizerSet,
    RegularizerSpec,
    Schedule,
    register_regularizer,
)

__version__ = "0.1.0"

__all__ = [
    "AGG_MODES",
    "FusedLMHead",
    "GlobalStats",
    "GlobalStatsLoader",
    "HeadOutput",
    "LossContext",
    "LossOutput",
    "MaskStats",
    "OptimizerConfig",
    "RegularizedLM",
    "RegularizerError",
    "RegularizerSet",
    "RegularizerSpec",
    "Schedule",
    "StepSums",
    "TextDataModule",
    "TinyLM",
    "TinyTransformer",
    "TrainingController",
    "aggregate",
    "autograd",
    "register_metric_handlers",
    "register_operation_handlers",
    "register_regularizer",
    "reweight_mean",
    "token_weights",
]
