"""Regularizers in real Lightning runs: telemetry, skip policy, runtime weights across resume, YAML."""

from __future__ import annotations

import glob

import lightning as L
import pytest
import torch

from lit_losses import GlobalStatsLoader, TinyLM
from lit_losses.regularizers import RegularizerSpec
from tests.aggregation.ddp_step import micro_batches
from tests.helpers import quiet_trainer


def flaky(ctx):
    if ctx.step == 1:
        raise RuntimeError("external checker unavailable")
    return ctx.logprobs.square()


def tiny(**kwargs) -> TinyLM:
    L.seed_everything(0, verbose=False)
    return TinyLM(vocab_size=64, d_model=16, n_layers=1, n_heads=2, **kwargs)


class Record(L.Callback):
    def __init__(self):
        self.metrics, self.weights = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})
        self.weights.append(pl_module.regularizer_set.state_dict())


def test_skip_policy_keeps_training_and_flags_the_step():
    specs = [
        RegularizerSpec(name="flaky", fn=flaky, on_error="skip"),
        RegularizerSpec(name="z_loss", weight=1e-3),
    ]
    model, record = tiny(regularizers=specs, regularizer_grad_norm=True), Record()
    quiet_trainer(max_steps=3, callbacks=[record]).fit(
        model, GlobalStatsLoader(micro_batches(), batch_size=None)
    )
    flags = [m["regularizers/flaky/error"] for m in record.metrics]
    assert flags == [0.0, 1.0, 0.0]
    assert record.metrics[1]["regularizers/flaky/contribution"] == 0.0
    assert all(m["regularizers/z_loss/grad_norm"] > 0 for m in record.metrics)
    telemetry = model.telemetry
    assert set(telemetry) == {"loss_total", "base_loss", "regularizer_total", "regularizers"}
    assert telemetry["loss_total"] == pytest.approx(record.metrics[-1]["train/loss_total"])
    assert set(telemetry["regularizers"]["z_loss"]) >= {"value", "weight", "contribution", "custom"}


class ChangeWeights(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            pl_module.regularizer_set.set_weight("z_loss", 0.123)
            pl_module.regularizer_set.set_enabled("entropy", False)


def test_runtime_weights_survive_checkpoint_and_resume(tmp_path):
    specs = [RegularizerSpec(name="z_loss", weight=1e-3), RegularizerSpec(name="entropy", weight=0.01)]
    data = micro_batches()
    ckpt = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path, save_last=True, every_n_train_steps=1, save_top_k=-1
    )
    first = tiny(regularizers=specs)
    quiet_trainer(max_steps=3, callbacks=[ChangeWeights(), ckpt]).fit(
        first, GlobalStatsLoader(data, batch_size=None)
    )
    assert first.regularizer_set.state_dict()["z_loss"]["weight"] == 0.123
    loaded = TinyLM.load_from_checkpoint(tmp_path / "last.ckpt")  # hyper-parameters are plain data
    assert loaded.regularizer_set.state_dict() == first.regularizer_set.state_dict()

    resumed, record = tiny(regularizers=specs), Record()
    assert resumed.regularizer_set.state_dict()["z_loss"]["weight"] == 1e-3
    trainer = quiet_trainer(max_steps=5, callbacks=[record])
    trainer.fit(resumed, GlobalStatsLoader(data, batch_size=None), ckpt_path=str(tmp_path / "last.ckpt"))
    assert record.weights[0] == {
        "entropy": {"weight": 0.01, "enabled": False},
        "z_loss": {"weight": 0.123, "enabled": True},
    }
    assert record.metrics[0]["regularizers/z_loss/weight"] == pytest.approx(0.123)
    assert record.metrics[0]["regularizers/entropy/contribution"] == 0.0


@pytest.mark.slow
def test_yaml_only_run_writes_the_telemetry_keys_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.test_cli import REPO, run_cli

    _, root = run_cli(["--config", str(REPO / "configs" / "regularizers.yaml")], tmp_path)
    (events,) = glob.glob(str(root / "**" / "events.out.tfevents.*"), recursive=True)
    acc = EventAccumulator(events)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {"train/loss_total", "train/base_loss", "train/regularizer_total"}
    for name in ("z_loss", "entropy"):
        expected |= {
            f"regularizers/{name}/{k}" for k in ("value", "weight", "contribution", "grad_norm", "error")
        }
    assert expected <= tags, sorted(expected - tags)
    weights = [e.value for e in acc.Scalars("regularizers/entropy/weight")]
    assert weights[0] == 0.0 and weights[-1] > 0  # the linear warmup schedule of the YAML
    assert torch.isfinite(torch.tensor([e.value for e in acc.Scalars("train/loss_total")])).all()
