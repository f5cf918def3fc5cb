"""Cost of global-denominator aggregation on the tiny LM: lookahead + collectives vs step time.

Runs a short `lit-losses`-style fit of the tiny LM of ``configs/tiny_lm.yaml`` (d_model 192, 3 layers,
vocab 4096, 4096-token micro-batches) with ``accumulate_grad_batches`` and, by default, 2 CPU DDP
processes (gloo), and measures on every rank, in the same run:

- ``lookahead``: time `GlobalStatsLoader` spends counting the window and all-reducing the counts;
- ``step sums``: time the module spends computing (all-reducing) and logging the exact step values
  (after an untimed barrier: see `TimedTinyLM`);
- ``train``: wall time of the training batches (first batch excluded: warm-up).

    python benchmarks/global_stats.py                        # 2 processes, accumulate 4, 12 steps
    python benchmarks/global_stats.py --devices 1 --steps 20
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import lightning as L
import torch

from lit_losses import TextDataModule, TinyLM


class Timer(L.Callback):
    def __init__(self) -> None:
        self.start = None
        self.end = None
        self.batches = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 1:
            self.start = time.perf_counter()
            self.lookahead_at_start = trainer.train_dataloader.lookahead_seconds
            self.sums_at_start = pl_module.step_sums_seconds

    def on_train_end(self, trainer, pl_module) -> None:
        self.end = time.perf_counter()
        loader = trainer.train_dataloader
        result = {
            "rank": trainer.global_rank,
            "train_s": self.end - self.start,
            "lookahead_s": loader.lookahead_seconds - self.lookahead_at_start,
            "step_sums_s": pl_module.step_sums_seconds - self.sums_at_start,
        }
        result["overhead_ratio"] = (result["lookahead_s"] + result["step_sums_s"]) / result["train_s"]
        print("RESULT " + json.dumps(result), flush=True)


class TimedTinyLM(TinyLM):
    """The tiny LM, timing its exact-step-value logging (one all-reduce per optimizer step).

    A barrier (not timed) first lets the ranks arrive together: waiting for the slower rank is not a
    cost of the collective (the step cannot end before the slower rank's gradient all-reduce anyway).
    """

    step_sums_seconds = 0.0

    def _log_step_sums(self) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        start = time.perf_counter()
        super()._log_step_sums()
        self.step_sums_seconds += time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads() // args.devices))
    data = TextDataModule(
        vocab_size=4096, seq_len=256, tokens_per_batch=4096, max_documents=300, val_fraction=0
    )
    model = TimedTinyLM(vocab_size=4096, d_model=192, n_layers=3, n_heads=3)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Timer()],
    )
    if trainer.global_rank == 0:
        print(f"{platform.machine()} · torch {torch.__version__} · {torch.get_num_threads()} threads/process")
        print(f"devices={args.devices} accumulate={args.accumulate} steps={args.steps}")
    trainer.fit(model, datamodule=data)


if __name__ == "__main__":
    main()
