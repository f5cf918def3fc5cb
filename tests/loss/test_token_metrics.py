"""``model.token_metrics``: TRL's per-token metrics logged as exact values of the optimizer step, against
a naive float64 computation from the full logits of every micro-batch of the step (2 accumulated
micro-batches of unequal token counts, a padded one among them): ``train/entropy``,
``train/mean_token_accuracy``, the cumulative ``train/num_tokens`` (SFT), ``train/logits/chosen`` and
``train/logits/rejected`` (DPO; the chosen tokens counted by the loader); the validation means over every
batch; the option's errors. TRL's mean of micro-batch means differs on this split, so the comparison can
fail. (DDP × accumulation of the preference metrics: `test_preference_ddp`; TRL's own trainers:
`tests/objectives/test_trl_token_metrics.py`.)"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lit_losses import GlobalStatsLoader, TinyLM
from lit_losses.aggregation import GlobalStats
from lit_losses.errors import ConfigError
from lit_losses.heads import FusedLMHead
from lit_losses.loss.objective import Objective
from lit_losses.loss.token_metrics import TRAINER_METRICS, input_tokens
from tests.helpers import EmbeddingLM, quiet_trainer, random_batch
from tests.loss.preference_ddp_worker import VOCAB
from tests.loss.preference_ddp_worker import micro_batches as pair_batches
from tests.objectives.test_builtins import rl_batch

SFT = ("train/entropy", "train/mean_token_accuracy", "train/num_tokens")


class EveryStep(L.Callback):
    """The logged ``train/`` values after each optimizer step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step > len(self.steps):
            metrics = trainer.callback_metrics
            self.steps.append({k: float(v) for k, v in metrics.items() if k.startswith("train/")})


def sft_batches() -> list[dict]:
    """4 micro-batches (2 steps of 2) of unequal token counts; the first right-padded (``attention_mask``)."""
    batches = [random_batch(B=2, T=6, seed=1), random_batch(B=3, T=5, seed=2)]
    batches += [random_batch(B=1, T=7, seed=3), random_batch(B=2, T=4, seed=4)]
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    batches[0]["attention_mask"] = mask
    batches[0]["labels"][1, 3:] = -100  # no target at padding (nor at the last real token)
    return batches


def naive_sft(model: EmbeddingLM, batches: list[dict]) -> dict[str, float]:
    """The step's means over every valid token of ``batches`` from the full float64 logits."""
    entropies, hits = [], []
    for batch in batches:
        logits = model.lm_head(model.forward_hidden(batch)).double()
        valid = batch["labels"] != -100
        logp = F.log_softmax(logits, -1)[valid]
        entropies.append(-(logp.exp() * logp).sum(-1))
        hits.append(logits[valid].argmax(-1) == batch["labels"][valid])
    return {
        "train/entropy": float(torch.cat(entropies).mean()),
        "train/mean_token_accuracy": float(torch.cat(hits).double().mean()),
    }


def test_sft_metrics_are_the_steps_means_and_the_token_count_cumulative():
    torch.manual_seed(0)
    model = EmbeddingLM(head_backend="chunked", token_metrics=True).double()
    with torch.no_grad():  # some labels become the argmax: an accuracy strictly between 0 and 1
        model.lm_head.weight.mul_(4)
    batches = sft_batches()
    with torch.no_grad():
        expected = [naive_sft(model, batches[:2])]
    record = EveryStep()
    quiet_trainer(max_steps=2, accumulate_grad_batches=2, precision="64-true", callbacks=[record]).fit(
        model, GlobalStatsLoader(batches, batch_size=None, shuffle=False)
    )
    first, second = record.steps
    assert set(SFT) <= set(first)
    for name, value in expected[0].items():
        assert first[name] == pytest.approx(value, rel=1e-6), name  # logged in float32
    assert 0 < first["train/mean_token_accuracy"] < 1
    tokens = [input_tokens(b) for b in batches]
    assert tokens[0] == 10  # the padding is not counted
    assert first["train/num_tokens"] == sum(tokens[:2])
    assert second["train/num_tokens"] == sum(tokens)  # cumulative, TRL's meaning
    with torch.no_grad():  # TRL's mean of the micro-batches' means is another value on this split
        means = [naive_sft(model, [b]) for b in batches[:2]]
    trl_entropy = sum(m["train/entropy"] for m in means) / 2
    assert abs(trl_entropy - expected[0]["train/entropy"]) > 1e-4


