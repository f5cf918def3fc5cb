"""fms-hf-tuning's trainer-controller configs (tests/data/fms_trainercontroller/, unchanged) in a tiny
Lightning fit, each with the outcome fms-hf-tuning's own test expects: the step it stops at, the line it
logs, or the error that refuses it.

The module logs a scripted training loss per optimizer step and a scripted validation loss per validation
(4 steps per epoch, a validation at each epoch's end), as fms-hf-tuning's test feeds a scripted
``TrainerState.log_history`` and evaluation metrics: the fractional ``epoch`` after step ``k`` is ``k / 4``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_losses.controller import MetricHandler, Operation, TrainingController
from lit_losses.errors import ConfigError
from tests.helpers import quiet_trainer

DATA = Path(__file__).resolve().parents[1] / "data" / "fms_trainercontroller"
STEPS_PER_EPOCH = 4
# fms-hf-tuning's test data (losses 2.0, 2.1, 1.3, 0.9; evaluations 2.2, 2.1, 2.3, 2.4, 2.5), continued
TRAIN = [2.0, 2.1, 1.3, 0.9, 0.8, 0.85, 0.9, 1.0, 2.5, 2.1] + [2.5] * 14
VAL = [2.2, 2.1, 2.3, 2.4, 2.5, 2.6]
FALLING_VAL = [2.4, 2.3, 2.2, 2.1, 2.0, 1.9]


class ScriptedLM(L.LightningModule):
    """Logs ``train/loss_total = train[k]`` at optimizer step ``k + 1`` and ``val/loss = val[n]`` at the
    ``n + 1``-th validation; trains nothing (one parameter, learning rate 0)."""

    def __init__(self, train=TRAIN, val=VAL):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.train_losses, self.val_losses, self.validations = train, val, 0

    def training_step(self, batch, batch_idx):
        self.log("train/loss_total", self.train_losses[self.global_step], on_step=True, on_epoch=False)
        return (self.weight * batch).sum()

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.val_losses[self.validations], on_step=False, on_epoch=True)

    def on_validation_epoch_end(self):
        self.validations += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(ctrl, *callbacks, max_epochs=6, **module_kwargs):
    data = torch.utils.data.DataLoader([torch.ones(1)] * STEPS_PER_EPOCH, batch_size=None)
    trainer = quiet_trainer(max_epochs=max_epochs, callbacks=[ctrl, *callbacks], limit_val_batches=1)
    trainer.fit(ScriptedLM(**module_kwargs), data, data)
    return trainer


def config(name: str) -> str:
    return str(DATA / name)


# ---- configs that stop training: the step they stop at -------------------------------------------------
STOPS = [
    ("tests/loss_on_threshold.yaml", {}, 4),  # loss 0.9 < 1.0 at step 4
    ("tests/thresholded-training-loss.yaml", {}, 4),
    ("tests/non-decreasing-training-loss.yaml", {}, 2),  # window of 2: 2.0 < 2.1
    ("tests/loss_on_threshold_with_trainer_state.yaml", {}, 3),  # 1.3 < 2 and epoch 0.75 >= 0.5
    ("tests/loss_unavailable_metric.yaml", {}, 4),  # on_step_end: the loss is logged by then in Lightning
    ("tests/epoch-level-training-loss.yaml", {}, 4),  # end of epoch 1 (epoch 1.0): last loss 0.9 < 1
    ("tests/epoch-level-eval-loss.yaml", {}, 4),  # eval_loss 2.2 > 2 after epoch 1
    ("tests/epoch-level-eval-loss-patience.yaml", {}, 12),  # patience 2: acts on the 3rd hold (epoch 3)
    ("tests/exposed_metrics.yaml", {}, 4),  # on_evaluate: eval_loss 2.2 < 2.5 at the first validation
    ("examples/loss.yaml", {}, 4),
    ("examples/thresholded-training-loss.yaml", {}, 9),  # 2.5 > 2.2
    ("examples/non-decreasing-training-loss.yaml", {}, 8),  # window of 5: 0.9 < 1.0
    ("examples/epoch-level-training-loss.yaml", {}, 16),  # loss 2.5 > 2 at an epoch end with epoch > 3
    ("examples/epoch-level-training-loss-below-threshold.yaml", {}, 10),  # epoch 2.5 > 2 and 2.1 < 2.2
    ("examples/epoch-level-training-loss-below-threshold-log-config.yaml", {}, 10),
    ("examples/epoch-level-eval-loss.yaml", {}, 16),  # eval_loss 2.4 > 2.2 with epoch 4 > 3
    ("examples/epoch-level-eval-loss-patience.yaml", {}, 12),
    ("examples/epoch-level-eval-loss-below-threshold.yaml", {"val": FALLING_VAL}, 12),  # 2.2 < 2.25, epoch 3
]


@pytest.mark.parametrize(("name", "module_kwargs", "step"), STOPS, ids=[s[0] for s in STOPS])
def test_fms_config_stops_where_fms_expects(name, module_kwargs, step):
    ctrl = TrainingController(config(name))
    trainer = fit(ctrl, **module_kwargs)
    assert trainer.global_step == step
    assert [f["step"] for f in ctrl.fired] == [step]


@pytest.mark.parametrize(
    ("name", "step"), [("tests/on-save.yaml", 2), ("tests/thresholded-training-loss-on-save.yaml", 4)]
)
def test_fms_on_save_configs_stop_at_the_checkpoint_where_the_rule_holds(name, step, tmp_path):
    ctrl = TrainingController(config(name))
    every_step = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    assert fit(ctrl, every_step).global_step == step  # epoch 0.5 (step 2) / loss 0.9 (step 4)


def test_trigger_log_level_is_the_level_of_the_fired_line(caplog):
    ctrl = TrainingController(config("examples/epoch-level-training-loss-below-threshold-log-config.yaml"))
    with caplog.at_level(logging.DEBUG, logger="lit_losses.controller"):
        fit(ctrl)
    (record,) = [r for r in caplog.records if "fired" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "epoch_level_stop_on_training_loss_below_threshold" in record.getMessage()


# ---- logging configs: the line they log ----------------------------------------------------------------
@pytest.mark.parametrize("name", ["tests/log_controller.yaml", "examples/log_controller.yaml"])
def test_log_controller_logs_its_format_at_each_step(name, caplog):
    with caplog.at_level(logging.WARNING, logger="lit_losses.controller"):
        fit(TrainingController(config(name)), max_epochs=1)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == STEPS_PER_EPOCH
    assert all("This is a test log format [on_step_end] => {" in line for line in lines)
    assert "'global_step': 3," in lines[2] and "'epoch': 0.75," in lines[2]


def test_logging_controller_with_rank_logs_steps_and_saves(caplog, tmp_path):
    ctrl = TrainingController(config("examples/logging_controller_with_rank.yaml"))
    saves = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    with caplog.at_level(logging.INFO, logger="lit_losses.controller"):
        fit(ctrl, saves, max_epochs=1)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[controller ctrl-")]
    loss = "{'loss': 2.0, 'epoch': 0.25, 'step': 1}"
    assert lines[0] == f"[controller ctrl-on-log-format] Epoch: 0, Step: 1, Rank: 0, loss = {loss}"
    saved = "Saving model in huggingface format at step: 2\nModel saved in"
    assert f"[controller ctrl-on-save-format] {saved} {tmp_path}\n" in lines  # the YAML block's last newline
    assert sum("Saving" in line for line in lines) == 2  # steps 2 and 4 (the last one: is_final)
    assert any(
        line.startswith("[controller ctrl-on-save-format-final] Saving final checkpoint in") for line in lines
    )


# ---- custom handlers in fms-hf-tuning's form, registered on the callback after creating it -------------
class CustomMetric(MetricHandler):
    """fms-hf-tuning's form: events given to the base class, validate() -> bool, compute(state, **kwargs)."""

    def __init__(self, **kwargs):
        super().__init__(events=["on_log"], **kwargs)

    def validate(self) -> bool:
        return True

    def compute(self, _=None, **__):
        return True


