import pytest
import torch

from lit_losses.aggregation import MaskStats, StepSums, mode_denominator


def test_step_sums_add_every_key_and_reset():
    sums = StepSums(("a", "b"))
    sums.update({"a": torch.tensor(1.5), "b": 2})
    sums.update({"a": torch.tensor(0.25), "b": torch.tensor(-1.0)})
    out = sums.compute()
    assert float(out["a"]) == 1.75 and float(out["b"]) == 1.0 and out["a"].dtype == torch.float64
    sums.reset()
    assert float(sums.compute()["a"]) == 0.0


def test_step_sums_refuse_missing_or_duplicate_keys():
    with pytest.raises(ValueError, match="unique"):
        StepSums(("a", "a"))
    with pytest.raises(KeyError, match=r"missing keys \['b'\]"):
        StepSums(("a", "b")).update({"a": 1.0})


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("token-mean", 7), ("token-sum", 1), ("seq-mean-token-sum", 3), ("seq-mean-token-mean", 3)],
)
def test_mode_denominator_is_the_count_a_local_value_was_divided_by(mode, expected):
    assert mode_denominator(mode, MaskStats(num_tokens=7, num_sequences=3)) == expected
