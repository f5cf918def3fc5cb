"""Global-denominator aggregation of per-token losses."""

from lit_losses.aggregation.modes import AGG_MODES, aggregate, check_mode, token_weights
from lit_losses.aggregation.stats import GlobalStats, MaskStats, count_units, sequence_ids

__all__ = [
    "AGG_MODES",
    "GlobalStats",
    "MaskStats",
    "aggregate",
    "check_mode",
    "count_units",
    "sequence_ids",
    "token_weights",
]
