"""``model.token_metrics`` against TRL 1.16's own trainers on one micro-batch: ``SFTTrainer``'s
``entropy``, ``mean_token_accuracy`` and ``num_tokens`` (training and evaluation), ``DPOTrainer``'s the
same plus ``logits/chosen`` and ``logits/rejected`` (its accuracy over the chosen completions), and
``KTOTrainer``'s ``entropy``, ``num_tokens`` and ``logits/*`` (over the desirable and undesirable
completions), read from ``trainer._metrics`` after ``compute_loss``; our side is ``HFCausalLM`` with the
same weights on the same token ids. The policies are trained a few steps on the records first, so that
the accuracy lies strictly between 0 and 1. TRL's fused head accumulates in float32 (the models are
float64), hence the float32 tolerance.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
from trl import KTOConfig, KTOTrainer, SFTConfig, SFTTrainer

from lit_losses import HFCausalLM
from tests.objectives import peer_trainers as peers
from tests.objectives import trl_dpo

pytestmark = pytest.mark.filterwarnings("ignore:`(is_)?gradient_checkpointing` is deprecated:FutureWarning")

SFT_RECORDS = [
    {"prompt": "What is 2 plus 3?", "completion": " It is 5."},
    {"prompt": "Name a colour.", "completion": " Red, or perhaps blue if you ask me twice."},
    {"prompt": "Say hi", "completion": " Hello there, friend!"},
]
REL = 1e-5
"""TRL's float32 accumulation of the softmax statistics."""


def sharpened(model: torch.nn.Module, rows: torch.Tensor, mask: torch.Tensor, steps: int = 4) -> None:
    """A few Adam steps of next-token training on ``rows`` (the policy then predicts some of them)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    labels = rows.masked_fill(mask == 0, -100)
    for _ in range(steps):
        optimizer.zero_grad()
        model(input_ids=rows, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
    model.zero_grad(set_to_none=True)


def assert_metrics(ours: dict[str, float], theirs: dict[str, float], names: tuple[str, ...]) -> None:
    for name in names:
        assert ours[name] == pytest.approx(theirs[name], rel=REL, abs=1e-6), (name, ours[name], theirs[name])


@pytest.fixture(scope="module")
def sft():
    """SFTTrainer (prompt-completion records: the completion tokens are trained) on a sharpened policy,
    its first batch, and our module on a copy of the same weights."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tok = peers.tokenizer()
    model = peers.tiny_llama(len(tok), tok.pad_token_id)
    trainer = peers.trl_trainer(
        SFTTrainer, SFTConfig, records=SFT_RECORDS, model=model, out_dir=tempfile.mkdtemp(prefix="trl_sft_")
    )
    batch = peers.first_batch(trainer)
    sharpened(trainer.model, batch["input_ids"], batch["attention_mask"])
    ours = HFCausalLM(model=copy.deepcopy(trainer.model), label_format="input_aligned", token_metrics=True)
    yield trainer, batch, ours
    torch.set_num_threads(threads)


def our_batch(batch: dict) -> dict:
    """TRL's SFT batch as it is (labels aligned with ``input_ids``, -100 on the prompt and padding)."""
    return {key: batch[key] for key in ("input_ids", "attention_mask", "labels")}


def test_sft_metrics_are_sft_trainer_s(sft):
    trainer, batch, ours = sft
    loss, _, theirs = peers.trl_loss(trainer, batch)
    our_loss, _, metrics = peers.our_loss(ours, our_batch(batch))
    torch.testing.assert_close(our_loss, loss.double(), rtol=REL, atol=1e-7)
    assert 0.1 < theirs["mean_token_accuracy"] < 0.9, theirs  # the comparison can fail
    assert theirs["num_tokens"] == int(batch["attention_mask"].sum()) < batch["input_ids"].numel()
    assert set(theirs) == {"entropy", "mean_token_accuracy", "num_tokens"} == set(metrics)
    assert_metrics(metrics, theirs, tuple(theirs))


