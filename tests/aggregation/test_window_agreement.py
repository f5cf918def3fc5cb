"""`check_window`: a loader and Lightning that disagree on the index, the window position or where a window
ends raise (a wrong step is never trained)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lit_losses.aggregation import GLOBAL_STATS_KEY, check_window
from lit_losses.aggregation.position import LoaderStats


def trainer(A=2, n=5):
    return SimpleNamespace(accumulate_grad_batches=A, world_size=1, num_training_batches=n)


def batch(**fields):
    return {GLOBAL_STATS_KEY: LoaderStats(**fields)}


def test_agreeing_positions_pass():
    for index, ends in [(0, False), (1, True), (2, False), (3, True), (4, True)]:  # 5 batches, A = 2
        check_window(batch(index=index, position=index % 2, ends_window=ends), index, trainer())


@pytest.mark.parametrize(
    ("fields", "batch_idx", "message"),
    [
        ({"index": 0, "position": 1}, 3, "yields micro-batch 0 of its pass where Lightning is at batch 3"),
        (
            {"index": 2, "position": 0, "ends_window": True},
            2,
            "ends the accumulation window at batch 2, Lightning does not",
        ),
        (
            {"index": 3, "position": 1, "ends_window": False},
            3,
            "does not end the accumulation window at batch 3, Lightning does",
        ),
        (
            {"index": 4, "position": 0, "ends_window": False},
            4,
            "does not end the accumulation window at batch 4",
        ),
    ],
    ids=["index", "ends-early", "ends-late", "trailing-window"],
)
def test_disagreements_raise(fields, batch_idx, message):
    with pytest.raises(RuntimeError, match=message):
        check_window(batch(**fields), batch_idx, trainer())
