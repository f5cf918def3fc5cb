"""The RL batch keys: a missing key names itself, the base loss and the batch's keys; a shape mismatch
names both shapes; NaN/Inf at a labelled position is refused; values at ignored positions never matter."""

from __future__ import annotations

import pytest
import torch

from lit_losses import TinyLM
from lit_losses.aggregation import GlobalStats
from lit_losses.heads import FusedLMHead
from lit_losses.loss.objective import Objective
from lit_losses.regularizers import RegularizerSet
from tests.objectives.test_builtins import rl_batch


def model(**kwargs) -> TinyLM:
    return TinyLM(vocab_size=17, d_model=8, n_layers=1, n_heads=2, **kwargs)


def lm_batch(**extra) -> dict:
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 17, (2, 5), generator=g)
    labels[0, :2] = -100
    batch = {"input_ids": torch.randint(0, 17, (2, 5), generator=g), "labels": labels}
    batch.update(extra)
    return batch


@pytest.mark.parametrize("stage", ["train", "val"])
def test_a_missing_key_names_the_key_the_base_loss_and_the_batch_keys(stage):
    batch = lm_batch(sampling_logprobs=torch.zeros(2, 5))
    with pytest.raises(KeyError) as info:
        model(base_loss="ppo").compute_loss(batch, stage)
    message = info.value.args[0]
    assert message == (
        "base loss 'ppo' reads batch key 'advantages', which is missing; the batch has keys "
        "['input_ids', 'labels', 'sampling_logprobs']"
    )


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "advantages",
            torch.zeros(2, 4),
            "batch['advantages'] has shape (2, 4) but batch['labels'] has shape (2, 5)",
        ),
        ("sampling_logprobs", torch.zeros(10), "batch['sampling_logprobs'] has shape (10,)"),
        (
            "advantages",
            [[1.0] * 5] * 2,
            "batch['advantages'] read by base loss 'ppo' must be a real-valued [B, T] tensor, got list",
        ),
        ("advantages", torch.ones(2, 5, dtype=torch.bool), "got dtype torch.bool"),
        ("loss_weights", torch.ones(2, 3), "batch['loss_weights'] has shape (2, 3)"),
        ("sample_weights", torch.ones(5, 2), "batch['sample_weights'] has shape (5, 2)"),
    ],
)
def test_bad_values_name_the_key_and_both_shapes(key, value, message):
    batch = lm_batch(sampling_logprobs=torch.full((2, 5), -1.0), advantages=torch.ones(2, 5))
    batch[key] = value
    with pytest.raises(ValueError) as info:
        model(base_loss="ppo").compute_loss(batch)
    assert message in str(info.value)


def test_nan_at_a_labelled_position_is_refused_but_garbage_at_ignored_positions_is_not():
    advantages = torch.ones(2, 5)
    advantages[0, 0] = float("nan")  # labels[0, 0] is -100: never read
    batch = lm_batch(sampling_logprobs=torch.full((2, 5), -1.0), advantages=advantages)
    batch["sampling_logprobs"][0, 1] = -float("inf")  # ignored position as well
    out = model(base_loss="importance_sampling").compute_loss(batch)
    assert torch.isfinite(out.total)
    batch["advantages"][1, 3] = float("inf")
    with pytest.raises(
        ValueError, match=r"batch\['advantages'\] holds 1 non-finite value\(s\) \(NaN/Inf\) at positions"
    ):
        model(base_loss="importance_sampling").compute_loss(batch)


def test_cross_entropy_reads_no_rl_key_and_ignores_none_it_has():
    """``loss_weights`` and ``sample_weights`` weigh cross-entropy too (Tinker's ``weights``); absent, the
    result is bit-identical to the plain loss."""
    torch.manual_seed(0)
    lm = model().double()
    plain = lm.compute_loss(lm_batch()).total
    ones = lm_batch(loss_weights=torch.ones(2, 5), sample_weights=torch.ones(2, 5))
    torch.testing.assert_close(lm.compute_loss(ones).total, plain, rtol=1e-14, atol=0)
    halves = lm_batch(loss_weights=torch.full((2, 5), 0.5))
    torch.testing.assert_close(lm.compute_loss(halves).total, 0.5 * plain, rtol=1e-14, atol=0)


def test_loss_agg_norm_is_required_by_its_mode_and_checked():
    from lit_losses.errors import ConfigError

    expected = (
        r"model.loss_agg_norm is required by aggregation mode 'seq-mean-token-sum-norm' .* got None; used by"
    )
    with pytest.raises(ConfigError, match=expected + " model.loss_agg$"):
        model(loss_agg="seq-mean-token-sum-norm")
    with pytest.raises(ConfigError, match="used by regularizer 'z_loss'"):
        model(regularizers=[{"name": "z_loss", "agg": "seq-mean-token-sum-norm"}])
    for bad in (0, -3.0, float("nan"), "512", True):
        with pytest.raises(ConfigError, match=r"model\.loss_agg_norm must be a finite number > 0"):
            model(loss_agg="seq-mean-token-sum-norm", loss_agg_norm=bad)
    assert model(loss_agg="seq-mean-token-sum-norm", loss_agg_norm=512).objective.loss_agg_norm == 512.0


def test_rl_keys_in_the_general_path_are_those_of_the_fused_path():
    """Fused and general paths read the same keys at the same (row-major valid) positions."""
    batch, weight, bias, hidden = rl_batch(seed=11)
    totals = []
    for stage in ("train", "val"):
        objective = Objective(RegularizerSet(), "seq-mean-token-mean", base_loss="importance_sampling")
        out = objective(
            FusedLMHead(weight, bias, chunk_size=5), hidden, batch, GlobalStats.local_only(batch), 0, stage
        )
        totals.append(out.total)
        assert out.base_metrics.keys() == {"ratio_mean", "approx_kl", "advantage_mean", "advantage_logprob"}
    torch.testing.assert_close(totals[0], totals[1], rtol=1e-12, atol=1e-14)