class CustomOperation(Operation):
    def should_perform_action_xyz(self, control, **_):
        control.should_training_stop = True


class CustomOperationInvalidAction(Operation):
    def should_(self, control, **_):
        control.should_training_stop = True


def test_custom_metric_handler(isolated_registries):
    ctrl = TrainingController(config("tests/loss_custom_metric.yaml"))
    ctrl.register_metric_handlers([CustomMetric])
    assert fit(ctrl).global_step == 1


def test_custom_operation_handler(isolated_registries):
    ctrl = TrainingController(config("tests/loss_custom_operation.yaml"))
    ctrl.register_operation_handlers([CustomOperation])
    assert fit(ctrl).global_step == 4  # training_loss 0.9 < 1.0


def test_custom_operation_with_an_invalid_action_is_refused(isolated_registries):
    ctrl = TrainingController(config("tests/loss_custom_operation_invalid_action.yaml"))
    where = r"controllers\[0\] \(loss_controller_custom_operation_invalid_action\)\.operations"
    with pytest.raises(ConfigError, match=where + ": unknown action 'should_' of 'custom_operation'"):
        ctrl.register_operation_handlers([CustomOperationInvalidAction])


def test_a_handler_whose_validate_returns_false_refuses_the_config(isolated_registries):
    class Refusing(CustomMetric):
        def validate(self) -> bool:
            return False

    ctrl = TrainingController(config("tests/loss_custom_metric.yaml"))
    with pytest.raises(
        ConfigError, match=r"controller_metrics\[0\]: Refusing.validate\(\) refused its arguments"
    ):
        ctrl.register_metric_handlers(CustomMetric=Refusing)


