"""Short runs of the main job through ``lit-losses fit`` (in this process), shared by the run-end and
report tests: the shipped configs with small shapes."""

from __future__ import annotations

import json
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_losses.cli.app import cli_main

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
MAIN_JOB = [  # the command: the main job with regularizers under a controller
    *("--config", str(CONFIGS / "tiny_lm.yaml")),
    *("--config", str(CONFIGS / "regularizers.yaml")),
    *("--config", str(CONFIGS / "controlled.yaml")),
]
SHORT = [
    "--trainer.max_steps=6",
    "--trainer.val_check_interval=3",
    "--trainer.limit_val_batches=2",
    "--trainer.log_every_n_steps=1",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--data.init_args.max_documents=24",
    "--data.init_args.vocab_size=320",
    "--data.init_args.seq_len=32",
    "--data.init_args.tokens_per_batch=128",
    "--model.init_args.n_layers=1",
    "--model.init_args.d_model=48",
]


def fit_short(root: Path, *args: str):
    """The main job, short, writing under ``root``; returns the CLI object."""
    return cli_main(
        [
            "fit",
            *MAIN_JOB,
            *SHORT,
            f"--trainer.default_root_dir={root}",
            f"--trainer.logger.init_args.save_dir={root}",
            *args,
        ]
    )


def run_folder(root: Path) -> Path:
    """The one version folder of the run under ``root``."""
    (folder,) = {p.parent for p in root.rglob("events.out.tfevents.*")}
    return folder


def read_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the run's event files, read with TensorBoard's own reader: tag → {step: value}."""
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def run_end(folder: Path) -> dict:
    return json.loads((folder / "run_end.json").read_text())
