"""Custom base losses register like regularizers; ``model.base_loss_args`` is checked when the model is
built, each error naming ``model.base_loss_args.<name>``."""

from __future__ import annotations

import pytest
import torch

from lit_losses import TinyLM, register_base_loss
from lit_losses.aggregation import GlobalStats
from lit_losses.errors import ConfigError
from lit_losses.heads import FusedLMHead
from lit_losses.loss.objective import Objective
from lit_losses.objectives import BASE_LOSSES, BoundBaseLoss
from lit_losses.regularizers import RegularizerSet
from tests.objectives import reference
from tests.objectives.test_builtins import rl_batch


def tapered_reinforce(logprobs, inputs, taper: float = 0.5):
    """A custom loss defined at module level (importable by path): −A · log p, positive A tapered."""
    adv = inputs["advantages"]
    return -torch.where(adv > 0, taper * adv, adv) * logprobs


def test_a_registered_custom_loss_runs_on_both_paths_against_its_formula():
    with BASE_LOSSES.scoped():
        register_base_loss("tapered", reads=("advantages",))(tapered_reinforce)
        batch, weight, bias, hidden = rl_batch(seed=3)
        lp = reference.head_logprobs(hidden, weight, bias, batch["labels"])
        adv = batch["advantages"]
        per_token = -torch.where(adv > 0, 0.25 * adv, adv) * lp * batch["loss_weights"]
        expected = reference.aggregate(
            per_token,
            batch["labels"],
            "token-mean",
            batch["segment_ids"],
            sample_weights=batch["sample_weights"],
        )
        for stage in ("train", "val"):
            objective = Objective(RegularizerSet(), base_loss="tapered", base_loss_args={"taper": 0.25})
            head = FusedLMHead(weight, bias, chunk_size=4)
            out = objective(head, hidden, batch, GlobalStats.local_only(batch), 0, stage)
            torch.testing.assert_close(out.total, expected, rtol=1e-10, atol=1e-12)
            grads = torch.autograd.grad(out.total, (hidden, weight))
            for g, r in zip(
                grads, torch.autograd.grad(expected, (hidden, weight), retain_graph=True), strict=True
            ):
                torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
            assert sorted(out.base_metrics) == ["advantage_logprob", "advantage_mean"]
    assert "tapered" not in BASE_LOSSES


def test_an_import_path_is_a_base_loss_and_a_non_pointwise_one_takes_the_general_path():
    loss = BoundBaseLoss.resolve("tests.objectives.test_registry.tapered_reinforce", {"taper": 1.0})
    assert loss.params == {"taper": 1.0} and loss.entry.pointwise
    with BASE_LOSSES.scoped():
        register_base_loss("seq_level", reads=("advantages",), pointwise=False)(tapered_reinforce)
        objective = Objective(RegularizerSet(), base_loss="seq_level")
        assert objective.path("train", objective.head_outputs_needed()) == "general"


def test_cross_entropy_alone_keeps_the_plain_ce_fast_path_and_others_leave_it():
    assert Objective(RegularizerSet()).path("train", ()) == "plain_ce"
    for name in ("importance_sampling", "ppo", "cispo"):
        objective = Objective(RegularizerSet(), base_loss=name)
        assert objective.head_outputs_needed() == ("logprobs",)
        assert objective.path("train", objective.head_outputs_needed()) == "fused"
    non_pointwise = RegularizerSet([{"name": "z_loss", "pointwise": False}])
    objective = Objective(non_pointwise, base_loss="ppo")
    assert objective.path("train", objective.head_outputs_needed()) == "general"


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        ("ppoo", None, "model.base_loss: unknown base loss 'ppoo'; did you mean 'ppo'?"),
        (
            "ppo",
            {"clip_low": 0.2},
            "model.base_loss_args.clip_low: base loss 'ppo' has no parameter 'clip_low'; "
            "did you mean 'clip_low_threshold'?",
        ),
        ("ppo", {"clip_low_threshold": -0.2}, "model.base_loss_args.clip_low_threshold=-0.2 must be >= 0"),
        (
            "ppo",
            {"clip_high_threshold": 0.5},
            "model.base_loss_args.clip_high_threshold=0.5 must be >= "
            "clip_low_threshold=0.8 (base loss 'ppo')",
        ),
        (
            "ppo",
            {"clip_high_threshold": "1.2"},
            "model.base_loss_args.clip_high_threshold='1.2' must be a finite number or null "
            "(base loss 'ppo')",
        ),
        ("cispo", {"clip_high_threshold": float("inf")}, "clip_high_threshold=inf must be a finite number"),
        ("ppo", {"clip_low_threshold": True}, "clip_low_threshold=True must be a finite number"),
        ("dro", None, "model.base_loss_args.beta is required by base loss 'dro'"),
        ("dro", {"beta": -1}, "model.base_loss_args.beta=-1.0 must be >= 0 (base loss 'dro')"),
        (
            "importance_sampling",
            {"beta": 1},
            "base loss 'importance_sampling' has no parameter 'beta'; its parameters are "
            "['importance_sampling_level']",
        ),
        (
            "cross_entropy",
            {"beta": 1},
            "base loss 'cross_entropy' has no parameter 'beta'; it takes no parameter",
        ),
        (
            "ppo",
            {"epsilon_high": 0.28, "clip_high_threshold": 1.3},
            "model.base_loss_args.epsilon_high=0.28 and clip_high_threshold=1.3 both set the same bound; "
            "give one of them (base loss 'ppo')",
        ),
        ("ppo", {"epsilon_low": 1.5}, "model.base_loss_args.epsilon_low=1.5 must be in [0, 1]"),
        ("ppo", {"delta": 0}, "model.base_loss_args.delta=0.0 must be > 0"),
        (
            "ppo",
            {"importance_sampling_level": "seq"},
            "importance_sampling_level='seq' must be one of ('token', ",
        ),
        ("sapo", {"temperature_neg": 0}, "model.base_loss_args.temperature_neg=0.0 must be > 0"),
        ("vespo", {"lambda_pos": -1}, "model.base_loss_args.lambda_pos=-1.0 must be > 0"),
        ("vespo", {"k_neg": -1}, "model.base_loss_args.k_neg=-1.0 must be >= 0"),
        ("ppo", [0.2], "model.base_loss_args must be a mapping of parameter names to values, got [0.2]"),
    ],
)
def test_bad_base_loss_options_are_one_config_error(name, args, message):
    with pytest.raises(ConfigError) as info:
        TinyLM(vocab_size=16, d_model=8, n_layers=1, n_heads=2, base_loss=name, base_loss_args=args)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_registration_checks_the_signature_and_rejects_a_second_definition():
    with BASE_LOSSES.scoped():
        with pytest.raises(TypeError, match=r"fn\(logprobs, inputs, \*\*named parameters\)"):
            register_base_loss("bad")(lambda logprobs: -logprobs)
        register_base_loss("twice")(tapered_reinforce)
        register_base_loss("twice")(tapered_reinforce)  # the same definition again (a re-run cell): fine
        with pytest.raises(ValueError, match="already registered"):
            register_base_loss("twice")(lambda logprobs, inputs: -logprobs)
