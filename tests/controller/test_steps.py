"""The controller at optimizer-step granularity: one event per optimizer step whatever accumulate_grad_batches
is, windows that only append new observations, patience counted at the trigger's granularity, rules that
fail at run time, and Hugging Face's controls (epoch stop, save, evaluate)."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_losses import GlobalStatsLoader, TrainingController
from lit_losses.controller import RuleFailure
from tests.aggregation.ddp_step import micro_batches
from tests.controller.helpers import STATE, controller, tiny
from tests.controller.test_fms_configs import ScriptedLM
from tests.helpers import quiet_trainer


class StepLosses(L.Callback):
    """The logged ``train/loss_total`` after each optimizer step (Lightning's own window end)."""

    def __init__(self):
        self.losses = []

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        pass

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.losses.append(float(trainer.callback_metrics["train/loss_total"]))


def fit_accumulating(*callbacks, max_steps=4):
    trainer = quiet_trainer(max_steps=max_steps, accumulate_grad_batches=2, callbacks=list(callbacks))
    trainer.fit(tiny(), GlobalStatsLoader(micro_batches() * 2, batch_size=None))
    return trainer


HISTORY = {
    "name": "hist",
    "class": "HistoryBasedMetric",
    "arguments": {"key": "train/loss_total", "window": 3},
}


def test_a_window_holds_one_value_per_optimizer_step_with_accumulation():
    # the rule reads the window on every micro-batch: reading does not append
    ctrl = controller("len(hist['window']) > 99", metrics=[HISTORY], trigger="on_train_batch_end")
    record = StepLosses()
    fit_accumulating(ctrl, record, max_steps=5)
    assert len(record.losses) == 5
    assert ctrl.values["hist"]["window"] == record.losses[-3:]
    assert ctrl.values["hist"]["steps"] == [3, 4, 5]


@pytest.mark.parametrize(
    ("trigger", "fires_at_step"), [("on_optimizer_step_end", 3), ("on_train_batch_end", 1)]
)
def test_patience_counts_the_triggers_evaluations(trigger, fires_at_step):
    """patience_threshold 2: tolerate 2 holds, act on the 3rd; once per optimizer step on
    on_optimizer_step_end (after step 3), once per micro-batch on on_train_batch_end (micro-batch 3, in
    step 2's window: 1 step done)."""
    ctrl = controller("True", patience={"patience_threshold": 2}, trigger=trigger)
    trainer = fit_accumulating(ctrl, max_steps=6)
    assert [f["step"] for f in ctrl.fired] == [fires_at_step]
    assert trainer.global_step == fires_at_step


def test_a_window_is_unaffected_by_other_controllers_triggers():
    """A validation-loss window gets one value per validation, while another controller evaluates a rule
    on every micro-batch: "the validation loss rose twice in a row" fires when it did."""
    config = {
        "controller-metrics": [
            {
                "name": "val_history",
                "class": "HistoryBasedMetric",
                "arguments": {"key": "val/loss", "window": 2},
            },
            {"name": "state", "class": "TrainingState"},
        ],
        "controllers": [
            {
                "name": "busy",
                "triggers": ["on_train_batch_end"],
                "rule": "state['global_step'] < 0",
                "operations": ["lightning.should_log"],
            },
            {
                "name": "val-rise",
                "triggers": ["on_validation_end"],
                "rule": "val_history['full'] and val_history['window'][1] > val_history['window'][0]",
                "patience": {"patience_threshold": 1},
                "operations": ["lightning.should_training_stop"],
            },
        ],
    }
    ctrl = TrainingController(config)
    data = torch.utils.data.DataLoader([torch.ones(1)] * 4, batch_size=None)
    trainer = quiet_trainer(max_epochs=6, callbacks=[ctrl], limit_val_batches=1)
    trainer.fit(ScriptedLM(val=[2.0, 1.9, 2.1, 2.0, 2.2, 2.3]), data, data)
    # rises after validations 3 (2.1 > 1.9) and 5 (2.2 > 2.0), not in a row; then 6 (2.3 > 2.2): acts
    assert ctrl.values["val_history"]["window"] == pytest.approx([2.2, 2.3])
    assert [f["step"] for f in ctrl.fired if f["controller"] == "val-rise"] == [24]


def test_a_rule_that_fails_at_run_time_stops_the_run_naming_it():
    ctrl = controller('train_loss["los"] > 10')
    with pytest.raises(RuleFailure) as info:
        fit_accumulating(ctrl)
    message = str(info.value)
    assert message.startswith(
        "controller 'c': rule 'train_loss[\"los\"] > 10' raised KeyError: 'los' at step 1"
    )
    assert "on on_optimizer_step_end (metric values: train_loss={'loss': " in message


def test_a_rule_whose_value_is_not_a_boolean_stops_the_run():
    with pytest.raises(
        RuleFailure, match=r"rule 'train_loss\[\"loss\"\]' evaluated to [0-9.]+ \(float\), not a"
    ):
        fit_accumulating(controller('train_loss["loss"]'))


def test_on_error_warn_warns_every_time(caplog):
    ctrl = controller('train_loss["los"] > 10', on_error="warn")
    with caplog.at_level(logging.WARNING, logger="lit_losses.controller"):
        trainer = fit_accumulating(ctrl)
    warnings = [
        r for r in caplog.records if r.levelno == logging.WARNING and "raised KeyError" in r.getMessage()
    ]
    assert trainer.global_step == 4 and len(warnings) == 4  # one per optimizer step


def test_hfcontrols_epoch_stop_ends_the_epoch_at_the_end_of_the_window():
    class Epochs(L.Callback):
        def __init__(self):
            self.ends = []

        def on_train_epoch_end(self, trainer, pl_module):
            self.ends.append(trainer.global_step)

    # asked for at micro-batch 3 (in the middle of step 2's window): the epoch ends after step 2
    ctrl = controller(
        'state["epoch"] == 0.5', trigger="on_train_batch_end", operations=["hfcontrols.should_epoch_stop"]
    )
    epochs = Epochs()
    trainer = quiet_trainer(max_epochs=2, accumulate_grad_batches=2, callbacks=[ctrl, epochs])
    trainer.fit(tiny(), GlobalStatsLoader(micro_batches(), batch_size=None))  # 6 micro-batches: 3 steps
    assert epochs.ends == [2, 5]  # epoch 0 ended after step 2; epoch 1 ran its 3 steps (a new pass)


def test_hfcontrols_save_evaluate_and_log(tmp_path):
    actions = ["hfcontrols.should_save", "hfcontrols.should_evaluate", "hfcontrols.should_log"]
    ctrl = controller('state["global_step"] == 2', operations=actions)
    validations = []

    class Count(L.Callback):
        def on_validation_end(self, trainer, pl_module):
            validations.append(trainer.global_step)

    data = micro_batches()
    logger = L.pytorch.loggers.CSVLogger(tmp_path)
    trainer = quiet_trainer(
        max_steps=3, callbacks=[ctrl, Count()], limit_val_batches=1, default_root_dir=tmp_path, logger=logger
    )
    trainer.fit(
        tiny(), GlobalStatsLoader(data, batch_size=None), torch.utils.data.DataLoader(data, batch_size=None)
    )
    assert validations == [2]
    assert [p.name for p in (tmp_path / "controller-checkpoints").iterdir()] == ["controller-c-step2.ckpt"]
    rows = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()
    step = rows[0].split(",").index("step")
    assert "2" in [row.split(",")[step] for row in rows[1:]]  # logged at step 2, on demand


def test_a_custom_action_that_stops_training_is_obeyed(isolated_registries):
    from lit_losses.controller import OperationHandler, register_operation_handlers

    class Halt(OperationHandler):  # runs on rank 0 only: the controller shares its decision with every rank
        def should_halt(self, trainer, pl_module, context):
            trainer.should_stop = True

    register_operation_handlers(Halt)
    ctrl = controller(
        'state["global_step"] == 2', operations=["h.should_halt"], ops=[{"name": "h", "class": "Halt"}]
    )
    assert fit_accumulating(ctrl, max_steps=6).global_step == 2


def test_metric_values_carry_their_step():
    ctrl = controller("False", metrics=[*STATE, HISTORY])
    fit_accumulating(ctrl)
    assert ctrl.values["train_loss"]["step"] == ctrl.values["state"]["step"] == 4
