"""`describe_objective`: what a run optimized (``run_end.json``'s ``objective``, written by
`lit_losses.loss.summary.objective_summary`) as one line, for the end summary and the report.

Plain data in, a string out: the report reads it from a run's folder without loading torch.
"""

from __future__ import annotations

from typing import Any


def describe_objective(summary: dict[str, Any]) -> str:
    """An objective's summary (`lit_losses.loss.summary.objective_summary`) as one line: ``base loss (its
    arguments; aggregation) + w·regularizer …``.

    Example:
        >>> describe_objective({"base_loss": "ppo", "base_loss_args": {"epsilon_low": 0.2},
        ...     "base_loss_weight": 1.0, "loss_agg": "seq-mean-token-sum-norm", "loss_agg_norm": 256.0,
        ...     "regularizers": [{"name": "kl_reference", "weight": 0.04, "enabled": True, "agg": None}]})
        'ppo (epsilon_low=0.2; seq-mean-token-sum-norm, C=256) + 0.04·kl_reference'
    """
    args = ", ".join(f"{k}={v}" for k, v in summary["base_loss_args"].items() if v is not None)
    agg = summary["loss_agg"] + (f", C={summary['loss_agg_norm']:g}" if summary["loss_agg_norm"] else "")
    weight = summary["base_loss_weight"]
    base = (
        f"{'' if weight == 1 else f'{weight:g}·'}{summary['base_loss']} ({args + '; ' if args else ''}{agg})"
    )
    terms = [
        f"{t['weight']:g}·{t['name']}" + ("" if t["enabled"] else " (disabled)")
        for t in summary["regularizers"]
    ]
    return " + ".join([base, *terms])
