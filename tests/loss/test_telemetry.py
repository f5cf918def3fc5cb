import pytest
import torch

from lit_losses.aggregation import GlobalStats
from lit_losses.loss.context import LossOutput
from lit_losses.loss.telemetry import StepTelemetry, ValidationTelemetry, nested_telemetry
from lit_losses.regularizers import RegularizerSet, TermResult


def test_step_sums_are_the_global_value_and_restart():
    telemetry = StepTelemetry()
    terms = {"z": TermResult(torch.tensor(2.0), 0.5, torch.tensor(1.0), custom={"k": 3.0})}
    values = lambda v: {"train/loss_total": torch.tensor(v), "regularizers/z/error": torch.tensor(0.0)}  # noqa: E731
    for v in (1.0, 2.0, 3.0):
        telemetry.update(values(v), share=0.5, terms=terms)
    out = telemetry.compute(RegularizerSet([{"name": "z", "fn": "z_loss", "weight": 0.5}]), step=0)
    assert float(out["train/loss_total"]) == pytest.approx(3.0)
    assert float(out["regularizers/z/weight"]) == 0.5 and float(out["regularizers/z/custom/k"]) == 3.0
    assert telemetry.nested["regularizers"]["z"]["custom"] == {"k": 3.0}
    telemetry.update(values(4.0), share=1.0, terms=terms)
    assert float(telemetry.compute(None, 1)["train/loss_total"]) == 4.0
    with pytest.raises(RuntimeError, match="logged loss terms changed"):
        telemetry.update({"train/other": torch.tensor(1.0)}, 1.0, {})


def test_grad_norm_and_error_are_reported_as_norm_and_flag():
    telemetry = StepTelemetry()
    for sq, err in ((9.0, 0.0), (16.0, 1.0)):
        telemetry.update(
            {"regularizers/z/grad_norm_sq": torch.tensor(sq), "regularizers/z/error": torch.tensor(err)},
            1.0,
            {},
        )
    out = telemetry.compute(None, 0)
    assert float(out["regularizers/z/grad_norm"]) == 5.0 and float(out["regularizers/z/error"]) == 1.0


def test_nested_telemetry_schema():
    values = {"train/loss_total": torch.tensor(1.5), "regularizers/z/value": torch.tensor(2.0)}
    nested = nested_telemetry(values, {"z": TermResult(custom={"a": 1.0})})
    assert nested["loss_total"] == 1.5  # the design's schema: base_loss is {value, custom} (+ its weight)
    assert nested["base_loss"] == {"value": 0.0, "weight": 1.0, "custom": {}}
    assert nested["regularizers"]["z"] == {
        "value": 2.0,
        "weight": 0.0,
        "contribution": 0.0,
        "custom": {"a": 1.0},
        "error": 0.0,
    }


@pytest.mark.parametrize(("mode", "expected"), [("token-mean", (1 * 3 + 3 * 1) / 4), ("token-sum", 2.0)])
def test_validation_is_weighted_by_each_micro_batch_count(mode, expected):
    val = ValidationTelemetry(mode)
    for loss, n in ((1.0, 3), (3.0, 1)):
        stats = GlobalStats.local_only({"labels": torch.zeros(1, n, dtype=torch.long)})
        val.update(LossOutput(torch.tensor(loss), torch.tensor(loss), torch.tensor(0.0), stats))
    assert float(val.loss.compute()) == pytest.approx(expected)
