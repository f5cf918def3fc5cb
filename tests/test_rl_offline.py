"""``configs/rl_offline.yaml`` through the CLI (in-process, fewer steps): it trains PPO + kl_reference +
entropy on the package's rollouts, logs the RL telemetry in TensorBoard, starts at the sampling policy
and raises the mean advantage-weighted log-probability of the data, computed here from the JSONL file
and the trained model by a naive forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_losses.cli.app import cli_main

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "rl_offline.yaml"
DATA = REPO / "data" / "rollouts.jsonl"
STEPS = 20
RL_METRICS = ("clip_fraction", "ratio_mean", "approx_kl", "advantage_mean", "advantage_logprob")
RL_TAGS = [f"train/base_loss/{name}" for name in RL_METRICS]


def advantage_weighted_logprob(records: list[dict], logprobs_of) -> float:
    """mean over every completion token of A · log p(token | prefix); ``logprobs_of(record)`` gives the
    log-probabilities of tokens[1:], one per position."""
    total, count = 0.0, 0
    for record in records:
        logprobs = logprobs_of(record)
        for i, lp in enumerate(record["logprobs"][1:]):
            if lp is not None:
                total += record["advantage"] * float(logprobs[i])
                count += 1
    return total / count


@torch.no_grad()
def model_logprobs(model, record: dict) -> torch.Tensor:
    ids = torch.tensor([record["tokens"]])
    hidden = model.forward_hidden({"input_ids": ids})[0].double()
    weight = model.output_projection()[0].double()
    return torch.log_softmax(hidden @ weight.T, dim=-1)[:-1].gather(1, ids[0, 1:, None])[:, 0]


def fit_config(config: Path, root: Path):
    """``lit-losses fit --config <config>`` for `STEPS` steps into ``root``: the CLI and its TensorBoard
    events."""
    args = [
        "fit",
        "--config",
        str(config),
        f"--trainer.max_steps={STEPS}",
        f"--data.init_args.paths=[{DATA}]",
        f"--trainer.default_root_dir={root}",
        f"--trainer.logger.init_args.save_dir={root}",
        "--trainer.enable_progress_bar=false",
    ]
    cli = cli_main(args)
    assert cli.trainer.global_step == STEPS
    (events,) = {p.parent for p in root.rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events))
    acc.Reload()
    return cli, acc


def advantage_weighted_logprob_gain(model) -> tuple[float, float]:
    """The mean advantage-weighted log-probability of the data's completion tokens at the sampling
    policy and under ``model``."""
    records = [json.loads(line) for line in DATA.read_text().splitlines()]
    initial = advantage_weighted_logprob(records, lambda r: [lp or 0.0 for lp in r["logprobs"][1:]])
    return initial, advantage_weighted_logprob(records, lambda r: model_logprobs(model, r))


@pytest.mark.timeout(300)
def test_rl_offline_config_trains_ppo_logs_rl_telemetry_and_raises_the_advantage_weighted_logprob(tmp_path):
    cli, acc = fit_config(CONFIG, tmp_path / "run")
    model = cli.model.eval()
    assert model.hparams.base_loss == "ppo"
    assert "entropy" in model.regularizer_set and "kl_reference" in model.regularizer_set
    tags = acc.Tags()["scalars"]
    for tag in [*RL_TAGS, "regularizers/kl_reference/value", "regularizers/entropy/weight", "val/loss"]:
        assert tag in tags, tag
    for tag in RL_TAGS:
        values = [e.value for e in acc.Scalars(tag)]
        assert len(values) == STEPS and all(v == v for v in values), tag
    # the first step's policy is the sampler: every ratio is 1, nothing is clipped, KL is 0
    assert acc.Scalars("train/base_loss/ratio_mean")[0].value == pytest.approx(1.0, abs=1e-5)
    assert acc.Scalars("train/base_loss/clip_fraction")[0].value == 0.0
    assert acc.Scalars("train/base_loss/approx_kl")[0].value == pytest.approx(0.0, abs=1e-6)
    assert acc.Scalars("regularizers/kl_reference/value")[-1].value > 0

    initial, final = advantage_weighted_logprob_gain(model)
    assert final > initial + 0.05, (initial, final)


GRPO_CONFIG = REPO / "configs" / "grpo.yaml"
TRL_METRICS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "ratio_mean")


@pytest.mark.timeout(300)
def test_grpo_config_trains_trl_s_dapo_loss_and_logs_trl_s_telemetry(tmp_path, capsys):
    cli, acc = fit_config(GRPO_CONFIG, tmp_path / "run")
    # what ran, after the preset: in run_end.json, the saved hyper-parameters and the end summary
    folder = Path(cli.trainer.log_dir)
    objective = json.loads((folder / "run_end.json").read_text())["objective"]
    assert (objective["base_loss"], objective["loss_agg"]) == ("ppo", "token-mean")
    assert objective["base_loss_args"]["epsilon_high"] == 0.28
    assert [(t["name"], t["weight"]) for t in objective["regularizers"]] == [("kl_reference", 0.04)]
    assert yaml.safe_load((folder / "hparams.yaml").read_text())["objective"] == objective
    assert "objective:    ppo (" in capsys.readouterr().out
    model = cli.model.eval()
    assert model.hparams.grpo["loss_type"] == "dapo"
    assert model.objective.base_loss.name == "ppo" and model.loss_agg == "token-mean"
    assert model.objective.base_loss.params["epsilon_high"] == 0.28
    kl = model.regularizer_set.terms["kl_reference"]
    assert kl.spec.weight == 0.04 and kl.spec.args["bias_correction"] is True
    for tag in [*(f"train/base_loss/{name}" for name in TRL_METRICS), "regularizers/kl_reference/value"]:
        values = [e.value for e in acc.Scalars(tag)]
        assert len(values) == STEPS and all(v == v for v in values), tag
    # the first step's policy is the sampler and the reference: ratio 1, nothing clipped, KL 0
    assert acc.Scalars("train/base_loss/ratio_mean")[0].value == pytest.approx(1.0, abs=1e-5)
    assert acc.Scalars("train/base_loss/clip_ratio_region")[0].value == 0.0
    assert acc.Scalars("regularizers/kl_reference/value")[0].value == pytest.approx(0.0, abs=1e-6)
    assert max(e.value for e in acc.Scalars("train/base_loss/clip_ratio_region")) > 0  # later steps clip
    initial, final = advantage_weighted_logprob_gain(model)
    assert final > initial + 0.05, (initial, final)
