"""Training controller: YAML rules on metrics, fired on Lightning hooks, performing operations."""

from lit_losses.controller.callback import TrainingController
from lit_losses.controller.config import ControllerConfig, parse_config
from lit_losses.controller.metrics import (
    ALL_EVENTS,
    METRIC_HANDLERS,
    EvalMetrics,
    HistoryBasedMetric,
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
    LogControl,
    LRControl,
    OperationHandler,
    RegularizerControl,
    register_operation_handlers,
)
from lit_losses.controller.rules import RULE_FUNCTIONS, RuleError, RuleEvaluator, check_rule

__all__ = [
    "ALL_EVENTS",
    "METRIC_HANDLERS",
    "OPERATION_HANDLERS",
    "RULE_FUNCTIONS",
    "ControllerConfig",
    "EvalMetrics",
    "HistoryBasedMetric",
    "LRControl",
    "LightningOperations",
    "LogControl",
    "Loss",
    "MetricHandler",
    "OperationHandler",
    "PerProcessState",
    "RegularizerControl",
    "RegularizerState",
    "RuleError",
    "RuleEvaluator",
    "TrainingController",
    "TrainingState",
    "check_rule",
    "parse_config",
    "register_metric_handlers",
    "register_operation_handlers",
]
