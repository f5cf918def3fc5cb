"""The fine-tuning path end to end through ``lit-losses fit``: {TinyLM, HFCausalLM, HFCausalLM + LoRA} ×
{1 process, DDP on 2, FSDP2 on 2 with the stock ``configs/fsdp2.yaml``}.

Each 2-process run of 6 optimizer steps logs the ``train/loss_total`` of one process with
``accumulate_grad_batches`` doubled (the same global batches); each run resumed from its step-3
checkpoint (a file, or for FSDP2 the sharded folder) logs the uninterrupted run's values at steps 4–6 bit
for bit and ends with its weights. A fit sent ``SIGTERM`` in the middle of step k leaves a checkpoint at
step k, exits with code 143, and resumes to the uninterrupted run's final loss exactly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.parallel.launch import launch

pytest.importorskip("transformers")
pytest.importorskip("peft")

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
ACCUMULATE = 2  # per process in the 2-process runs; the 1-process run accumulates twice as many
STEPS, CKPT_STEP = 6, 3

DATA = [
    "--data.init_args.max_documents=24",
    "--data.init_args.vocab_size=320",
    "--data.init_args.seq_len=32",
    "--data.init_args.tokens_per_batch=128",
]
TRAINER = [
    f"--trainer.max_steps={STEPS}",
    "--trainer.limit_val_batches=0",
    "--trainer.log_every_n_steps=1",
    "--trainer.accelerator=cpu",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--model.init_args.optimizer.total_steps=6",  # the schedule must not depend on max_steps
    "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
    f"--trainer.callbacks.every_n_train_steps={CKPT_STEP}",
    "--trainer.callbacks.save_top_k=-1",
    "--trainer.callbacks.filename={step}",
]
HF = [
    "--model.init_args.config.num_hidden_layers=2",
    "--model.init_args.config.hidden_size=48",
    "--model.init_args.config.intermediate_size=96",
    "--model.init_args.config.max_position_embeddings=64",
]
MODELS = {
    "tiny": [
        "--config",
        str(CONFIGS / "tiny_lm.yaml"),
        "--model.init_args.n_layers=2",
        "--model.init_args.d_model=48",
    ],
    "hf": ["--config", str(CONFIGS / "hf_causal_lm.yaml"), *HF],
    "hf_lora": [
        "--config",
        str(CONFIGS / "hf_causal_lm.yaml"),
        *HF,
        "--model.init_args.lora={r: 4, lora_alpha: 8, target_modules: [q_proj, v_proj]}",
    ],
}
STRATEGIES = {
    "single": [f"--trainer.accumulate_grad_batches={2 * ACCUMULATE}", "--trainer.devices=1"],
    "ddp": [
        f"--trainer.accumulate_grad_batches={ACCUMULATE}",
        "--trainer.devices=2",
        "--trainer.strategy=ddp",
    ],
    "fsdp2": [f"--trainer.accumulate_grad_batches={ACCUMULATE}", "--config", str(CONFIGS / "fsdp2.yaml")],
}


def fit(root: Path, model: str, strategy: str, *extra: str, expect: int = 0) -> subprocess.CompletedProcess:
    """``lit-losses fit`` in a process of its own (2-process strategies launch a second one)."""
    args = [*MODELS[model], *STRATEGIES[strategy], *DATA, *TRAINER, *extra]
    args += [f"--trainer.default_root_dir={root}", f"--trainer.logger.init_args.save_dir={root}"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "lit_losses.cli", "fit", *args]
    proc = subprocess.run(cmd, cwd=root.parent, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == expect, proc.stderr[-4000:]
    return proc


def logged_losses(root: Path) -> dict[int, float]:
    (events,) = {p.parent for p in root.rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("train/loss_total")}


def checkpoint(root: Path, step: int, prefix: str = "step=") -> Path:
    (path,) = root.rglob(f"{prefix}{step}.ckpt")
    return path


def weights(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's weights as whole tensors (a sharded folder read with torch's own converter)."""
    if path.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        whole = path.parent / f"{path.name}.whole.pt"
        dcp_to_torch_save(path, whole)
        state = torch.load(whole, weights_only=True)["state_dict"]
    else:
        state = torch.load(path, weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory):
    """Per model: the folder of its 1-process run (made once, on demand)."""
    roots: dict[str, Path] = {}

    def get(model: str) -> Path:
        if model not in roots:
            roots[model] = tmp_path_factory.mktemp(f"{model}-single") / "run"
            fit(roots[model], model, "single")
        return roots[model]

    return get


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_run_equals_one_process_and_resumes_exactly(model, strategy, single_process_run, tmp_path):
    expected = logged_losses(single_process_run(model))
    full_root = single_process_run(model) if strategy == "single" else tmp_path / "full"
    if strategy != "single":
        fit(full_root, model, strategy)
    full = logged_losses(full_root)
    assert sorted(full) == list(range(STEPS))
    for step, value in expected.items():
        assert full[step] == pytest.approx(value, rel=1e-6, abs=1e-6), (step, full, expected)
    ckpt = checkpoint(full_root, CKPT_STEP)
    assert ckpt.is_dir() == (strategy == "fsdp2")  # FSDP2: the sharded folder of the stock config
    resumed_root = tmp_path / "resumed"
    fit(resumed_root, model, strategy, f"--ckpt_path={ckpt}")
    resumed = logged_losses(resumed_root)
    assert sorted(resumed) == list(range(CKPT_STEP, STEPS))
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)  # bit for bit
    final, resumed_final = weights(checkpoint(full_root, STEPS)), weights(checkpoint(resumed_root, STEPS))
    assert final.keys() == resumed_final.keys()
    for name, value in final.items():
        assert torch.equal(value, resumed_final[name]), name


