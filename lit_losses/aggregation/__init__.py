"""Global-denominator aggregation of per-token losses.

`modes` (`aggregate`, the aggregation modes) and `stats` (`GlobalStats`, `MaskStats`, counting) need torch
alone; `loader` (`GlobalStatsLoader`), `window` (Lightning's accumulation window) and `metrics`
(torchmetrics sum states) bring Lightning or torchmetrics. Names are imported on first use (PEP 562
``__getattr__``), so ``from lit_losses.aggregation import aggregate`` loads neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lit_losses.lazy import lazy_exports

if TYPE_CHECKING:
    from lit_losses.aggregation.loader import GLOBAL_STATS_KEY, GlobalStatsLoader
    from lit_losses.aggregation.metrics import StepSums, mode_denominator
    from lit_losses.aggregation.modes import (
        AGG_MODES,
        AggMode,
        aggregate,
        check_mode,
        reweight_mean,
        token_weights,
    )
    from lit_losses.aggregation.stats import (
        LABELS_KEY,
        GlobalStats,
        LabelFormat,
        MaskStats,
        batch_mask,
        count_masks,
        count_units,
        sequence_ids,
        shift_labels,
        sum_counts,
    )
    from lit_losses.aggregation.window import (
        accumulation_factor,
        check_window,
        configure_train_loaders,
        window_ends,
    )

__all__ = [
    "AGG_MODES",
    "GLOBAL_STATS_KEY",
    "LABELS_KEY",
    "AggMode",
    "GlobalStats",
    "GlobalStatsLoader",
    "LabelFormat",
    "MaskStats",
    "StepSums",
    "accumulation_factor",
    "aggregate",
    "batch_mask",
    "check_mode",
    "check_window",
    "configure_train_loaders",
    "count_masks",
    "count_units",
    "mode_denominator",
    "reweight_mean",
    "sequence_ids",
    "shift_labels",
    "sum_counts",
    "token_weights",
    "window_ends",
]

_MODULES = {
    "loader": ("GLOBAL_STATS_KEY", "GlobalStatsLoader"),
    "metrics": ("StepSums", "mode_denominator"),
    "modes": ("AGG_MODES", "AggMode", "aggregate", "check_mode", "reweight_mean", "token_weights"),
    "stats": (
        "LABELS_KEY",
        "GlobalStats",
        "LabelFormat",
        "MaskStats",
        "batch_mask",
        "count_masks",
        "count_units",
        "sequence_ids",
        "shift_labels",
        "sum_counts",
    ),
    "window": ("accumulation_factor", "check_window", "configure_train_loaders", "window_ends"),
}
_EXPORTS = {name: f"{__name__}.{module}" for module, names in _MODULES.items() for name in names}


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
