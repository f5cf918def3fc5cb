import pytest
import torch

from lit_losses.heads import HeadOutput
from lit_losses.loss import LossContext, LossOutput
from lit_losses.regularizers import TermResult


def test_context_exposes_computed_head_outputs_only():
    lse = torch.tensor([[1.0, 2.0]])
    ctx = LossContext({}, HeadOutput(lse=lse), None, torch.ones(1, 2, dtype=torch.bool), None, 3, "val")
    assert ctx.lse is lse
    with pytest.raises(AttributeError, match="head output 'logprobs' was not computed"):
        _ = ctx.logprobs


def test_logged_values_are_namespaced_and_skip_what_was_not_computed():
    terms = {"z": TermResult(torch.tensor(2.0), 0.5, torch.tensor(1.0), 0.0, {}, None)}
    out = LossOutput(torch.tensor(3.0), torch.tensor(2.0), torch.tensor(1.0), None, terms)
    values = out.logged_values("train")
    assert sorted(values) == [
        "regularizers/z/contribution",
        "regularizers/z/error",
        "regularizers/z/value",
        "train/base_loss",
        "train/loss_total",
        "train/regularizer_total",
    ]
    assert float(values["regularizers/z/contribution"]) == 1.0
