"""2-process DDP runs of the controller; each rank writes what it saw to OUT_DIR/rank<r>.json.

PYTHONPATH=. python tests/controller/ddp_spike.py MODE OUT_DIR

- ``spike``: a poisoned micro-batch in rank 0's shard only; configs/controller/recover_from_spike.yaml
  rolls back. Each rank writes the steps it rolled back at and a checksum of its final weights.
- ``error``: a rule that fails on rank 1 only (a key typo behind ``proc["rank"] == 1``); each rank writes
  the error it stopped with (none may be left waiting for the other).
- ``custom``: an fms-hf-tuning style custom action (it runs on rank 0 only) asks to stop at step 3; each
  rank writes the step it stopped at.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L

from lit_losses import GlobalStatsLoader, TinyLM, TrainingController
from lit_losses.controller import Operation, RuleFailure, register_operation_handlers
from lit_losses.distributed import exit_distributed_process
from tests.controller.helpers import REPO, pattern_batches

POISONED = 55


class StopOnRankZero(Operation):
    def should_stop_now(self, control, **_):
        control.should_training_stop = True


register_operation_handlers(StopOnRankZero)
CUSTOM_CONFIG = {
    "controller_metrics": [{"name": "state", "class": "TrainingState"}],
    "operations": [{"name": "custom", "class": "StopOnRankZero"}],
    "controllers": [
        {
            "name": "stop",
            "triggers": ["on_step_end"],
            "rule": 'state["global_step"] == 3',
            "operations": ["custom.should_stop_now"],
        }
    ],
}
ERROR_CONFIG = {
    "controller-metrics": [
        {"name": "proc", "class": "PerProcessState"},
        {"name": "train_loss", "class": "Loss"},
    ],
    "controllers": [
        {
            "name": "typo-on-rank-1",
            "triggers": ["on_optimizer_step_end"],
            "rule": 'proc["rank"] == 1 and train_loss["los"] > 0',
            "operations": ["lightning.should_training_stop"],
        }
    ],
}


def main(mode: str, out_dir: str) -> None:
    L.seed_everything(0, verbose=False)
    optimizer = {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"}
    model = TinyLM(vocab_size=64, d_model=32, n_layers=1, n_heads=2, optimizer=optimizer)
    spike = str(REPO / "configs" / "controller" / "recover_from_spike.yaml")
    config = {"spike": spike, "error": ERROR_CONFIG, "custom": CUSTOM_CONFIG}[mode]
    controller = TrainingController(config)
    # Lightning shuffles training data under DDP (DistributedSampler, seed 0): item 55 is at position 80 of
    # epoch 0's permutation of the 101 items, rank 0's 41st micro-batch (optimizer step 41)
    data = pattern_batches(100, poison_at=(POISONED,))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=45,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[controller],
    )
    result: dict = {"rank": None}
    try:
        trainer.fit(model, GlobalStatsLoader(data, batch_size=None))
    except RuleFailure as exc:
        result["error"] = str(exc)
    weights = sum(float(p.detach().double().sum()) for p in model.parameters())
    result.update(rank=trainer.global_rank, step=trainer.global_step, weights=weights)
    result["fired"] = [f["step"] for f in controller.fired]
    (Path(out_dir) / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_distributed_process(0)  # ends the group and the process (a gloo rank can abort in the teardown)
