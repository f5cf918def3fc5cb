"""The offline-RL tutorial's "Objectives" YAML builds the objective it describes."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from lit_losses import TinyLM

TUTORIAL = Path(__file__).resolve().parents[2] / "docs" / "tutorials" / "offline-rl.md"


def test_readme_rl_yaml_builds_a_ppo_objective_with_its_terms():
    text = TUTORIAL.read_text()
    section = text[text.index("## Objectives") : text.index("## Offline RL data")]
    (block,) = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    options = yaml.safe_load(block)["model"]["init_args"]
    model = TinyLM(vocab_size=64, d_model=16, n_layers=1, n_heads=2, **options)
    objective = model.objective
    assert objective.base_loss.name == "ppo" and objective.base_loss.params["clip_high_threshold"] == 1.28
    assert objective.loss_agg == "seq-mean-token-sum-norm" and objective.loss_agg_norm == 256.0
    assert sorted(model.regularizer_set.terms) == ["entropy", "kl_reference"]
    assert model.regularizer_set.effective_weight("kl_reference", 0) == 0.0  # warming up
    assert objective.path("train", objective.head_outputs_needed()) == "fused"
