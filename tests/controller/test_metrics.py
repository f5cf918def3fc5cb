"""Metric handlers: triggers, the built-ins, and registering handler classes."""

from __future__ import annotations

from typing import get_args

import lightning as L
import pytest

from lit_losses.controller import ALL_EVENTS, METRIC_HANDLERS, MetricHandler, register_metric_handlers
from lit_losses.controller.events import STEP_EVENTS, Trigger
from tests.controller.helpers import controller


def test_triggers_are_lightning_callback_hooks_or_step_events():
    assert get_args(Trigger) == ALL_EVENTS
    hooks = [event for event in ALL_EVENTS if event not in STEP_EVENTS]
    assert all(callable(getattr(L.Callback, event, None)) for event in hooks)
    assert len(hooks) == len(ALL_EVENTS) - 2


def test_the_built_in_handlers_are_registered():
    built_in = ["Loss", "EvalMetrics", "HistoryBasedMetric", "TrainingState", "PerProcessState"]
    assert set(built_in + ["RegularizerState"]) <= set(METRIC_HANDLERS.names())


class Constant(MetricHandler):
    def compute(self, event, trainer, pl_module):
        return {"value": self.arguments.get("value", 1)}


class Twice(Constant):
    def compute(self, event, trainer, pl_module):
        return {"value": 2 * self.arguments.get("value", 1)}


def test_register_a_list_of_metric_handlers(isolated_registries):
    register_metric_handlers([Constant, Twice])
    assert METRIC_HANDLERS["Constant"] is Constant and METRIC_HANDLERS["Twice"] is Twice
    ctrl = controller('k["value"] == 6', metrics=[{"name": "k", "class": "Twice", "arguments": {"value": 3}}])
    assert isinstance(ctrl.config.metrics["k"], Twice)


def test_register_under_another_name(isolated_registries):
    register_metric_handlers(Constant, Const=Constant)
    assert METRIC_HANDLERS["Const"] is METRIC_HANDLERS["Constant"] is Constant


@pytest.mark.parametrize("wrong", [dict, Constant(name="instance"), "Constant"])
def test_registering_a_non_metric_handler_is_a_type_error(wrong, isolated_registries):
    with pytest.raises(TypeError, match="must be a MetricHandler subclass"):
        register_metric_handlers(wrong)
    with pytest.raises(TypeError, match="metric handler 'Wrong' must be a MetricHandler subclass"):
        register_metric_handlers(Wrong=wrong)


def test_registering_another_class_under_a_taken_name_is_refused(isolated_registries):
    with pytest.raises(ValueError, match="a metric class named 'Loss' is already registered"):
        register_metric_handlers(Loss=Constant)
    assert METRIC_HANDLERS["Loss"] is not Constant