def test_sft_evaluation_metrics_are_sft_trainer_s(sft):
    trainer, batch, ours = sft
    trainer.model.eval()
    trainer._metrics["eval"].clear()
    with torch.no_grad():
        trainer.compute_loss(trainer.model, dict(batch))
    theirs = {name: float(values[-1]) for name, values in trainer._metrics["eval"].items()}
    trainer.model.train()
    ours.eval()
    with torch.no_grad():
        out = ours.compute_loss(our_batch(batch), "val")
    metrics = {name: float(value) for name, value in out.metrics.items()}
    assert set(metrics) == {"entropy", "mean_token_accuracy"}  # TRL's eval num_tokens is the training count
    assert_metrics(metrics, theirs, tuple(metrics))
    assert out.metric_weights["entropy"] == int((batch["labels"][:, 1:] != -100).sum())  # its val weight


@pytest.fixture(scope="module")
def dpo_weights():
    """`trl_dpo.Weights` whose policy is sharpened on the chosen sequences of TRL's batch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    weights = trl_dpo.Weights()
    trainer = trl_dpo.trl_trainer(weights, loss_type=["sigmoid"])
    batch = trl_dpo.trl_batch(trainer)
    pairs = batch["input_ids"].shape[0] // 2
    policy = weights.model("policy")
    sharpened(policy, batch["input_ids"][:pairs], batch["attention_mask"][:pairs])
    weights.policy = policy.state_dict()
    yield weights
    torch.set_num_threads(threads)


def test_dpo_metrics_are_dpo_trainer_s(dpo_weights):
    fields = {"loss_type": ["sigmoid"], "beta": 0.3}
    trainer = trl_dpo.trl_trainer(dpo_weights, **fields)
    batch = trl_dpo.trl_batch(trainer)
    loss, _, theirs = trl_dpo.trl_step(trainer, batch)
    ours = HFCausalLM(
        model=dpo_weights.model("policy"), dpo=fields, ref_model=dpo_weights.reference_dir, token_metrics=True
    )
    our_loss, _, metrics = trl_dpo.lit_step(ours, trl_dpo.lit_batch(batch))
    torch.testing.assert_close(our_loss, loss.double(), rtol=REL, atol=1e-7)
    names = ("entropy", "mean_token_accuracy", "num_tokens", "logits/chosen", "logits/rejected")
    assert set(names) <= set(theirs) and set(names) <= set(metrics)
    assert 0.1 < theirs["mean_token_accuracy"] < 0.9, theirs
    assert abs(theirs["logits/chosen"] - theirs["logits/rejected"]) > 1e-3  # they are told apart
    assert_metrics(metrics, theirs, names)


def test_kto_metrics_are_kto_trainer_s():
    tok = peers.tokenizer()
    reference = peers.tiny_llama(len(tok), tok.pad_token_id)
    policy = peers.perturbed(reference, seed=3, scale=0.05)
    with tempfile.TemporaryDirectory(prefix="trl_kto_ref_") as ref_dir:
        reference.save_pretrained(ref_dir)
        fields = {"loss_type": "kto", "beta": 0.3}
        trainer = peers.trl_trainer(
            KTOTrainer,
            KTOConfig,
            records=peers.UNPAIRED,
            model=copy.deepcopy(policy),
            ref_model=copy.deepcopy(reference),
            out_dir=tempfile.mkdtemp(prefix="trl_kto_"),
            **fields,
        )
        batch = peers.first_batch(trainer)
        loss, _, theirs = peers.trl_loss(trainer, batch)
        module = peers.our_module(policy, kto=fields, ref_model=ref_dir, token_metrics=True)
        our_loss, _, metrics = peers.our_loss(module, peers.unpaired_batch(batch))
    torch.testing.assert_close(our_loss, loss.double(), rtol=REL, atol=1e-7)
    names = ("entropy", "num_tokens", "logits/chosen", "logits/rejected")
    assert set(names) <= set(metrics) and "mean_token_accuracy" not in metrics  # KTOTrainer logs none
    assert_metrics(metrics, theirs, names)
