"""Short runs of ``lit-losses fit`` that write a checkpoint at every step (a file, or under FSDP2 a folder),
shared by the checkpoint tests, and the callbacks they add through the command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L

from lit_losses.aggregation.window import window_ends
from lit_losses.cli import cli_main

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
STEPS = 4
MODELS = {
    "tiny": [
        *("--config", str(CONFIGS / "tiny_lm.yaml")),
        "--model.init_args.n_layers=1",
        "--model.init_args.d_model=32",
        "--model.init_args.n_heads=2",
        # a learning rate that moves the loss at every step: a wrong optimizer state shows in the next step
        "--model.init_args.optimizer={lr: 0.01, warmup_steps: 0, schedule: constant}",
    ],
    # the users' path: a Hugging Face Llama (random weights) with LoRA adapters on q/v and trainable copies
    # of the RMSNorms (peft's modules_to_save: a second optimizer group, without weight decay), in float64
    # (the topologies then agree to rounding); the stock config's clipping, warmup and cosine schedule
    "hf_lora": [
        *("--config", str(CONFIGS / "hf_causal_lm.yaml")),
        "--model.init_args.config.num_hidden_layers=2",
        "--model.init_args.config.hidden_size=16",
        "--model.init_args.config.intermediate_size=32",
        "--model.init_args.config.num_attention_heads=2",
        "--model.init_args.config.max_position_embeddings=32",
        "--model.init_args.dtype=float64",
        "--model.init_args.lora={r: 2, lora_alpha: 4, target_modules: [q_proj, v_proj], "
        "modules_to_save: [norm]}",
        "--model.init_args.optimizer={lr: 0.01, warmup_steps: 1, schedule: cosine, total_steps: 4}",
    ],
}
ARGS = [  # every model's
    "--data.init_args.max_documents=24",
    "--data.init_args.vocab_size=320",
    "--data.init_args.seq_len=32",
    "--data.init_args.tokens_per_batch=128",
    "--trainer.limit_val_batches=0",
    "--trainer.accelerator=cpu",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.logger=false",
    "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
    "--trainer.callbacks.every_n_train_steps=1",
    "--trainer.callbacks.save_top_k=-1",
    "--trainer.callbacks.save_last=true",
    "--trainer.callbacks.filename={step}",
]
TOPOLOGIES = {  # the same global batch: 4 micro-batches per optimizer step
    "single": ["--trainer.devices=1", "--trainer.accumulate_grad_batches=4"],
    "ddp": ["--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.accumulate_grad_batches=2"],
    "fsdp2": ["--config", str(CONFIGS / "fsdp2.yaml"), "--trainer.accumulate_grad_batches=2"],
}


class RecordLosses(L.Callback):
    """Keeps the logged ``train/loss_total`` of every optimizer step (global rank 0 writes them to ``out``
    as JSON at every step, when given: a killed run's steps are on disk)."""

    def __init__(self, out: str | None = None) -> None:
        self.out = out
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step - 1  # the step just taken (logged under that index)
        value = trainer.callback_metrics.get("train/loss_total")
        if value is None or not window_ends(trainer, batch_idx):
            return
        self.losses[step] = float(value)
        if self.out and trainer.is_global_zero:
            Path(self.out).write_text(json.dumps(self.losses))


class KillInsideSave(L.Callback):
    """``SIGKILL`` to every rank inside the write of the checkpoint named ``name`` after optimizer step
    ``step``: once ``torch.distributed.checkpoint.save`` has written the shards and ``.metadata`` (before
    Lightning's ``meta.pt`` and the manifest), or, for a file, once the checkpoint file is written."""

    def __init__(self, step: int, name: str = "last.ckpt") -> None:
        self.step, self.name = step, name

    def setup(self, trainer, pl_module, stage) -> None:
        import torch.distributed.checkpoint as dcp

        save, io = dcp.save, trainer.strategy.checkpoint_io
        io_save = io.save_checkpoint

        def kill_if_due(path) -> None:
            if self.name in Path(str(path)).name and trainer.global_step == self.step:
                os.kill(os.getpid(), signal.SIGKILL)

        def dcp_save(state_dict, *args, checkpoint_id=None, **kwargs):
            result = save(state_dict, *args, checkpoint_id=checkpoint_id, **kwargs)
            kill_if_due(checkpoint_id)
            return result

        def file_save(checkpoint, path, storage_options=None):
            io_save(checkpoint, path, storage_options)
            kill_if_due(path)

        dcp.save, io.save_checkpoint = dcp_save, file_save


def fit_args(root: Path, topology: str, *extra: str, steps: int = STEPS, model: str = "tiny") -> list[str]:
    trainer = [f"--trainer.max_steps={steps}", f"--trainer.default_root_dir={root}"]
    return ["fit", *MODELS[model], *ARGS, *TOPOLOGIES[topology], *trainer, *extra]


def fit_here(root: Path, *extra: str, steps: int = STEPS) -> dict[int, float]:
    """A 1-process ``lit-losses fit`` in this process; the logged losses by step."""
    record = "--trainer.callbacks+=tests.checkpoint.runs.RecordLosses"
    cli = cli_main(fit_args(root, "single", record, *extra, steps=steps))
    (recorder,) = [c for c in cli.trainer.callbacks if isinstance(c, RecordLosses)]
    return recorder.losses


def fit_process(
    root: Path, topology: str, *extra: str, expect: int = 0, steps: int = STEPS, model: str = "tiny"
):
    """``lit-losses fit`` of ``model`` (`MODELS`) in processes of its own; ``(completed process, logged
    losses by step)``."""
    out = root.parent / f"{root.name}-losses.json"
    record = ["--trainer.callbacks+=tests.checkpoint.runs.RecordLosses", f"--trainer.callbacks.out={out}"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    args = fit_args(root, topology, *record, *extra, steps=steps, model=model)
    cmd = [sys.executable, "-m", "lit_losses.cli", *args]
    proc = subprocess.run(cmd, cwd=root.parent, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == expect, proc.stderr[-4000:]
    losses = json.loads(out.read_text()) if out.exists() else {}
    return proc, {int(k): v for k, v in losses.items()}
