"""2-process DDP run in which only rank 1's local value triggers the rule; each rank writes its final step.

PYTHONPATH=. python tests/controller/ddp_stop.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L

from lit_losses import GlobalStatsLoader, TinyLM, TrainingController
from lit_losses.distributed import exit_distributed_process
from tests.aggregation.ddp_step import micro_batches

CONFIG = {
    "controller-metrics": [
        {"name": "proc", "class": "PerProcessState"},
        {"name": "state", "class": "TrainingState"},
    ],
    "controllers": [
        {
            "name": "rank1-only",
            "triggers": ["on_train_batch_end"],
            "rule": 'proc["rank"] == 1 and state["global_step"] >= 2',
            "operations": ["lightning.should_training_stop"],
        }
    ],
}


def main(out_dir: str) -> None:
    L.seed_everything(0, verbose=False)
    model = TinyLM(vocab_size=64, d_model=16, n_layers=1, n_heads=2)
    controller = TrainingController(CONFIG)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=20,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[controller],
    )
    trainer.fit(model, GlobalStatsLoader(micro_batches() * 4, batch_size=None))
    result = {"rank": trainer.global_rank, "step": trainer.global_step, "fired": controller.fired}
    (Path(out_dir) / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
    exit_distributed_process(0)  # ends the group and the process (a gloo rank can abort in the teardown)
