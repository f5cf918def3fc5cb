"""`parse_config`: the YAML schema, handler classes by name or import path, every problem at once."""

from __future__ import annotations

from typing import get_args

import pytest

from lit_losses.controller import MetricHandler, TrainingController, parse_config
from lit_losses.controller.entries import PATIENCE_MODES, PatienceMode
from lit_losses.controller.metrics import TrainingState
from lit_losses.errors import ConfigError

STOP = {
    "name": "stop",
    "triggers": ["on_train_batch_end"],
    "rule": "True",
    "operations": ["lightning.should_training_stop"],
}


def with_metric(cls, **extra) -> dict:
    return {"controller-metrics": [{"name": "m", "class": cls}], "controllers": [STOP], **extra}


class Unregistered(MetricHandler):
    """A handler that is only reachable by its import path."""

    def compute(self, event, trainer, pl_module):
        return {"value": 1}


def test_every_problem_is_reported_at_once_with_its_yaml_path():
    config = {
        "controller_metrics": [
            {"name": "train_loss", "class": "Loss"},
            {"name": "hist", "class": "HistoryBasedMetric", "arguments": {"window": 0}},
            {"name": "x", "class": "NoSuchMetric"},
        ],
        "operations": [{"name": "regs", "class": "RegularizerControl", "arguments": {}}],
        "controllers": [
            {
                "name": "a",
                "triggers": ["on_train_batch_end"],
                "rule": "train_loss['loss'] >",
                "operations": ["lightning.should_training_stop"],
            },
            {
                "name": "b",
                "triggers": ["on_batch_end"],
                "rule": "nope > 1",
                "operations": ["lightning.should_fly"],
            },
            {
                "name": "c",
                "triggers": ["on_train_batch_end"],
                "rule": "True",
                "operations": ["ghost.should_log"],
                "patience": {"patience_threshold": -1, "mode": "sometimes"},
            },
        ],
        "extra": 1,
    }
    with pytest.raises(ConfigError) as info:
        TrainingController(config)
    message = str(info.value)
    for expected in (
        "extra: unknown key",
        "controller_metrics[1].arguments: ",
        "controller_metrics[2].class: unknown metric class 'NoSuchMetric'",
        "operations[0].arguments: RegularizerControl needs arguments.regularizer",
        "controllers[0] (a).rule: syntax error",
        "controllers[1] (b).triggers: unknown trigger 'on_batch_end'",
        "controllers[1] (b).rule: name 'nope' is not defined",
        "controllers[2] (c).patience.mode: 'sometimes'",
        "controllers[1] (b).operations: unknown action 'should_fly'",
        "controllers[2] (c).operations: unknown operation 'ghost'",
        "controllers[2] (c).patience.patience_threshold: must be an integer >= 0",
        "controllers[2] (c).patience.mode: 'sometimes'",
    ):
        assert expected in message, (expected, message)
    assert "problem(s)" in message


def test_a_misspelled_class_gets_a_suggestion_among_the_other_problems():
    config = with_metric("TrainingStat", operations=[{"name": "say", "class": "LogControll"}])
    with pytest.raises(ConfigError) as info:
        parse_config(config)
    message = str(info.value)
    assert "2 problem(s)" in message
    assert (
        "controller-metrics[0].class: unknown metric class 'TrainingStat'; did you mean 'TrainingState'?"
        in message
    )
    assert "operations[0].class: unknown operation class 'LogControll'; did you mean 'LogControl'?" in message


def test_a_class_by_import_path():
    config = parse_config(with_metric("lit_losses.controller.metrics.TrainingState"))
    assert type(config.metrics["m"]) is TrainingState
    config = parse_config(with_metric(f"{__name__}.Unregistered"))
    assert type(config.metrics["m"]) is Unregistered


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        ("collections.OrderedDict", "must be a MetricHandler subclass"),
        ("lit_losses.controller.metrics.NoSuchHandler", "cannot import metric class"),
        ("no_such_package.Handler", "cannot import metric class"),
        (None, "must be a registered metric class name or an import path"),
        (["Loss"], "must be a registered metric class name or an import path"),
    ],
)
def test_a_bad_class_is_a_problem_of_its_entry(cls, expected):
    with pytest.raises(ConfigError, match=r"controller-metrics\[0\]\.class: ") as info:
        parse_config(with_metric(cls))
    assert expected in str(info.value)


def test_lightning_is_reserved_for_the_lightning_operations():
    ops = [{"name": "lightning", "class": "lit_losses.controller.operations.LightningOperations"}]
    assert parse_config(with_metric("Loss", operations=ops)).operations["lightning"].name == "lightning"
    with pytest.raises(ConfigError, match=r"operations\[0\]\.name: 'lightning' is reserved"):
        parse_config(with_metric("Loss", operations=[{"name": "lightning", "class": "LogControl"}]))


def test_patience_modes_are_fms_hf_tunings():
    assert PATIENCE_MODES == get_args(PatienceMode) == ("reset_on_failure", "no_reset_on_failure")
    for mode, parsed in [("no_reset_on_failure", "no_reset_on_failure"), ("no_reset", "no_reset_on_failure")]:
        config = parse_config(with_metric("Loss", controllers=[{**STOP, "patience": {"mode": mode}}]))
        assert config.controllers[0].patience.mode == parsed
