from types import SimpleNamespace

import pytest

from lit_losses.aggregation import (
    GLOBAL_STATS_KEY,
    GlobalStats,
    accumulation_factor,
    check_window,
    window_ends,
)


def trainer(A=2, D=3, n=5):
    return SimpleNamespace(accumulate_grad_batches=A, world_size=D, num_training_batches=n)


def test_factor_and_window_ends():
    assert accumulation_factor(None) == 1 and accumulation_factor(trainer()) == 6
    assert [window_ends(trainer(), i) for i in range(5)] == [False, True, False, True, True]
    assert window_ends(None, 0)


def test_window_out_of_step_raises():
    check_window({GLOBAL_STATS_KEY: GlobalStats(position=1)}, 3, trainer())
    check_window({}, 3, trainer())  # no attached stats: nothing to compare
    with pytest.raises(RuntimeError, match="batch 2 is micro-batch 1 of its window, Lightning expects 0"):
        check_window({GLOBAL_STATS_KEY: GlobalStats(position=1)}, 2, trainer())
