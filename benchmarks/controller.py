"""Cost of a `TrainingController` with 5 rules on ``on_train_batch_end``, measured inside one run.

The tiny LM of ``configs/tiny_lm.yaml`` (d_model 192, 3 layers, vocab 4096) trains on synthetic packed
micro-batches of 16 × 256 tokens; the controller's hook time (metric handlers, 5 rule evaluations,
patience; the rules never fire) is summed and divided by the wall time of the training batches.

    python benchmarks/controller.py --steps 20
"""

from __future__ import annotations

import argparse
import platform
import time

import lightning as L
import torch

from lit_losses import GlobalStatsLoader, TinyLM, TrainingController

CONFIG = {
    "controller-metrics": [
        {"name": "train_loss", "class": "Loss"},
        {"name": "state", "class": "TrainingState"},
        {
            "name": "history",
            "class": "HistoryBasedMetric",
            "arguments": {"key": "train/loss_total", "window": 10},
        },
        {"name": "regs", "class": "RegularizerState"},
    ],
    "controllers": [
        {
            "name": "runaway",
            "triggers": ["on_train_batch_end"],
            "rule": 'train_loss["loss"] > 1e6 or not is_finite(train_loss["loss"])',
            "operations": ["lightning.should_training_stop"],
        },
        {
            "name": "patience",
            "triggers": ["on_train_batch_end"],
            "rule": 'train_loss["loss"] > 1e5',
            "patience": {"patience_threshold": 3},
            "operations": ["lightning.should_training_stop"],
        },
        {
            "name": "spike",
            "triggers": ["on_train_batch_end"],
            "rule": 'history["full"] and history["window"][-1] > 10 * mean(history["window"])',
            "operations": ["lightning.should_save_checkpoint"],
        },
        {
            "name": "late",
            "triggers": ["on_train_batch_end"],
            "rule": 'state["global_step"] > 10**9',
            "operations": ["lightning.should_log"],
        },
        {
            "name": "stale",
            "triggers": ["on_train_batch_end"],
            "rule": 'state["global_step"] - train_loss["step"] > 100 and abs(min(history["window"])) > 1e9',
            "operations": ["lightning.should_log"],
        },
    ],
}


class TimedController(TrainingController):
    seconds = 0.0

    def _on_event(self, event, trainer, pl_module):
        start = time.perf_counter()
        super()._on_event(event, trainer, pl_module)
        self.seconds += time.perf_counter() - start


class Clock(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 2:
            self.start, self.ctrl_start = time.perf_counter(), trainer.callbacks[0].seconds

    def on_train_end(self, trainer, pl_module):
        train = time.perf_counter() - self.start
        ctrl = trainer.callbacks[0].seconds - self.ctrl_start
        print(
            f"| {trainer.global_step - 2} steps | train {train:.2f} s | controller {ctrl * 1e3:.1f} ms | "
            f"{100 * ctrl / train:.3f} % |"
        )


def micro_batches(n: int, rows: int = 16, width: int = 256, vocab: int = 4096) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (rows, width), generator=g)
        labels = torch.roll(ids, -1, 1)
        labels[:, -1] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    model = TinyLM(vocab_size=4096, d_model=192, n_layers=3, n_heads=3)
    print(f"{platform.machine()} · torch {torch.__version__} · {torch.get_num_threads()} threads")
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TimedController(CONFIG), Clock()],
    )
    trainer.fit(model, GlobalStatsLoader(micro_batches(args.steps + 2), batch_size=None))


if __name__ == "__main__":
    main()
