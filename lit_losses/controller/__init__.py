"""Training controller: YAML rules on metrics, fired on Lightning events, performing operations.

The Lightning-native controller is every module here but `lit_losses.controller.fms`, the fms-hf-tuning
adapter, which this package imports so that fms-hf-tuning's configs and handlers run unchanged.
"""

from lit_losses.controller.callback import TrainingController
from lit_losses.controller.config import ControllerConfig, parse_config
from lit_losses.controller.control import TrainerControl
from lit_losses.controller.events import ALL_EVENTS, Trigger
from lit_losses.controller.fms import HF_EVENTS, HFControls, Operation, TrainerStateView
from lit_losses.controller.history import HistoryBasedMetric
from lit_losses.controller.log_control import LogControl
from lit_losses.controller.metrics import (
    METRIC_HANDLERS,
    EvalMetrics,
    Loss,
    MetricHandler,
    PerProcessState,
    RegularizerState,
    TrainingState,
    register_metric_handlers,
)
from lit_losses.controller.operations import (
    OPERATION_HANDLERS,
    LightningOperations,
    LRControl,
    OperationHandler,
    RegularizerControl,
    register_operation_handlers,
)
from lit_losses.controller.recovery import RecoveryError, SpikeRecovery
from lit_losses.controller.rules import RULE_FUNCTIONS, RuleError, RuleEvaluator, RuleFailure, check_rule

__all__ = [
    "ALL_EVENTS",
    "HF_EVENTS",
    "METRIC_HANDLERS",
    "OPERATION_HANDLERS",
    "RULE_FUNCTIONS",
    "ControllerConfig",
    "EvalMetrics",
    "HFControls",
    "HistoryBasedMetric",
    "LRControl",
    "LightningOperations",
    "LogControl",
    "Loss",
    "MetricHandler",
    "Operation",
    "OperationHandler",
    "PerProcessState",
    "RecoveryError",
    "RegularizerControl",
    "RegularizerState",
    "RuleError",
    "RuleEvaluator",
    "RuleFailure",
    "SpikeRecovery",
    "TrainerControl",
    "TrainerStateView",
    "TrainingController",
    "TrainingState",
    "Trigger",
    "check_rule",
    "parse_config",
    "register_metric_handlers",
    "register_operation_handlers",
]
