"""The new model options: saved as plain hyper-parameters, changeable on resume (with a warning), and
`RegularizedLM` builds its objective from them in one call."""

from __future__ import annotations

from lit_losses import TinyLM
from lit_losses.checkpoint.resume import option_changes


def test_base_loss_options_are_run_options_a_resume_may_change():
    saved = {"d_model": 16, "base_loss": "cross_entropy", "base_loss_args": None, "loss_agg_norm": None}
    given = {
        "d_model": 16,
        "base_loss": "ppo",
        "base_loss_args": {"clip_high_threshold": 1.28},
        "loss_agg_norm": 64,
    }
    changes = {str(c): c.changeable for c in option_changes(saved, given)}
    assert changes == {
        "model.init_args.base_loss: 'cross_entropy' in the checkpoint, 'ppo' now": True,
        "model.init_args.base_loss_args: None in the checkpoint, {'clip_high_threshold': 1.28} now": True,
        "model.init_args.loss_agg_norm: None in the checkpoint, 64 now": True,
    }


def test_the_model_keeps_its_options_and_builds_the_objective_from_them():
    model = TinyLM(
        vocab_size=16,
        d_model=8,
        n_layers=1,
        n_heads=2,
        base_loss="cispo",
        base_loss_args={"clip_high_threshold": 2},
        loss_agg="seq-mean-token-sum-norm",
        loss_agg_norm=32,
        regularizers=[{"name": "kl_reference", "weight": 0.1}],
    )
    assert model.hparams["base_loss"] == "cispo"
    assert model.hparams["base_loss_args"] == {"clip_high_threshold": 2}
    assert model.objective.base_loss.params == {
        "clip_low_threshold": 0.0,
        "clip_high_threshold": 2.0,
        "importance_sampling_level": "token",
    }
    assert model.objective.loss_agg_norm == 32.0 == model.regularizer_set.agg_norm
    assert model.regularizer_set is model.objective.regularizers
