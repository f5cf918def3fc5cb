"""`BaseLossBatch`: output checks, and the RL telemetry as exact global values (sum states) over the
micro-batches of a step, in a real Lightning fit and in ``model.telemetry``."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lit_losses import GlobalStatsLoader, TinyLM
from lit_losses.aggregation import GlobalStats, count_masks, sum_counts
from lit_losses.objectives import BASE_LOSSES, BoundBaseLoss, register_base_loss
from tests.helpers import quiet_trainer

PPO = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
DIMS = dict(vocab_size=32, d_model=16, n_layers=1, n_heads=2, head_backend="chunked")


def micro_batches(n: int = 4, seed: int = 0) -> list[dict]:
    """``n`` micro-batches of different sizes with the RL keys (sampling log-probabilities near the
    model's, so that some ratios are clipped and some are not)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        rows, width = 1 + i % 3, 6 + 2 * i
        ids = torch.randint(0, 32, (rows, width), generator=g)
        labels = torch.roll(ids, -1, 1)
        labels[:, : 1 + i % 2] = -100
        labels[:, -1] = -100
        valid = labels != -100
        out.append(
            {
                "input_ids": ids,
                "labels": labels,
                "sampling_logprobs": torch.where(
                    valid, -3.5 + 0.3 * torch.randn(rows, width, generator=g), 0.0
                ),
                "advantages": torch.where(valid, torch.randn(rows, width, generator=g), 0.0),
            }
        )
    return out


def hand_metrics(model: TinyLM, batches: list[dict]) -> dict[str, float]:
    """The step's telemetry from the current log-probabilities, over every valid token of ``batches``."""
    lp, q, adv = [], [], []
    with torch.no_grad():
        for b in batches:
            valid = b["labels"] != -100
            lp.append(model.predict_step(b, 0)[valid].double())
            q.append(b["sampling_logprobs"][valid].double())
            adv.append(b["advantages"][valid].double())
    lp, q, adv = torch.cat(lp), torch.cat(q), torch.cat(adv)
    r = torch.exp(lp - q)
    lo, hi = PPO["clip_low_threshold"], PPO["clip_high_threshold"]
    clipped = torch.where(adv >= 0, r > hi, r < lo)
    low = [bool(a < 0 and x < lo) for a, x in zip(adv, r)]  # TRL's clip_ratio/low_mean
    high = [bool(a > 0 and x > hi) for a, x in zip(adv, r)]  # TRL's clip_ratio/high_mean
    return {
        "clip_fraction": float(clipped.double().mean()),
        "clip_ratio_low": sum(low) / len(low),
        "clip_ratio_high": sum(high) / len(high),
        "clip_ratio_region": sum(a or b for a, b in zip(low, high)) / len(low),
        "ratio_mean": float(r.mean()),
        "approx_kl": float((r - 1 - torch.log(r)).mean()),
        "advantage_mean": float(adv.mean()),
        "advantage_logprob": float((adv * lp).mean()),
    }


def test_micro_batch_metrics_sum_to_the_step_mean():
    torch.manual_seed(0)
    model = TinyLM(**DIMS, base_loss="ppo", base_loss_args=PPO).double()
    batches = micro_batches()
    expected = hand_metrics(model, batches)
    assert 0.05 < expected["clip_fraction"] < 0.95  # both clipped and unclipped tokens
    totals = sum_counts(count_masks(b) for b in batches)
    summed: dict[str, float] = {}
    for i, b in enumerate(batches):
        stats = GlobalStats(totals, float(len(batches)), count_masks(b), i, len(batches))
        for key, value in model.compute_loss({**b, "global_stats": stats}).base_metrics.items():
            summed[key] = summed.get(key, 0.0) + float(value)
    assert summed == pytest.approx(expected, rel=1e-10, abs=1e-12)


class Capture(L.Callback):
    def __init__(self) -> None:
        self.logged: dict[str, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 1 and not self.logged:  # after the first optimizer step
            self.logged = {k: float(v) for k, v in trainer.callback_metrics.items()}


@pytest.mark.slow
def test_a_fit_logs_the_rl_telemetry_of_each_step_exactly():
    torch.manual_seed(0)
    model = TinyLM(**DIMS, base_loss="ppo", base_loss_args=PPO)
    batches = micro_batches()
    expected = hand_metrics(model, batches[:2])  # the first optimizer step: 2 accumulated micro-batches
    capture = Capture()
    trainer = quiet_trainer(max_steps=1, accumulate_grad_batches=2, callbacks=[capture])
    trainer.fit(model, train_dataloaders=GlobalStatsLoader(batches, batch_size=None))
    for key, value in expected.items():
        assert capture.logged[f"train/base_loss/{key}"] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert model.telemetry["base_loss"]["custom"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert set(model.telemetry["base_loss"]["custom"]) == set(expected)


def test_cross_entropy_logs_no_rl_telemetry():
    torch.manual_seed(0)
    model = TinyLM(**DIMS)
    out = model.compute_loss({k: micro_batches()[0][k] for k in ("input_ids", "labels")})
    assert out.base_metrics == {}
    assert not [k for k in out.logged_values("train") if k.startswith("train/base_loss/")]


def broken(kind: str):
    def fn(logprobs, inputs):
        if kind == "shape":
            return -logprobs[:-1]
        if kind == "detached":
            return -logprobs.detach()
        if kind == "nan":
            return logprobs / 0.0
        return -logprobs, {"surprise": logprobs}

    return fn


BAD_OUTPUTS = {
    "shape": r"base loss 'broken' returned \(\d+,\) for tokens of shape \(\d+,\); a base loss returns one",
    "detached": "returned a value without gradient with respect to the log-probabilities",
    "nan": r"returned a non-finite value \(NaN/Inf\)",
    "metric": r"returned metrics \['surprise'\] it did not declare",
}
CASES = [
    (kind, stage)
    for kind in BAD_OUTPUTS
    for stage in ("train", "val")
    if (kind, stage) != ("detached", "val")
]


@pytest.mark.parametrize(("kind", "stage"), CASES)  # no gradient is expected in validation
def test_a_bad_base_loss_output_is_an_error_naming_it(kind, stage):
    with BASE_LOSSES.scoped():
        register_base_loss("broken")(broken(kind))
        model = TinyLM(**DIMS, base_loss="broken")
        with pytest.raises(ValueError, match=BAD_OUTPUTS[kind]):
            model.compute_loss({k: micro_batches()[1][k] for k in ("input_ids", "labels")}, stage)


def test_bound_loss_names_its_metrics_and_parameters():
    loss = BoundBaseLoss.resolve("cispo", {"clip_high_threshold": 2})
    assert loss.params == {
        "clip_high_threshold": 2.0,
        "clip_low_threshold": 0.0,
        "importance_sampling_level": "token",
    }
    assert loss.metric_names == (
        "clip_fraction",
        "clip_ratio_high",
        "ratio_mean",
        "approx_kl",
        "advantage_mean",
        "advantage_logprob",
    )
    assert BoundBaseLoss.resolve("dro", {"beta": 0.1}).metric_names[0] == "ratio_mean"
    assert BoundBaseLoss.resolve("cross_entropy", None).plain_ce
