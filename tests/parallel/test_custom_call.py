"""`forward_backward_custom` under DDP and FSDP2 on 2 processes returns the single-process call's
``loss_total``, term values and gradients over the union of the ranks' micro-batches (float64)."""

from __future__ import annotations

import pytest
import torch

from tests.aggregation.ddp_step import one_batch
from tests.parallel import custom_call_worker as worker
from tests.parallel.launch import launch


@pytest.fixture(scope="module")
def parallel_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("custom_call") / "results.pt"
    launch("tests.parallel.custom_call_worker", 2, str(out), timeout=180)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_the_call_on_two_ranks_is_the_call_on_the_global_batch(parallel_results, strategy, mode):
    local = [b["labels"].ne(-100).sum().item() for b in worker.batches()]
    assert local[0] != local[1]  # per-rank normalization would differ from the global one
    model = worker.make_model(mode)
    expected = model.forward_backward_custom(
        one_batch(worker.batches()), loss_fn=worker.LOSS_FNS[mode], regularizers=worker.TERMS
    )
    got = parallel_results[(strategy, mode)]
    assert got["metrics"]["loss_total"] == pytest.approx(expected["loss_total"], rel=1e-10)
    assert got["metrics"]["base_loss"]["value"] == pytest.approx(expected["base_loss"]["value"], rel=1e-10)
    tok, expected_tok = got["metrics"]["regularizers"]["tok"], expected["regularizers"]["tok"]
    assert tok["value"] == pytest.approx(expected_tok["value"], rel=1e-10)
    assert tok["contribution"] == pytest.approx(expected_tok["contribution"], rel=1e-10)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-9, atol=1e-12, msg=name)
