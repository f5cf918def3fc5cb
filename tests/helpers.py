"""Shared test helpers: a tiny model + data setup and a loss recorder."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from lit_losses import RegularizedLM, TextDataModule, TinyLM

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


#: Lightning's default output folder for `quiet_trainer` (checkpoints of trainers without a logger);
#: conftest points it at a pytest temporary folder so that no test writes into the working directory.
TRAINER_ROOT: Path | None = None


def quiet_trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        default_root_dir=TRAINER_ROOT,
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


class EmbeddingLM(RegularizedLM):
    """A minimal `RegularizedLM` (embedding → tanh → linear with bias) for exact float64 checks."""

    def __init__(self, vocab_size: int = 11, d_model: int = 6, **kwargs) -> None:
        super().__init__(**kwargs)
        self.embed = torch.nn.Embedding(vocab_size, d_model)
        self.lm_head = torch.nn.Linear(d_model, vocab_size)

    def forward_hidden(self, batch):
        return torch.tanh(self.embed(batch["input_ids"]))

    def output_projection(self):
        return self.lm_head.weight, self.lm_head.bias

    def reference_head(self, batch):
        """Naive float64 ``(logprobs, lse, entropy)`` of the labels, from materialized logits."""
        logits = self.lm_head(self.forward_hidden(batch))
        logp_all = torch.log_softmax(logits, -1)
        mask = batch["labels"] != -100
        logp = logp_all.gather(-1, batch["labels"].clamp_min(0)[..., None])[..., 0]
        zero = torch.zeros_like(logp)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        lse = torch.logsumexp(logits, -1)
        return (
            torch.where(mask, logp, zero),
            torch.where(mask, lse, zero),
            torch.where(mask, entropy, zero),
            mask,
        )


def random_batch(vocab_size: int = 11, B: int = 3, T: int = 7, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab_size, (B, T), generator=g)
    labels[torch.rand(B, T, generator=g) < 0.25] = -100
    return {"input_ids": torch.randint(0, vocab_size, (B, T), generator=g), "labels": labels}


def dr_grpo(per_token: torch.Tensor, labels: torch.Tensor, segment_ids: torch.Tensor, norm: float):
    """Naive ``(1/S) Σ_s Σ_{t∈s} L_t / C``: a sequence is a (row, segment) pair with a target."""
    sequences: dict[tuple[int, int], list[torch.Tensor]] = {}
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            if labels[b, t] != -100:
                sequences.setdefault((b, int(segment_ids[b, t])), []).append(per_token[b, t])
    return sum(torch.stack(v).sum() / norm for v in sequences.values()) / len(sequences)
