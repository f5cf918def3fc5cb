"""End-to-end: a real Lightning Trainer on the tiny LM, driven by controller rules."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import pytest

from lit_losses import GlobalStatsLoader, RegularizerSpec, TinyLM, TrainingController
from lit_losses.errors import ConfigError
from tests.aggregation.ddp_step import micro_batches
from tests.helpers import quiet_trainer

REPO = Path(__file__).resolve().parents[2]
STATE = [{"name": "state", "class": "TrainingState"}, {"name": "train_loss", "class": "Loss"}]


def tiny(**kwargs) -> TinyLM:
    L.seed_everything(0, verbose=False)
    return TinyLM(vocab_size=64, d_model=16, n_layers=1, n_heads=2, **kwargs)


def controller(
    rule: str, operations=("lightning.should_training_stop",), patience=None, ops=(), metrics=STATE
):
    entry = {"name": "c", "triggers": ["on_train_batch_end"], "rule": rule, "operations": list(operations)}
    if patience:
        entry["patience"] = patience
    return TrainingController(
        {"controller-metrics": list(metrics), "operations": list(ops), "controllers": [entry]}
    )


class Record(L.Callback):
    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(
            {"step": trainer.global_step, **{k: float(v) for k, v in trainer.callback_metrics.items()}}
        )


def fit(model, callbacks, max_steps=12, **kwargs):
    trainer = quiet_trainer(max_steps=max_steps, callbacks=list(callbacks), **kwargs)
    trainer.fit(model, GlobalStatsLoader(micro_batches(), batch_size=None))
    return trainer


def test_stop_on_a_threshold():
    ctrl = controller('train_loss["loss"] < 100 and state["global_step"] >= 3')
    trainer = fit(tiny(), [ctrl])
    assert trainer.global_step == 3
    assert [f["step"] for f in ctrl.fired] == [3]


def test_stop_after_patience():
    # holds on steps 1, 2, then fails on 3 (reset), then holds from 4: fires on the 3rd consecutive, step 6
    ctrl = controller(
        'state["global_step"] != 3', patience={"patience_threshold": 3, "mode": "reset_on_failure"}
    )
    assert fit(tiny(), [ctrl]).global_step == 6
    cumulative = controller(
        'state["global_step"] != 3', patience={"patience_threshold": 3, "mode": "no_reset"}
    )
    assert fit(tiny(), [cumulative]).global_step == 4


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


def test_a_metric_not_yet_available_skips_its_rule(caplog):
    ctrl = controller('val["loss"] > 0', metrics=[{"name": "val", "class": "EvalMetrics"}])
    with caplog.at_level(logging.INFO, logger="lit_losses.controller"):
        trainer = fit(tiny(), [ctrl], max_steps=3)
    assert trainer.global_step == 3 and not ctrl.fired
    assert sum("not available yet" in r.getMessage() for r in caplog.records) == 1


def test_module_dependent_problems_are_found_before_training():
    ctrl = controller(
        "True",
        operations=["halve.should_scale_weight"],
        ops=[
            {
                "name": "halve",
                "class": "RegularizerControl",
                "arguments": {"regularizer": "entrpy", "factor": 0.5},
            }
        ],
    )
    with pytest.raises(ConfigError, match="unknown regularizer 'entrpy'"):
        fit(tiny(regularizers=[RegularizerSpec(name="entropy", weight=0.01)]), [ctrl], max_steps=2)


def test_resume_mid_patience_fires_at_the_same_step(tmp_path):
    def patient():
        return controller('state["global_step"] >= 1', patience={"patience_threshold": 5})

    uninterrupted = fit(tiny(), [patient()])
    assert uninterrupted.global_step == 5

    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1)
    first = patient()
    fit(tiny(), [first, ckpt], max_steps=3)
    assert first.counters == {"c": 3}
    resumed_ctrl = patient()
    trainer = quiet_trainer(max_steps=12, callbacks=[resumed_ctrl])
    trainer.fit(
        tiny(), GlobalStatsLoader(micro_batches(), batch_size=None), ckpt_path=str(tmp_path / "last.ckpt")
    )
    assert trainer.global_step == 5
    assert [f["step"] for f in resumed_ctrl.fired] == [5]


@pytest.mark.parametrize(
    "path", sorted((REPO / "configs" / "controller").glob("*.yaml")), ids=lambda p: p.name
)
def test_shipped_controller_configs_run(path, tmp_path):
    """Each example config validates and drives a short run of the tiny LM with validation."""
    ctrl = TrainingController(str(path))
    model = tiny(
        regularizers=[
            RegularizerSpec(name="entropy", weight=0.01),
            RegularizerSpec(name="z_loss", weight=1e-4),
        ]
    )
    trainer = quiet_trainer(
        max_steps=6,
        callbacks=[ctrl],
        limit_val_batches=2,
        val_check_interval=2,
        default_root_dir=str(tmp_path),
    )
    data = micro_batches()
    trainer.fit(model, GlobalStatsLoader(data, batch_size=None), torch_loader(data))
    assert trainer.global_step <= 6
    assert ctrl.values, "no metric was computed"


def torch_loader(data):
    import torch

    return torch.utils.data.DataLoader(data, batch_size=None)


def test_cli_run_with_the_controlled_config(tmp_path):
    from tests.test_cli import run_cli

    cli, _ = run_cli(["--config", str(REPO / "configs" / "controlled.yaml")], tmp_path)
    (ctrl,) = [c for c in cli.trainer.callbacks if isinstance(c, TrainingController)]
    assert [c.name for c in ctrl.config.controllers] == ["loss-runaway"]
    assert "train_loss" in ctrl.values and cli.trainer.global_step == 6


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
