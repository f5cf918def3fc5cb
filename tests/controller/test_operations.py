"""Operation handlers: the built-in actions in a real run, and registering handler classes."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import get_args

import lightning as L
import pytest

from lit_losses import GlobalStatsLoader, RegularizerSpec, TrainingController
from lit_losses.controller import OPERATION_HANDLERS, OperationHandler, register_operation_handlers
from lit_losses.controller.operations import LOG_LEVELS, LogLevel
from lit_losses.errors import ConfigError
from tests.aggregation.ddp_step import micro_batches
from tests.controller.helpers import STATE, Record, controller, fit, tiny, torch_loader
from tests.helpers import quiet_trainer


def test_checkpoint_on_demand(tmp_path):
    ctrl = controller(
        'state["global_step"] == 2',
        operations=["lightning.should_save_checkpoint"],
        ops=[{"name": "lightning", "class": "LightningOperations", "arguments": {"dirpath": str(tmp_path)}}],
    )
    fit(tiny(), [ctrl], max_steps=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["controller-c-step2.ckpt"]
    assert ctrl.fired[0]["step"] == 2


def test_halve_a_regularizer_weight_when_a_rule_holds():
    ctrl = controller(
        'state["global_step"] == 2',
        operations=["halve.should_scale_weight"],
        ops=[
            {
                "name": "halve",
                "class": "RegularizerControl",
                "arguments": {"regularizer": "z_loss", "factor": 0.5},
            }
        ],
    )
    record = Record()
    fit(tiny(regularizers=[RegularizerSpec(name="z_loss", weight=0.01)]), [ctrl, record], max_steps=4)
    weights = [round(s["regularizers/z_loss/weight"], 6) for s in record.steps]
    assert weights == [0.01, 0.01, 0.005, 0.005]  # steps 1..4: the rule held after step 2


def test_log_on_demand(caplog):
    ctrl = controller(
        'state["global_step"] == 2',
        operations=["say.should_log"],
        ops=[
            {
                "name": "say",
                "class": "LogControl",
                "arguments": {
                    "level": "WARNING",
                    "message": "loss {train_loss['loss']:.2f} at {state['global_step']}",
                },
            }
        ],
    )
    with caplog.at_level(logging.WARNING, logger="lit_losses.controller"):
        fit(tiny(), [ctrl], max_steps=3)
    (message,) = [r.getMessage() for r in caplog.records if "[controller c]" in r.getMessage()]
    assert message.startswith("[controller c] loss ") and message.endswith(" at 2")


def test_log_levels_are_the_logging_levels():
    assert get_args(LogLevel) == LOG_LEVELS
    assert all(isinstance(getattr(logging, level), int) for level in LOG_LEVELS)


class CountValidation(L.Callback):
    def __init__(self):
        self.runs = []

    def on_validation_end(self, trainer, pl_module):
        self.runs.append(trainer.global_step)


def test_validate_log_and_scale_lr_on_demand(tmp_path):
    ops = [{"name": "lr", "class": "LRControl", "arguments": {"factor": 0.1}}]
    ctrl = TrainingController(
        {
            "controller-metrics": STATE,
            "operations": ops,
            "controllers": [
                {
                    "name": "v",
                    "triggers": ["on_train_batch_end"],
                    "rule": 'state["global_step"] == 2',
                    "operations": ["lightning.should_validate", "lightning.should_log", "lr.should_scale_lr"],
                },
            ],
        }
    )
    counter, lrs = CountValidation(), []

    class LRs(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    logger = L.pytorch.loggers.CSVLogger(str(tmp_path))
    data = micro_batches()
    trainer = quiet_trainer(max_steps=4, callbacks=[ctrl, counter, LRs()], limit_val_batches=2, logger=logger)
    trainer.fit(tiny(), GlobalStatsLoader(data, batch_size=None), torch_loader(data))
    assert 2 in counter.runs  # validation ran at step 2, on demand (no val_check_interval that early)
    # scaled by 0.1 after step 2 (batch index 1); the warmup schedule continues from the scaled level
    assert lrs[2] < 0.2 * lrs[1] and lrs[3] > lrs[2]
    metrics = (Path(logger.log_dir) / "metrics.csv").read_text()
    assert "val/loss" in metrics.splitlines()[0]


def test_should_validate_without_validation_data_is_refused_before_training():
    ctrl = controller('state["global_step"] == 1', operations=["lightning.should_validate"])
    with pytest.raises(ConfigError, match=r"its operation lightning\.should_validate would validate"):
        fit(tiny(), [ctrl], max_steps=2)
    assert ctrl.counters == {"c": 0}  # before the first step


def test_should_validate_without_validation_data_says_so_with_on_error_warn():
    ctrl = controller('state["global_step"] == 1', operations=["lightning.should_validate"], on_error="warn")
    with (
        pytest.warns(UserWarning, match="controller 'c' can never act"),
        pytest.raises(RuntimeError, match="controller 'c': should_validate without validation data"),
    ):
        fit(tiny(), [ctrl], max_steps=2)


class Shout(OperationHandler):
    def should_shout(self, trainer, pl_module, context):
        context["message"] = "!"


class Whisper(OperationHandler):
    def should_whisper(self, trainer, pl_module, context):
        context["message"] = "..."


def test_register_a_list_of_operation_handlers(isolated_registries):
    register_operation_handlers([Shout, Whisper], Hush=Whisper)
    assert {"Shout", "Whisper", "Hush"} <= set(OPERATION_HANDLERS.names())
    assert OPERATION_HANDLERS["Hush"] is Whisper
    ctrl = controller("True", operations=["s.should_shout"], ops=[{"name": "s", "class": "Shout"}])
    assert ctrl.config.operations["s"].actions() == ("should_shout",)


def test_registering_a_non_operation_handler_is_a_type_error(isolated_registries):
    with pytest.raises(TypeError, match="operation handler 'Record' must be an OperationHandler subclass"):
        register_operation_handlers(Record)
    assert "Record" not in OPERATION_HANDLERS
