"""`TrainingController` end to end: a real Lightning Trainer on the tiny LM, driven by controller rules."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import yaml

from lit_losses import GlobalStatsLoader, RegularizerSpec, TrainingController
from lit_losses.controller.decisions import patience_reached
from lit_losses.errors import ConfigError
from tests.aggregation.ddp_step import micro_batches
from tests.controller.helpers import REPO, controller, fit, tiny, torch_loader
from tests.helpers import quiet_trainer


def test_stop_on_a_threshold():
    ctrl = controller('train_loss["loss"] < 100 and state["global_step"] >= 3')
    trainer = fit(tiny(), [ctrl])
    assert trainer.global_step == 3
    assert [f["step"] for f in ctrl.fired] == [3]


def test_stop_after_patience():
    """fms-hf-tuning's semantics: the controller acts when the holds exceed the threshold."""
    # holds on steps 1, 2, fails on 3 (reset), holds from 4: the 4th consecutive hold (step 7) exceeds 3
    ctrl = controller(
        'state["global_step"] != 3', patience={"patience_threshold": 3, "mode": "reset_on_failure"}
    )
    assert fit(tiny(), [ctrl]).global_step == 7
    cumulative = controller(
        'state["global_step"] != 3', patience={"patience_threshold": 3, "mode": "no_reset"}
    )
    assert fit(tiny(), [cumulative]).global_step == 5
    assert fit(tiny(), [controller('state["global_step"] >= 2')]).global_step == 2  # no patience: at once


@pytest.mark.parametrize(
    ("mode", "fires_on"),
    [("reset_on_failure", [7]), ("no_reset_on_failure", [5, 9]), ("no_reset", [5, 9])],
)
def test_patience_modes_count_consecutive_or_cumulative_holds(mode, fires_on):
    ctrl = controller("True", patience={"patience_threshold": 3, "mode": mode})
    (c,) = ctrl.config.controllers
    # the rule fails on evaluation 3 only; the count restarts after each firing
    fired = [i for i in range(1, 11) if patience_reached(ctrl.counters, c, holds=i != 3)]
    assert fired == fires_on


def test_patience_defaults_are_fms_hf_tunings():
    assert controller("True").config.controllers[0].patience.patience_threshold == 0
    with_patience = controller("True", patience={"mode": "reset_on_failure"})
    assert with_patience.config.controllers[0].patience.patience_threshold == 1


def test_a_metric_not_yet_available_skips_its_rule(caplog):
    ctrl = controller('val["loss"] > 0', metrics=[{"name": "val", "class": "EvalMetrics"}], on_error="warn")
    with (
        caplog.at_level(logging.INFO, logger="lit_losses.controller"),
        pytest.warns(UserWarning, match="controller 'c' can never act: its rule reads metric"),
    ):
        trainer = fit(tiny(), [ctrl], max_steps=3)  # no validation data: 'val' never gets a value
    assert trainer.global_step == 3 and not ctrl.fired
    assert sum("not available yet" in r.getMessage() for r in caplog.records) == 1


def test_a_controller_that_can_never_act_is_refused_before_training():
    ctrl = controller('val["loss"] > 0', metrics=[{"name": "val", "class": "EvalMetrics"}])
    with pytest.raises(ConfigError, match=r"controller 'c' can never act: .* this run has no validation"):
        fit(tiny(), [ctrl], max_steps=3)


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
    assert uninterrupted.global_step == 6

    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1)
    first = patient()
    fit(tiny(), [first, ckpt], max_steps=3)
    assert first.counters == {"c": 3}
    resumed_ctrl = patient()
    trainer = quiet_trainer(max_steps=12, callbacks=[resumed_ctrl])
    trainer.fit(
        tiny(), GlobalStatsLoader(micro_batches(), batch_size=None), ckpt_path=str(tmp_path / "last.ckpt")
    )
    assert trainer.global_step == 6
    assert [f["step"] for f in resumed_ctrl.fired] == [6]


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


def test_cli_run_with_the_controlled_config_from_another_working_directory(tmp_path, monkeypatch):
    """configs/controlled.yaml names its controller file relative to its own folder: the run finds it from
    any working directory, and the saved config.yaml names it absolute (it runs from anywhere too)."""
    from tests.test_cli import run_cli

    monkeypatch.chdir(tmp_path)
    cli, root = run_cli(["--config", str(REPO / "configs" / "controlled.yaml")], tmp_path)
    (ctrl,) = [c for c in cli.trainer.callbacks if isinstance(c, TrainingController)]
    assert [c.name for c in ctrl.config.controllers] == ["loss-not-finite", "loss-runaway"]
    assert "train_loss" in ctrl.values and cli.trainer.global_step == 6
    (saved,) = root.rglob("config.yaml")
    (callback,) = yaml.safe_load(saved.read_text())["trainer"]["callbacks"]
    assert callback["init_args"]["config"] == str(REPO / "configs" / "controller" / "stop_on_runaway.yaml")


def test_a_controller_file_is_looked_up_beside_the_config_then_in_the_working_directory(
    tmp_path, monkeypatch
):
    """A relative controller path in a config file: the file beside the config wins over one of the same
    name in the working directory, which is used when there is none beside it."""
    from lit_losses.cli.app import LitLossesCLI, LitLossesParser
    from lit_losses.data.text import TextDataModule
    from lit_losses.module import RegularizedLM

    text = (REPO / "configs" / "controller" / "stop_on_runaway.yaml").read_text()
    for folder, name, patience in (
        ("cfg", "both.yaml", 3),
        ("cwd", "both.yaml", 5),
        ("cwd", "cwd_only.yaml", 7),
    ):
        (tmp_path / folder).mkdir(exist_ok=True)
        thresholds = text.replace("patience_threshold: 1", f"patience_threshold: {patience}")
        (tmp_path / folder / name).write_text(thresholds)
    monkeypatch.chdir(tmp_path / "cwd")
    for name, expected in (("both.yaml", 3), ("cwd_only.yaml", 7)):
        config = tmp_path / "cfg" / f"uses_{name}"
        callback = {"class_path": "lit_losses.TrainingController", "init_args": {"config": name}}
        config.write_text(yaml.safe_dump({"trainer": {"callbacks": [callback]}}))
        cli = LitLossesCLI(
            RegularizedLM,
            TextDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=["--config", str(REPO / "configs" / "tiny_lm.yaml"), "--config", str(config)],
            parser_class=LitLossesParser,
            auto_configure_optimizers=False,
            run=False,
        )
        (ctrl,) = [c for c in cli.trainer.callbacks if isinstance(c, TrainingController)]
        assert ctrl.config.controllers[1].patience.patience_threshold == expected, name