def test_an_unregistered_class_is_refused_before_training(isolated_registries):
    ctrl = TrainingController(config("tests/loss_invalid_metric.yaml"))
    with pytest.raises(ConfigError, match="unknown metric class 'MissingMetricClass'"):
        fit(ctrl)


# ---- configs that fms-hf-tuning refuses: refused here before training, naming the problem ---------------
REFUSED = [
    (
        "tests/incorrect_source_event_exposed_metrics.yaml",
        "source_event 'on_incorrect_event' is invalid for EvalMetrics",
    ),
    (
        "tests/loss_invalid_operation.yaml",
        "unknown operation 'missingop' in 'missingop.should_training_stop'",
    ),
    ("tests/loss_invalid_operation_action.yaml", "unknown action 'missingaction' of 'hfcontrols'"),
    ("tests/loss_invalid_trigger.yaml", "unknown trigger 'log_it_all_incorrect_trigger_name'"),
    ("tests/loss_with_invalid_type_rule.yaml", "'2 + 2' is not a boolean"),
    ("tests/loss_with_malicious_input_rule.yaml", "call of 'input' is not allowed"),
    ("tests/loss_with_malicious_os_rule.yaml", "call of \"__import__('os').system\" is not allowed"),
]


@pytest.mark.parametrize(("name", "expected"), REFUSED, ids=[r[0] for r in REFUSED])
def test_fms_config_refused_as_fms_refuses_it(name, expected):
    with pytest.raises(ConfigError) as info:  # a ValueError, as fms-hf-tuning raises for some of them
        TrainingController(config(name))
    assert expected in str(info.value)


def test_every_fms_config_is_covered():
    covered = (
        {s[0] for s in STOPS}
        | {r[0] for r in REFUSED}
        | {
            "tests/on-save.yaml",
            "tests/thresholded-training-loss-on-save.yaml",
            "tests/log_controller.yaml",
            "examples/log_controller.yaml",
            "examples/logging_controller_with_rank.yaml",
            "tests/loss_custom_metric.yaml",
            "tests/loss_custom_operation.yaml",
            "tests/loss_custom_operation_invalid_action.yaml",
            "tests/loss_invalid_metric.yaml",
        }
    )
    stored = {str(p.relative_to(DATA)) for p in DATA.rglob("*.yaml")}
    assert stored == covered
