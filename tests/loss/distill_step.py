"""One optimizer step of a tiny student distilled from a frozen tiny teacher (another width), over a fixed
global batch of packed, variable-length micro-batches.

Run as a script (``python tests/loss/distill_step.py LOADER TEACHER OUT``) so that Lightning's DDP launcher
can start the second process. ``LOADER``: ``full`` (one process, the global batch as one micro-batch) or
``global`` (2 DDP processes × 2 accumulated micro-batches, `GlobalStatsLoader`). ``TEACHER``: the teacher's
`RegularizedLM` checkpoint file (`save_teacher`). Rank 0 saves the gradients seen in
``on_before_optimizer_step``, the logged ``train/loss_total`` and the ``train/distillation/*`` telemetry.
"""

from __future__ import annotations

import sys

import lightning as L
import torch

from lit_losses import GlobalStatsLoader, TinyLM
from lit_losses.distributed import exit_distributed_process
from lit_losses.hparams import plain_data
from tests.aggregation.ddp_step import micro_batches, one_batch

VOCAB, RANKS, ACCUMULATE = 64, 2, 2
DISTILLATION = {"loss": "jsd", "beta": 0.3, "temperature": 2.0, "weight": 1.0, "ce_weight": 0.5}


def save_teacher(path: str, vocab_size: int = VOCAB) -> None:
    """A TinyLM of width 48 (the student's is 32) with sharp, seeded weights, as a Lightning checkpoint."""
    torch.manual_seed(1)
    teacher = TinyLM(vocab_size=vocab_size, d_model=48, n_layers=1, n_heads=2)
    with torch.no_grad():
        teacher.body.embed.weight.mul_(8.0)  # far from uniform: the divergence is not small
    torch.save(
        {
            "state_dict": teacher.state_dict(),
            "hyper_parameters": plain_data(dict(teacher.hparams)),
            "pytorch-lightning_version": L.__version__,
        },
        path,
    )


class CaptureFirstStep(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 0 and trainer.is_global_zero:
            grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()}
            metrics = trainer.callback_metrics
            telemetry = {k: float(v) for k, v in metrics.items() if k.startswith("train/distillation/")}
            loss = float(metrics["train/loss_total"])
            torch.save({"grads": grads, "loss": loss, "telemetry": telemetry}, self.path)


def run(loader: str, teacher: str, path: str) -> None:
    batches = micro_batches(RANKS * ACCUMULATE)
    full = loader == "full"
    data = [one_batch(batches)] if full else batches
    L.seed_everything(0, verbose=False)
    model = TinyLM(
        vocab_size=VOCAB,
        d_model=32,
        n_layers=2,
        n_heads=2,
        loss_agg="seq-mean-token-mean",
        head_backend="chunked",
        distillation={**DISTILLATION, "teacher": teacher},
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1 if full else RANKS,
        strategy="auto" if full else "ddp",
        max_steps=1,
        accumulate_grad_batches=1 if full else ACCUMULATE,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[CaptureFirstStep(path)],
    )
    trainer.fit(model, train_dataloaders=GlobalStatsLoader(data, batch_size=None, shuffle=False))


if __name__ == "__main__":
    run(*sys.argv[1:4])
    exit_distributed_process(0)  # ends the group and the process (a gloo rank can abort in the teardown)
