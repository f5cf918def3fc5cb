"""``model.distillation``: the module's loss against materialized logits (TRL's generalized JSD, written
again in `tests.heads.distillation_reference`), the step's exactness under DDP × accumulation, the
checkpoint without the teacher, exact resume, and the refusals before training."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_losses import GlobalStatsLoader, TextDataModule, TinyLM
from lit_losses.aggregation import GlobalStats
from lit_losses.errors import ConfigError
from tests.heads import distillation_reference as ref
from tests.helpers import quiet_trainer
from tests.loss import distill_step

SCRIPT = Path(distill_step.__file__)
VOCAB = distill_step.VOCAB


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("teacher") / "teacher.ckpt"
    distill_step.save_teacher(str(path))
    return str(path)


def student(teacher, **distillation) -> TinyLM:
    torch.manual_seed(0)
    options = {**distill_step.DISTILLATION, "teacher": teacher, **distillation}
    return TinyLM(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=2, distillation=options).double()


def batch(seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, VOCAB, (3, 10), generator=g)
    labels[:, :3] = -100
    labels[2, 5:] = -100
    return {"input_ids": torch.randint(0, VOCAB, (3, 10), generator=g), "labels": labels}


def reference_loss(model: TinyLM, data: dict, cfg: dict, teacher_logits) -> tuple[torch.Tensor, dict]:
    """``weight · Σ a_t d_t + ce_weight · Σ a_t c_t`` from both logits (token-mean: a_t = 1 / n)."""
    mask = data["labels"] != -100
    zs = model.forward_logits(data)
    d = ref.divergence(zs, teacher_logits, cfg["loss"], beta=cfg["beta"], temperature=cfg["temperature"])
    ce = torch.nn.functional.cross_entropy(zs.transpose(1, 2), data["labels"], reduction="none")
    a = mask.double() / mask.sum()
    agree = (zs.argmax(-1) == teacher_logits.argmax(-1)) & mask
    metrics = {"divergence": (a * d).sum(), "hard_ce": (a * ce).sum(), "top1_agreement": (a * agree).sum()}
    return cfg["weight"] * metrics["divergence"] + cfg["ce_weight"] * metrics["hard_ce"], metrics


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"loss": "forward_kl", "beta": 0.0, "ce_weight": 0.0},
        {"loss": "reverse_kl", "beta": 1.0, "weight": 2.0, "temperature": 0.5},
    ],
)
def test_the_loss_and_its_gradient_are_those_of_the_materialized_logits(teacher_path, options):
    model = student(teacher_path, **options)
    cfg = {**distill_step.DISTILLATION, **options}
    data = batch()
    out = model.compute_loss(data, "val")
    teacher = model.frozen_model("teacher")
    assert not any(p.requires_grad for p in teacher.runner.parameters())
    with torch.no_grad():
        teacher_logits = teacher.runner.forward_logits(data)
    expected, metrics = reference_loss(model, data, cfg, teacher_logits)
    torch.testing.assert_close(out.total, expected, rtol=1e-9, atol=1e-12)
    for name, value in metrics.items():
        torch.testing.assert_close(out.metrics[f"distillation/{name}"], value.detach(), rtol=1e-9, atol=1e-12)
    params = [p for p in model.parameters() if p.requires_grad]
    for got, want in zip(torch.autograd.grad(out.total, params), torch.autograd.grad(expected, params)):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-12)


def test_offline_top_k_in_the_batch_is_the_teacher(teacher_path):
    model = student(None, loss="forward_kl", beta=0.0, tail=True, ce_weight=0.0)
    data = batch(1)
    frozen = student(teacher_path).frozen_model("teacher")
    with torch.no_grad():
        logits = frozen.runner.forward_logits(data)
    top = torch.log_softmax(logits, -1).topk(4, dim=-1)
    data |= {"teacher_topk_ids": top.indices, "teacher_topk_logprobs": top.values}
    out = model.compute_loss(data, "val")
    mask = data["labels"] != -100
    p, q = ref.topk_bins(model.forward_logits(data), top.indices, top.values, tail=True, temperature=2.0)
    expected = (ref.bins_divergence(p, q, "forward_kl", 0.5) * mask).sum() / mask.sum()
    torch.testing.assert_close(out.total, expected, rtol=1e-9, atol=1e-12)
    del data["teacher_topk_ids"]
    with pytest.raises(ConfigError, match="teacher_topk_ids"):
        model.compute_loss(data, "val")


def run_ddp(loader: str, teacher: str, out: Path) -> dict:
    cmd = [sys.executable, str(SCRIPT), loader, teacher, str(out)]
    env = dict(os.environ, PYTHONPATH=str(SCRIPT.parents[2]))  # the worker imports tests.aggregation
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=SCRIPT.parents[2], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.ddp
def test_two_processes_times_two_micro_batches_equal_one_process_over_the_whole_batch(tmp_path, teacher_path):
    """``seq-mean-token-mean`` over packed micro-batches of different counts: the step's gradient, loss and
    distillation telemetry are those of one process over the global batch."""
    distill_step.run("full", teacher_path, str(tmp_path / "full.pt"))
    reference = torch.load(tmp_path / "full.pt")
    exact = run_ddp("global", teacher_path, tmp_path / "global.pt")
    for name, grad in reference["grads"].items():
        assert float((exact["grads"][name] - grad).abs().max() / grad.abs().max().clamp_min(1e-30)) < 1e-5, (
            name
        )
    assert exact["loss"] == pytest.approx(reference["loss"], rel=1e-6)
    names = ("divergence", "hard_ce", "top1_agreement")
    assert set(reference["telemetry"]) == {f"train/distillation/{name}" for name in names}
    assert reference["telemetry"]["train/distillation/divergence"] > 0.05
    assert exact["telemetry"] == pytest.approx(reference["telemetry"], rel=1e-5, abs=1e-7)


def fit(model, steps: int, root: Path) -> L.Trainer:
    data = [batch(2), batch(3)]
    trainer = quiet_trainer(max_steps=steps, default_root_dir=root, precision="64-true")
    trainer.fit(model, train_dataloaders=GlobalStatsLoader(data, batch_size=None))
    return trainer


def test_the_checkpoint_holds_no_teacher_and_resumes_exactly(tmp_path, text_corpus):
    """A run resumed from a mid-epoch checkpoint (the teacher reloaded from its source) ends with the
    weights of the run it was cut from, bit for bit."""
    teacher = str(tmp_path / "teacher.ckpt")
    distill_step.save_teacher(teacher, vocab_size=512)
    data = dict(
        paths=[str(text_corpus / "*.txt")],
        vocab_size=512,
        seq_len=64,
        tokens_per_batch=256,
        max_documents=12,
        val_fraction=0.0,
    )

    def train(root: Path, ckpt_path: str | None = None) -> dict:
        torch.manual_seed(0 if ckpt_path is None else 123)  # a resumed run must not depend on the global RNG
        model = TinyLM(
            vocab_size=512,
            d_model=32,
            n_layers=1,
            n_heads=2,
            distillation={**distill_step.DISTILLATION, "teacher": teacher},
        )
        save = L.pytorch.callbacks.ModelCheckpoint(
            root, every_n_train_steps=2, save_top_k=-1, filename="{step}"
        )
        trainer = quiet_trainer(max_steps=4, default_root_dir=root, callbacks=[save], limit_train_batches=3)
        trainer.fit(model, TextDataModule(**data), ckpt_path=ckpt_path)
        return {k: v.clone() for k, v in model.state_dict().items()}

    full = train(tmp_path / "full")
    half = tmp_path / "full" / "step=2.ckpt"
    checkpoint = torch.load(half, weights_only=True)
    assert set(checkpoint["state_dict"]) == set(full)  # the student's weights only
    assert checkpoint["hyper_parameters"]["distillation"]["teacher"] == teacher
    resumed = train(tmp_path / "resumed", ckpt_path=str(half))
    for name, value in full.items():
        assert torch.equal(value, resumed[name]), name


def test_refusals_name_the_option(tmp_path, teacher_path):
    with pytest.raises(ConfigError, match=r"model.distillation.teacher='no/such/teacher': no such file"):
        student("no/such/teacher")
    with pytest.raises(ConfigError, match=r"model.distillation.beta must be in \[0, 1\], got 2"):
        student(teacher_path, beta=2)
    for value in (0.0, float("nan")):
        with pytest.raises(ConfigError, match=r"model.distillation.temperature must be a finite number > 0"):
            student(teacher_path, temperature=value)
    with pytest.raises(
        ConfigError, match=r"model.distillation replaces the base loss; remove model.base_loss"
    ):
        TinyLM(vocab_size=VOCAB, base_loss="ppo", distillation={"teacher": teacher_path})
    with pytest.raises(ConfigError, match=r"model.distillation.temprature: not a field .* 'temperature'"):
        student(teacher_path, temprature=1.0)
    other = TinyLM(
        vocab_size=VOCAB + 1, d_model=32, n_layers=1, n_heads=2, distillation={"teacher": teacher_path}
    )
    with pytest.raises(ConfigError, match=r"has a vocabulary of 64 tokens and the student \(TinyLM\) 65"):
        fit(other, 1, tmp_path)
    stats = GlobalStats.local_only(batch())
    assert stats is not None