class SignalAtStep(L.Callback):
    """Sends ``SIGTERM`` to this process at the first micro-batch of optimizer step ``step`` (0-based: the
    step that ends with ``global_step == step``), so that the step is in flight when it arrives."""

    def __init__(self, step: int, rank: int = 0) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        first = batch_idx % trainer.accumulate_grad_batches == 0
        if first and trainer.global_step == self.step - 1 and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "strategy", "rank"), [("tiny", "single", 0), ("hf", "single", 0), ("tiny", "ddp", 1)]
)
def test_sigterm_checkpoints_the_step_in_flight_exits_143_and_resumes_exactly(
    model, strategy, rank, tmp_path
):
    """The signal arrives at the first of the step's micro-batches (on rank 1 only for DDP: every rank
    stops after the same step); the run finishes that step, writes its checkpoint and exits 143."""
    full_root = tmp_path / "full"
    fit(full_root, model, strategy)
    step = 2
    stopped_root = tmp_path / "stopped"
    signal_at = [
        "--trainer.callbacks+=tests.test_real_path.SignalAtStep",
        f"--trainer.callbacks.step={step}",
        f"--trainer.callbacks.rank={rank}",
    ]
    proc = fit(stopped_root, model, strategy, *signal_at, expect=143)
    assert f"preempted by SIGTERM after step {step}" in proc.stderr + proc.stdout
    ckpt = checkpoint(stopped_root, step, prefix="preempted-step=")
    assert torch.load(ckpt, weights_only=True)["global_step"] == step
    assert sorted(logged_losses(stopped_root)) == list(range(step))
    resumed_root = tmp_path / "resumed"
    fit(resumed_root, model, strategy, f"--ckpt_path={ckpt}")
    full, resumed = logged_losses(full_root), logged_losses(resumed_root)
    assert sorted(resumed) == list(range(step, STEPS))
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)


class ReportRunDir(L.Callback):
    """Writes this rank's ``logger.version`` and ``log_dir`` to ``<out>/rank<r>.json`` at the fit's start."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:
        report = {"version": trainer.logger.version, "log_dir": trainer.log_dir}
        (Path(self.out) / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


@pytest.mark.slow
@pytest.mark.ddp
def test_every_rank_of_two_nodes_names_rank_zeros_run_folder(tmp_path):
    """Two simulated ``torchrun`` nodes of one process each: the second node's rank was not launched by
    rank 0's process, lists the log folder after rank 0 claimed ``version_1`` and would pick
    ``version_2``; it takes rank 0's version and folder."""
    root, out = tmp_path / "run", tmp_path / "reports"
    out.mkdir()
    (root / "tensorboard" / "version_0").mkdir(parents=True)  # another run's folder: rank 0 claims version_1
    args = [
        *MODELS["tiny"],
        *DATA,
        *TRAINER,
        "--trainer.max_steps=1",
        "--trainer.num_nodes=2",
        "--trainer.devices=1",
        "--trainer.strategy=ddp",
        "--trainer.callbacks+=tests.test_real_path.ReportRunDir",
        f"--trainer.callbacks.out={out}",
        f"--trainer.default_root_dir={root}",
        f"--trainer.logger.init_args.save_dir={root}",
    ]
    launch("lit_losses.cli", 2, "fit", *args, timeout=300, nodes=2)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert reports[0] == reports[1], reports
    assert reports[0]["version"] == 1 and reports[0]["log_dir"] == str(root / "tensorboard" / "version_1")
