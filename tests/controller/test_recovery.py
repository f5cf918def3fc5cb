"""`SpikeRecovery` with the shipped config: a poisoned micro-batch is rolled back and the run ends as if it
had never seen it; repeated spikes give up with an error; skipped data, LR scale, checkpoint source."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import yaml

from lit_losses import GlobalStatsLoader, TinyLM, TrainingController
from lit_losses.controller import RecoveryError
from lit_losses.errors import ConfigError
from tests.controller.helpers import REPO, pattern_batches
from tests.helpers import quiet_trainer

CONFIG = REPO / "configs" / "controller" / "recover_from_spike.yaml"
POISON = 40  # the poisoned micro-batch is the 41st: optimizer step 41 spikes


class StepLosses(L.Callback):
    """The logged ``train/loss_total`` of every optimizer step, and the learning rate it was trained with."""

    def __init__(self):
        self.losses, self.lrs = {}, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = float(trainer.callback_metrics["train/loss_total"])
        self.lrs[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]


def model() -> TinyLM:
    L.seed_everything(0, verbose=False)
    optimizer = {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"}
    return TinyLM(vocab_size=64, d_model=32, n_layers=1, n_heads=2, optimizer=optimizer)


def recovery(**arguments) -> TrainingController:
    config = yaml.safe_load(CONFIG.read_text())
    config["operations"][0]["arguments"].update(arguments)
    return TrainingController(config)


def run(data, *callbacks, **trainer_kwargs):
    record, net = StepLosses(), model()
    trainer = quiet_trainer(
        max_steps=len(data), callbacks=[*callbacks, record], gradient_clip_val=1.0, **trainer_kwargs
    )
    trainer.fit(net, GlobalStatsLoader(data, batch_size=None))
    return record, net, trainer


@pytest.mark.slow
def test_a_poisoned_batch_is_rolled_back_and_the_run_ends_as_without_it():
    clean, clean_net, _ = run(pattern_batches(60))
    poisoned, _, _ = run(pattern_batches(60, poison_at=(POISON,)))
    ctrl = TrainingController(str(CONFIG))
    recovered, recovered_net, trainer = run(pattern_batches(60, poison_at=(POISON,)), ctrl)

    assert poisoned.losses[POISON + 1] > 50 * clean.losses[POISON]  # the spike: ~70x the trained loss
    assert [f["step"] for f in ctrl.fired] == [POISON + 1]
    assert trainer.global_step == 61
    # after the rollback, the same steps as the clean run (one step later): the poisoned step left nothing
    for step in range(POISON + 1, 61):
        assert recovered.losses[step + 1] == pytest.approx(clean.losses[step], rel=1e-6), step
    final, reference = recovered.losses[61], clean.losses[60]
    assert abs(final - reference) <= 0.02 * reference
    assert abs(poisoned.losses[61] - reference) > 0.02 * reference  # without recovery it does not
    for name, value in recovered_net.state_dict().items():
        torch.testing.assert_close(value, clean_net.state_dict()[name], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_repeated_spikes_give_up_after_max_attempts():
    ctrl = TrainingController(str(CONFIG))  # max_attempts: 3
    data = pattern_batches(50, poison_at=(POISON, POISON, POISON, POISON))
    expected = r"gave up after 3 rollbacks \(at steps \[41, 42, 43\]\); the rule still held at step 44 on "
    with pytest.raises(RecoveryError, match=expected + "on_optimizer_step_end with history="):
        run(data, ctrl)


@pytest.mark.slow
def test_skipped_batches_and_the_learning_rate_factor():
    ctrl = recovery(skip_batches=2, lr_factor=0.5)
    data = pattern_batches(50, poison_at=(POISON,))
    recovered, _, trainer = run(data, ctrl, max_epochs=1)
    assert [f["step"] for f in ctrl.fired] == [POISON + 1]
    (loader,) = [trainer.train_dataloader]
    assert loader.position.skipped == 2
    assert trainer.global_step == 51 - 2  # the epoch ended 2 micro-batches early
    assert recovered.lrs[POISON + 2] == pytest.approx(0.5 * recovered.lrs[POISON])
    # the run continues with micro-batch 43 of the data: as a run without micro-batches 41 and 42 would
    # (and with half the learning rate from there: compared to a run without the poison and the two)
    reference_data = [b for i, b in enumerate(data) if i not in (POISON, POISON + 1, POISON + 2)]
    skipping = recovery(lr_factor=0.5)
    reference, _, _ = run(reference_data[:POISON] + [data[POISON]] + reference_data[POISON:], skipping)
    for step in range(POISON + 2, 49):
        assert recovered.losses[step] == pytest.approx(reference.losses[step], rel=1e-6), step


class Weights(L.Callback):
    def __init__(self, step):
        self.step, self.weights = step, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.weights = {k: v.clone() for k, v in pl_module.state_dict().items()}


def test_roll_back_to_the_last_checkpoint(tmp_path):
    ctrl = recovery(source="checkpoint")
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1, filename="{step}"
    )
    after_rollback = Weights(POISON + 1)
    run(pattern_batches(45, poison_at=(POISON,)), ctrl, checkpoints, after_rollback)
    assert [f["step"] for f in ctrl.fired] == [POISON + 1]
    saved = torch.load(tmp_path / f"step={POISON}.ckpt", weights_only=True)["state_dict"]
    for name, value in after_rollback.weights.items():
        assert torch.equal(value, saved[name]), name


def test_bad_arguments_and_triggers_are_refused():
    with pytest.raises(ConfigError) as info:
        recovery(source="disk", max_attempts=0, lr_factor=-1)
    assert "arguments.source 'disk' is not one of ('snapshot', 'checkpoint')" in str(info.value)
    config = yaml.safe_load(CONFIG.read_text())
    config["controllers"][0]["triggers"] = ["on_train_batch_end"]
    with pytest.raises(
        ConfigError, match=r"recover.should_roll_back can only run on \['on_optimizer_step_end'"
    ):
        TrainingController(config)


def test_skipping_needs_a_global_stats_loader():
    trainer = quiet_trainer(max_steps=2, callbacks=[recovery(skip_batches=1)])
    with pytest.raises(ConfigError, match="skip_batches needs a GlobalStatsLoader"):
        trainer.fit(model(), torch.utils.data.DataLoader(pattern_batches(4), batch_size=None))
