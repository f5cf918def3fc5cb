"""Shared test helpers: a tiny model + data setup and a loss recorder."""

from __future__ import annotations

import lightning as L
import torch

from lit_losses import TextDataModule, TinyLM

TINY_MODEL = dict(d_model=32, n_layers=1, n_heads=2)
TINY_DATA = dict(vocab_size=512, seq_len=64, tokens_per_batch=256, max_documents=12, val_fraction=0.1)


def tiny_setup(corpus, **model_kwargs) -> tuple[TinyLM, TextDataModule]:
    data = TextDataModule(paths=[str(corpus / "*.txt")], **TINY_DATA)
    model = TinyLM(vocab_size=TINY_DATA["vocab_size"], **{**TINY_MODEL, **model_kwargs})
    return model, data


class LossRecorder(L.Callback):
    """Records the loss returned by every training step, keyed by the global step."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses[trainer.global_step] = float(outputs["loss"] if isinstance(outputs, dict) else outputs)


def quiet_trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def seed(value: int = 0) -> None:
    L.seed_everything(value, verbose=False)
    torch.manual_seed(value)