def test_num_tokens_goes_on_from_the_checkpoint_after_a_resume(tmp_path):
    """A run resumed mid-epoch from its step-1 checkpoint logs the uninterrupted run's cumulative
    ``train/num_tokens`` at step 2 (the count is saved in the checkpoint; TRL's restarts from 0)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    batches = sft_batches()

    def fit(ckpt_path=None):
        torch.manual_seed(0)
        model = EmbeddingLM(head_backend="chunked", token_metrics=True)
        record = EveryStep()
        every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
        trainer = quiet_trainer(max_steps=2, accumulate_grad_batches=2, callbacks=[record, every])
        trainer.fit(model, GlobalStatsLoader(batches, batch_size=None, shuffle=False), ckpt_path=ckpt_path)
        return record.steps

    whole = fit()
    resumed = fit(ckpt_path=tmp_path / "step=1.ckpt")
    assert whole[1]["train/num_tokens"] == sum(input_tokens(b) for b in batches)
    assert resumed[-1]["train/num_tokens"] == whole[1]["train/num_tokens"]


def test_validation_means_are_over_every_token_of_the_epoch():
    torch.manual_seed(0)
    model = EmbeddingLM(head_backend="chunked", token_metrics=True).double()
    batches = sft_batches()[:3]
    with torch.no_grad():
        expected = naive_sft(model, batches)
    trainer = quiet_trainer(precision="64-true", limit_val_batches=None)
    (logged,) = trainer.validate(model, torch.utils.data.DataLoader(batches, batch_size=None), verbose=False)
    assert "val/num_tokens" not in logged  # TRL logs the training count only
    for name in ("entropy", "mean_token_accuracy"):
        assert logged[f"val/{name}"] == pytest.approx(expected[f"train/{name}"], rel=1e-6), name


def test_dpo_metrics_are_the_steps_means_over_the_chosen_and_rejected_tokens():
    L.seed_everything(0, verbose=False)
    options = {"dpo": {"beta": 0.2}, "token_metrics": True, "optimizer": {"warmup_steps": 0}}
    model = TinyLM(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, head_backend="chunked", **options)
    model = model.double()
    batches = pair_batches()[:2]  # 2 and 1 pairs, of different completion lengths
    per_token: dict[str, list] = {"entropy": [], "chosen": [], "rejected": [], "hit": []}
    with torch.no_grad():
        for batch in batches:
            logits = F.linear(model.forward_hidden(batch), model.output_projection()[0]).double()
            valid = batch["labels"] != -100
            chosen = batch["chosen_mask"].bool()
            logp = F.log_softmax(logits, -1)
            per_token["entropy"].append(-(logp.exp() * logp).sum(-1)[valid])
            per_token["chosen"].append(logits.mean(-1)[chosen])
            per_token["rejected"].append(logits.mean(-1)[valid & ~chosen])
            per_token["hit"].append((logits.argmax(-1) == batch["labels"])[chosen])
    record = EveryStep()
    quiet_trainer(max_steps=1, accumulate_grad_batches=2, precision="64-true", callbacks=[record]).fit(
        model, GlobalStatsLoader(batches, batch_size=None, shuffle=False)
    )
    (logged,) = record.steps
    expected = {
        "train/entropy": torch.cat(per_token["entropy"]).mean(),
        "train/logits/chosen": torch.cat(per_token["chosen"]).mean(),
        "train/logits/rejected": torch.cat(per_token["rejected"]).mean(),
        "train/mean_token_accuracy": torch.cat(per_token["hit"]).double().mean(),
        "train/num_tokens": sum(int(b["attention_mask"].sum()) for b in batches),
    }
    assert {f"train/{n}" for n in TRAINER_METRICS["dpo"]} <= set(logged)
    for name, value in expected.items():
        assert logged[name] == pytest.approx(float(value), rel=1e-6), name  # logged in float32


def test_the_option_must_be_a_flag_and_is_off_by_default():
    with pytest.raises(ConfigError, match=r"model.token_metrics must be true or false, got 'yes'"):
        EmbeddingLM(token_metrics="yes")
    out = EmbeddingLM().compute_loss(random_batch())
    assert not out.metrics
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set(EmbeddingLM(token_metrics=True).compute_loss(random_batch()).metrics) == set(
            TRAINER_METRICS["sft"]
        )


def test_grpo_logs_grpo_trainer_s_set_the_entropy_over_the_completion_tokens():
    batch, weight, bias, hidden = rl_batch(weighted=False)
    objective = Objective.from_options(grpo={"loss_type": "grpo"}, token_metrics=True)
    assert {"entropy", "num_tokens"} <= set(objective.metric_names())
    assert "mean_token_accuracy" not in objective.metric_names()  # GRPOTrainer does not log it
    head = FusedLMHead(weight, bias)
    out = objective(head, hidden, batch=batch, stats=GlobalStats.local_only(batch), step=0, stage="train")
    valid = batch["labels"] != -100
    logp = F.log_softmax((hidden @ weight.T + bias).double(), -1)[valid]
    expected = -(logp.exp() * logp).sum(-1).mean()
    assert float(out.metrics["entropy"]) == pytest.approx(float(expected), rel=1e-10)
    assert int(out.metrics["num_tokens"]) == int((batch["segment_ids"] != 0).sum())
