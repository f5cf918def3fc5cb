"""Real run, float64: a preference loss's step on 2 DDP processes × 2 accumulated micro-batches of
different pair and token counts equals the step of one process over one micro-batch holding every pair
(gradients, loss and TRL's metrics, for DPO and ORPO with the token metrics of ``model.token_metrics``),
for DPO (reference computed on the fly; ``sft``'s token mean, ``ipo``'s lengths), SimPO, ORPO (its NLL
over the chosen sequences' tokens) and WPO (DPO's ``use_weighting``: per-pair weights, so the pair count
stays the denominator); and DPO and WPO under FSDP2 with their frozen reference replicated."""

from __future__ import annotations

import pytest
import torch

from tests.loss import preference_ddp_worker as worker
from tests.parallel.launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.ddp]


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    out = tmp_path_factory.mktemp("preference_ddp")
    launch("tests.loss.preference_ddp_worker", worker.RANKS, str(out), timeout=400)
    return {name: torch.load(out / f"{name}.pt") for name in (*worker.PRESETS, "fsdp", "fsdp_wpo")}


def test_the_micro_batches_differ_in_pairs_and_tokens():
    batches = worker.micro_batches()
    tokens = [int(b["chosen_mask"].sum()) for b in batches]
    assert [b["input_ids"].shape[0] // 2 for b in batches] == list(worker.PAIRS)
    assert len(set(tokens)) > 1 and len({b["input_ids"].shape[1] for b in batches}) > 1, tokens


@pytest.mark.parametrize("name", list(worker.PRESETS))
def test_split_step_equals_the_whole_batch_step(name, split, tmp_path):
    reference = worker.step(name, 1, [worker.whole_batch()], root=str(tmp_path))
    got = split[name]
    assert set(got["grads"]) == set(reference["grads"])
    for param, expected in reference["grads"].items():
        assert expected.dtype == torch.float64 and expected.abs().max() > 0, param
        torch.testing.assert_close(got["grads"][param], expected, rtol=1e-9, atol=1e-12, msg=param)
    logged = reference["logged"]
    assert {"train/loss_total", "train/rewards/accuracies", "train/logps/chosen"} <= set(logged)
    if name in ("dpo", "orpo"):  # TRL's token metrics too (model.token_metrics)
        assert {"train/logits/chosen", "train/logits/rejected"} <= set(logged)
    assert got["logged"] == pytest.approx(logged, rel=1e-9, abs=1e-12)


def test_trls_per_micro_batch_normalization_differs_on_this_split():
    """TRL's value on the same split (each micro-batch's mean over its own pairs and NLL tokens, averaged
    over the A × D micro-batches) is not the whole batch's: the comparison above can fail."""
    model = worker.model_of("dpo").double()
    whole = model.compute_loss(worker.whole_batch(), "val").total  # "val": each batch's own counts
    batches = worker.micro_batches()
    per_micro_batch = sum(model.compute_loss(b, "val").total for b in batches) / len(batches)
    assert abs(float(per_micro_batch - whole)) > 1e-3 * abs(float(whole))


@pytest.mark.parametrize(("result", "name"), [("fsdp", "dpo"), ("fsdp_wpo", "wpo")])
def test_fsdp2_with_a_replicated_frozen_reference_equals_one_process(result, name, split, tmp_path):
    """DPO and WPO under FSDP2 (2 data-parallel ranks × 2 accumulated micro-batches), the reference a
    frozen copy of the initial policy replicated on each rank: the first step's gradients and loss are one
    process's over all pairs (float64)."""
    got = split[result]
    reference = worker.fsdp_step(1, [worker.whole_batch()], root=str(tmp_path), name=name)
    for name, expected in reference["grads"].items():
        assert expected.dtype == torch.float64 and expected.abs().max() > 0, name
        torch.testing.assert_close(got["grads"][name], expected, rtol=1e-9, atol=1e-12, msg=name)
    assert got["loss"] == pytest.approx(reference["loss"], rel=1e-9)
    assert got["loss_scale"] == worker.ACCUMULATE * worker.RANKS
