"""Whole training runs of TRL 1.16's own trainers (``trainer.train()``: transformers' optimizer, scheduler,
accumulation, clipping and logging) against ``lit-losses fit`` on the options that
docs/coming-from-trl.md maps their arguments to (`trl_runs`).

Both runs start from the same tiny float64 Llama (and the same LoRA adapters) and train on the same
micro-batches in the same order: TRL's, recorded as its loop consumed them and rebuilt through this
package's collation. Per optimizer step, the loss, the learning rate and the gradient norm before
clipping agree, and at the end every trainable parameter. TRL's fused head keeps its softmax statistics
in float32, so the agreement is to float32 precision.

- SFT, prompt-completion records (``completion_only_loss``), ``gradient_accumulation_steps=2`` over
  micro-batches of unequal token counts: transformers divides each micro-batch's summed loss by the
  window's token count (``num_items_in_batch``), the global token mean of this package.
- DPO with LoRA, ``gradient_accumulation_steps=2`` (as many pairs in each micro-batch), warmup, linear
  decay and clipping (every step's gradient norm is above ``max_grad_norm``), ``logging_steps=2``:
  transformers logs the mean loss of the steps since the last log, Lightning the logged step's own.
- DPO by epochs (``num_train_epochs``), full fine-tuning against TRL's default reference (a copy of the
  initial policy), ``constant_with_warmup``.
- Every ``lr_scheduler_type`` of the table against transformers' own schedulers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from peft import LoraConfig
from transformers import LlamaForCausalLM, get_scheduler
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from lit_losses.optim import OptimizerConfig
from tests import trl_runs
from tests.objectives import peer_trainers as peers
from tests.objectives import trl_dpo

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

SFT_RECORDS = [  # completions of different lengths: the micro-batches hold different token counts
    {"prompt": "What is 2 plus 3?", "completion": " It is 5."},
    {"prompt": "Name a colour.", "completion": " Red"},
    {"prompt": "Say hi", "completion": " Hello there, my dear old friend!"},
    {"prompt": "Count to three.", "completion": " One, two, three."},
    {"prompt": "Hi", "completion": " Bye."},
    {"prompt": "What is the capital of France?", "completion": " Paris, of course, the city of light."},
    {"prompt": "2+2?", "completion": " 4"},
    {"prompt": "Spell cat.", "completion": " C, A, T."},
]
SFT_ARGS = {  # SFTConfig / TrainingArguments: 5 steps of 2 micro-batches of 2 records (2.5 epochs)
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 2,
    "max_steps": 5,
    "learning_rate": 3e-3,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 2,
    "weight_decay": 0.05,
    "adam_beta1": 0.85,
    "adam_beta2": 0.98,
    "adam_epsilon": 1e-6,
    "max_grad_norm": 1.0,
    "logging_steps": 1,
}
DPO_RECORDS = trl_dpo.RECORDS + [
    {"prompt": "Is water wet?", "chosen": " Yes.", "rejected": " Water is a kind of fire, I think."},
    {"prompt": "Pick a number.", "chosen": " Seven", "rejected": " No"},
]
DPO_ARGS = {  # DPOConfig: 2 epochs of 3 micro-batches of 2 pairs: windows of 2 and 1 micro-batches
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 2,
    "max_steps": 4,
    "learning_rate": 2e-2,
    "lr_scheduler_type": "linear",
    "warmup_steps": 0.25,  # a fraction: ceil(0.25 × 4) = 1 step
    "max_grad_norm": 0.05,  # below every step's gradient norm: clipping acts at each step
    "logging_steps": 2,
    "beta": 0.1,
    "loss_type": ["sigmoid"],
}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One thread for these tiny models (the threads' overhead is most of a step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, one_thread) -> Path:
    """The tiny float64 Llama both runs start from, as a Hugging Face directory."""
    folder = tmp_path_factory.mktemp("llama")
    tokenizer = peers.tokenizer()
    peers.tiny_llama(len(tokenizer), tokenizer.pad_token_id).save_pretrained(folder)
    return folder


def our_config(folder: Path, model: dict[str, Any], trainer: dict[str, Any]) -> dict[str, Any]:
    """A ``lit-losses fit`` config: ``model`` (``HFCausalLM``'s options) and ``trainer`` as the test writes
    them from TRL's arguments, TRL's micro-batches as the data, logs and the `StepRecord` in ``folder``."""
    logs = str(folder / "logs")
    return {
        "seed_everything": 42,
        "trainer": {
            **trainer,
            "default_root_dir": logs,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "enable_checkpointing": False,
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": logs, "name": "tensorboard"},
            },
            "callbacks": [
                {
                    "class_path": "tests.trl_runs.StepRecord",
                    "init_args": {"initial_weights": str(folder / "initial.pt")},
                }
            ],
        },
        "model": {"class_path": "lit_losses.HFCausalLM", "init_args": model},
        "data": {
            "class_path": "tests.trl_runs.TRLMicroBatches",
            "init_args": {"paths": [str(folder / "batches.pt")]},
        },
    }


def both_runs(folder: Path, trainer: Any, rebuild, model: dict[str, Any], options: dict[str, Any]) -> dict:
    """TRL's run of ``trainer``, then ours on its micro-batches (``rebuild``: our collation of one).

    TRL's loop goes through the records in the same order every epoch (sequential sampler), so our data
    module serves one epoch of its micro-batches and Lightning repeats the epochs: each epoch's windows
    (a trailing shorter one included) are transformers' windows."""
    seen, initial = trl_runs.trl_train(trainer)
    per_epoch = len(trainer.get_train_dataloader())
    for i, (batch, _) in enumerate(seen):
        assert torch.equal(batch["input_ids"], seen[i % per_epoch][0]["input_ids"])
    torch.save([rebuild(batch) for batch, _ in seen[:per_epoch]], folder / "batches.pt")
    torch.save(initial, folder / "initial.pt")
    cli, record, scalars = trl_runs.lit_run(folder, our_config(folder, model, options))
    return {
        "trl": trainer,
        "seen": seen,
        "initial": initial,
        "cli": cli,
        "record": record,
        "scalars": scalars,
    }


@pytest.fixture(scope="module")
def sft(llama, tmp_path_factory) -> dict:
    """SFTTrainer's run on `SFT_RECORDS` with `SFT_ARGS`, and ours with the table's options."""
    folder = tmp_path_factory.mktemp("sft")
    trainer = trl_runs.trl_trainer(
        SFTTrainer,
        SFTConfig,
        records=SFT_RECORDS,
        model=LlamaForCausalLM.from_pretrained(llama, dtype=torch.float64),
        out_dir=folder / "trl",
        **SFT_ARGS,
    )
    model = {
        "model_name_or_path": str(llama),
        "dtype": "float64",
        "optimizer": {
            "lr": 3e-3,  # learning_rate
            "betas": [0.85, 0.98],  # adam_beta1, adam_beta2
            "eps": 1e-6,  # adam_epsilon
            "weight_decay": 0.05,  # weight_decay
            "warmup_steps": 2,  # warmup_steps
            "warmup_start_ratio": 0.0,  # transformers' warmup starts at 0
            "schedule": "cosine",  # lr_scheduler_type
            "min_lr_ratio": 0.0,  # transformers' schedules decay to 0
        },
    }
    options = {
        "max_steps": 5,  # max_steps
        "accumulate_grad_batches": 2,  # gradient_accumulation_steps
        "precision": "32-true",  # bf16=False, fp16=False
        "gradient_clip_val": 1.0,  # max_grad_norm
        "log_every_n_steps": 1,  # logging_steps
    }
    pad = peers.tokenizer().pad_token_id
    return both_runs(folder, trainer, lambda batch: trl_runs.sft_batch(batch, pad_id=pad), model, options)


@pytest.fixture(scope="module")
def dpo(llama, tmp_path_factory) -> dict:
    """DPOTrainer's run with LoRA on `DPO_RECORDS` with `DPO_ARGS` (random adapters, ``B ≠ 0``, so that the
    policy is not its reference at the start), and ours with the table's options."""
    folder = tmp_path_factory.mktemp("dpo")
    trainer = trl_runs.trl_trainer(
        DPOTrainer,
        DPOConfig,
        records=DPO_RECORDS,
        model=LlamaForCausalLM.from_pretrained(llama, dtype=torch.float64),
        out_dir=folder / "trl",
        peft_config=LoraConfig(**LORA),
        **DPO_ARGS,
    )
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    model = {
        "model_name_or_path": str(llama),
        "dtype": "float64",
        "lora": LORA,  # peft_config
        "ref_model": "disabled_adapters",  # TRL's reference with a peft_config
        "dpo": {"loss_type": ["sigmoid"], "beta": 0.1},
        "optimizer": {
            "lr": 2e-2,  # learning_rate
            "betas": [0.9, 0.999],  # transformers' adam_beta1, adam_beta2
            "weight_decay": 0.0,  # transformers' weight_decay
            "warmup_steps": 0.25,  # warmup_steps
            "warmup_start_ratio": 0.0,  # transformers' warmup starts at 0
            "schedule": "linear",  # lr_scheduler_type
            "min_lr_ratio": 0.0,  # transformers' schedules decay to 0
        },
    }
    options = {
        "max_steps": 4,
        "accumulate_grad_batches": 2,
        "precision": "32-true",
        "gradient_clip_val": 0.05,
        "log_every_n_steps": 2,
    }
    return both_runs(folder, trainer, trl_dpo.lit_batch, model, options)


@pytest.fixture(scope="module")
def dpo_epochs(llama, tmp_path_factory) -> dict:
    """DPOTrainer's run of 2 epochs (``num_train_epochs``, no ``max_steps``), full fine-tuning against its
    default reference (a copy of the initial policy), ``constant_with_warmup``, transformers' default
    clipping; ours with ``trainer.max_epochs`` and the default ``ref_model`` (``initial_policy``)."""
    folder = tmp_path_factory.mktemp("dpo_epochs")
    trainer = trl_runs.trl_trainer(
        DPOTrainer,
        DPOConfig,
        records=DPO_RECORDS,
        model=LlamaForCausalLM.from_pretrained(llama, dtype=torch.float64),
        out_dir=folder / "trl",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        learning_rate=1e-3,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=1,
        logging_steps=1,
    )
    model = {
        "model_name_or_path": str(llama),
        "dtype": "float64",
        "dpo": {"loss_type": ["sigmoid"], "beta": 0.1},  # DPOConfig's defaults
        "optimizer": {
            "lr": 1e-3,
            "betas": [0.9, 0.999],
            "weight_decay": 0.0,
            "warmup_steps": 1,
            "warmup_start_ratio": 0.0,
            "schedule": "constant",  # constant_with_warmup
        },
    }
    options = {
        "max_epochs": 2,  # num_train_epochs
        "accumulate_grad_batches": 2,
        "precision": "32-true",
        "gradient_clip_val": 1.0,  # transformers' default max_grad_norm
        "log_every_n_steps": 1,
    }
    return both_runs(folder, trainer, trl_dpo.lit_batch, model, options)


def assert_same_parameters(run: dict, rtol: float = 1e-5) -> None:
    """Every trainable parameter after the run, within ``rtol`` of the largest entry of TRL's, and moved
    by far more than that from where it started."""
    theirs = dict(run["trl"].model.named_parameters())
    ours = {n: p.detach() for n, p in run["cli"].model.model.named_parameters() if p.requires_grad}
    assert sorted(ours) == sorted(run["initial"]) and ours
    for name, value in ours.items():
        reference = theirs[name].detach()
        scale = float(reference.abs().max())
        error = float((value - reference).abs().max())
        moved = float((reference - run["initial"][name]).abs().max())
        assert error <= rtol * scale, f"{name}: |ours − TRL| = {error:.3e}, |TRL| = {scale:.3e}"
        assert moved > 100 * error, f"{name} moved by {moved:.3e} only"


def test_sft_micro_batches_hold_unequal_token_counts(sft):
    """The case that matters: transformers' ``num_items_in_batch`` is each window's count of trained
    tokens (over ``labels[..., 1:]``, the completions'), and the two micro-batches of a window hold
    different counts."""
    seen = sft["seen"]
    for batch, _ in seen:  # completion_only_loss (prompt-completion records): no prompt token is trained
        assert (batch["labels"][:, :2] == peers.IGNORE).all()
    counts = [int((batch["labels"][:, 1:] != peers.IGNORE).sum()) for batch, _ in seen]
    windows = [(counts[i], counts[i + 1]) for i in range(0, len(seen), 2)]
    assert len(seen) == 10 and all(a != b for a, b in windows), windows
    assert [int(seen[i][1]) for i in range(0, 10, 2)] == [a + b for a, b in windows]


def test_sft_run_is_trl_s_step_by_step(sft):
    steps = trl_runs.trl_steps(sft["trl"])
    record, scalars = sft["record"], sft["scalars"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5] and sft["cli"].trainer.global_step == 5
    losses = [s["loss"] for s in steps]
    assert record.losses == pytest.approx(losses, rel=1e-6)
    # Lightning logs the first optimizer step as step 0; transformers as step 1
    assert [scalars["train/loss_total"][k] for k in range(5)] == pytest.approx(losses, rel=1e-6)
    lrs = [3e-3 * f for f in (0.0, 0.5, 1.0, 0.75, 0.25)]  # warmup from 0, then cosine to 0 at step 5
    assert [s["learning_rate"] for s in steps] == pytest.approx(lrs, abs=1e-12)
    assert record.lrs == pytest.approx(lrs, abs=1e-12)
    for tag in ("lr-AdamW/pg1", "lr-AdamW/pg2"):  # matrices (decayed), norms: both groups
        assert [scalars[tag][k] for k in range(5)] == pytest.approx(lrs, rel=1e-6, abs=1e-12)
    norms = [s["grad_norm"] for s in steps]
    assert record.grad_norms == pytest.approx(norms, rel=1e-6)
    assert sum(n > SFT_ARGS["max_grad_norm"] for n in norms) >= 2  # clipping acted
    assert_same_parameters(sft)


def test_dpo_run_with_lora_is_trl_s_step_by_step(dpo):
    steps = trl_runs.trl_steps(dpo["trl"])
    record, scalars = dpo["record"], dpo["scalars"]
    assert [s["step"] for s in steps] == [2, 4] and dpo["cli"].trainer.global_step == 4
    assert all(n > DPO_ARGS["max_grad_norm"] for n in record.grad_norms) and len(record.grad_norms) == 4
    assert [record.grad_norms[1], record.grad_norms[3]] == pytest.approx(
        [s["grad_norm"] for s in steps], rel=1e-6
    )
    lrs = [2e-2 * f for f in (0.0, 1.0, 2 / 3, 1 / 3)]  # warmup of 1 step from 0, linear decay to 0
    assert record.lrs == pytest.approx(lrs, abs=1e-12)
    assert [s["learning_rate"] for s in steps] == pytest.approx([lrs[1], lrs[3]], abs=1e-12)
    # transformers logs the mean loss of the steps since its last log; Lightning the logged step's own
    mean_losses = [(record.losses[0] + record.losses[1]) / 2, (record.losses[2] + record.losses[3]) / 2]
    assert [s["loss"] for s in steps] == pytest.approx(mean_losses, rel=1e-6)
    assert scalars["train/loss_total"] == pytest.approx({1: record.losses[1], 3: record.losses[3]}, rel=1e-6)
    assert_same_parameters(dpo)


def test_dpo_run_by_epochs_is_trl_s_step_by_step(dpo_epochs):
    """2 epochs of 3 micro-batches: 2 optimizer steps each (the second of one micro-batch), 4 in all in
    both loops, and the same schedule over them."""
    steps = trl_runs.trl_steps(dpo_epochs["trl"])
    record = dpo_epochs["record"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and dpo_epochs["cli"].trainer.global_step == 4
    assert record.losses == pytest.approx([s["loss"] for s in steps], rel=1e-6)
    assert record.lrs == pytest.approx([0.0, 1e-3, 1e-3, 1e-3], abs=1e-12)
    assert [s["learning_rate"] for s in steps] == pytest.approx(record.lrs, abs=1e-12)
    assert record.grad_norms == pytest.approx([s["grad_norm"] for s in steps], rel=1e-6)
    assert_same_parameters(dpo_epochs)


SCHEDULES = {  # lr_scheduler_type (with its lr_scheduler_kwargs) → model.init_args.optimizer
    "linear": ({}, {"schedule": "linear", "min_lr_ratio": 0.0}),
    "cosine": ({}, {"schedule": "cosine", "min_lr_ratio": 0.0}),
    "cosine_with_min_lr": ({"min_lr_rate": 0.1}, {"schedule": "cosine", "min_lr_ratio": 0.1}),
    "constant_with_warmup": ({}, {"schedule": "constant"}),
    "constant": ({}, {"schedule": "constant", "warmup_steps": 0}),  # transformers ignores warmup_steps
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(("warmup", "total"), [(0, 7), (3, 10), (0.25, 9)])
def test_each_lr_scheduler_type_is_transformers_schedule(name, warmup, total, tmp_path):
    """The learning rate of each of a run's ``total`` optimizer steps: transformers' own scheduler
    (``TrainingArguments.warmup_steps``: steps, or a fraction of the run rounded up) and the table's
    options. (Past the run's last step transformers' cosine rises again, this package's stays at its end.)"""
    from transformers import TrainingArguments

    kwargs, options = SCHEDULES[name]
    args = TrainingArguments(output_dir=str(tmp_path), warmup_steps=warmup, report_to="none")
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = get_scheduler(
        name,
        optimizer,
        num_warmup_steps=args.get_warmup_steps(total),
        num_training_steps=total,
        scheduler_specific_kwargs=kwargs,
    )
    config = OptimizerConfig(lr=1.0, **{"warmup_steps": warmup, "warmup_start_ratio": 0.0, **options})
    expected = []
    for _ in range(total):
        expected.append(theirs.get_last_lr()[0])
        optimizer.step()
        theirs.step()
    assert [config.lr_factor(step, total_steps=total) for step in range(total)] == pytest.approx(
        expected, abs=1e-12
    )
