"""Shared by the controller tests: the tiny LM, a one-controller `TrainingController`, a short fit."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from lit_losses import GlobalStatsLoader, TinyLM, TrainingController
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


def torch_loader(data):
    return torch.utils.data.DataLoader(data, batch_size=None)
