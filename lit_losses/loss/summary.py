"""What an `Objective` computes once its presets are applied: the record of what ran.

``model.grpo``, ``model.dpo`` (and the other preference options) and ``model.distillation`` replace the
base loss, its aggregation and some regularizers; the options a run was given (its ``config.yaml``) no
longer say what it optimizes. `objective_summary` does, as plain data (for ``run_end.json``, the saved
hyper-parameters and the report, which print it as one line).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lit_losses.hparams import plain_data

if TYPE_CHECKING:
    from lit_losses.loss.objective import Objective


def objective_summary(objective: Objective) -> dict[str, Any]:
    """The objective after presets: its base loss (name and arguments), aggregation, base-loss weight and
    its regularizers (name, weight, enabled, aggregation), as plain data.

    Example:
        >>> from lit_losses.loss.objective import Objective
        >>> ppo = Objective.from_options(grpo={"loss_type": "dr_grpo", "beta": 0.04,
        ...     "max_completion_length": 256})
        >>> summary = objective_summary(ppo)
        >>> summary["base_loss"], summary["loss_agg"], summary["loss_agg_norm"]
        ('ppo', 'seq-mean-token-sum-norm', 256.0)
        >>> [(t["name"], t["weight"]) for t in summary["regularizers"]]
        [('kl_reference', 0.04)]
    """
    summary: dict[str, Any] = {
        "base_loss": objective.base_loss.name,
        "base_loss_args": plain_data(objective.base_loss.params),
        "base_loss_weight": objective.base_loss_weight,
        "loss_agg": objective.loss_agg,
        "loss_agg_norm": objective.loss_agg_norm,
        "regularizers": [
            {"name": name, "weight": term.weight, "enabled": term.enabled, "agg": term.spec.agg}
            for name, term in objective.regularizers.terms.items()
        ],
    }
    preference = getattr(objective, "preference", None)
    if preference is not None:
        preset = preference.preset
        summary["base_loss"] = preset.trainer
        summary["base_loss_args"] = plain_data(preset)
        summary["loss_agg"] = "pair-mean" if preset.paired else "sequence-mean"
        summary["loss_agg_norm"] = None
    distillation = getattr(objective, "distillation", None)
    if distillation is not None:
        summary["base_loss"] = "distillation"
        summary["base_loss_args"] = plain_data(distillation.config)
    return summary
