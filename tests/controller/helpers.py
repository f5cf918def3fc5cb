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
    rule: str,
    operations=("lightning.should_training_stop",),
    patience=None,
    ops=(),
    metrics=STATE,
    trigger="on_optimizer_step_end",
    **extra,
):
    entry = {"name": "c", "triggers": [trigger], "rule": rule, "operations": list(operations)}
    if patience:
        entry["patience"] = patience
    entry.update(extra)
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


def pattern_batches(n: int, poison_at: tuple[int, ...] = (), vocab: int = 64) -> list[dict]:
    """``n`` micro-batches of 4 rows counting up by one (quickly learned: the loss falls to ~0.1), with a
    *poisoned* micro-batch (random labels: a loss ~70x the trained one) inserted at each ``poison_at``."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(n):
        ids = (torch.randint(0, vocab, (4, 1), generator=g) + torch.arange(17)) % vocab
        batches.append({"input_ids": ids[:, :-1].clone(), "labels": ids[:, 1:].clone()})
    poison = torch.Generator().manual_seed(99)
    for index in sorted(poison_at):
        labels = torch.randint(0, vocab, (4, 16), generator=poison)
        batches.insert(index, {"input_ids": batches[0]["input_ids"].clone(), "labels": labels})
    return batches
