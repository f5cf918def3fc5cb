"""Pipeline stages: a 2-stage ``torch.distributed.pipelining`` run (gloo, ``ScheduleGPipe``, 4 micro-batches
with different token counts) with `PipelineLoss` at the last stage gives the gradients of the unsplit
model on the whole batch; `PipelineLoss` on its own against the full-batch loss."""

from __future__ import annotations

import pytest
import torch

from lit_losses.errors import ConfigError
from lit_losses.parallel import PipelineLoss
from tests.helpers import dr_grpo
from tests.parallel import pipeline_worker
from tests.parallel.launch import launch


@pytest.mark.slow
@pytest.mark.ddp
def test_two_stage_gpipe_step_equals_the_unsplit_model(tmp_path):
    launch("tests.parallel.pipeline_worker", 2, str(tmp_path), timeout=240)
    for rank in range(2):
        errors = torch.load(tmp_path / f"rank{rank}.pt")
        assert set(errors) == set(pipeline_worker.CASES)
        for case, error in errors.items():
            assert error < 1e-10, (rank, case, error)


def split_losses(loss_fn, hidden, target, n):
    """What a schedule does at the last stage: the loss of each of ``n`` micro-batches."""
    return [loss_fn(h, t) for h, t in zip(hidden.tensor_split(n), target.tensor_split(n), strict=True)]


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("scale_grads", [True, False])
def test_micro_batch_gradients_add_up_to_the_whole_batch(scale_grads, loss_agg):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(13, 5, generator=g, dtype=torch.float64, requires_grad=True)
    hidden = torch.randn(6, 7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 13, (6, 7), generator=g)
    labels[torch.rand(6, 7, generator=g) < 0.4] = -100
    logits = hidden @ weight.T
    logp = torch.log_softmax(logits, -1)
    valid = labels != -100
    if loss_agg == "token-mean":
        loss_fn = PipelineLoss(lambda: (weight, None), n_microbatches=3, scale_grads=scale_grads)
        target = loss_fn.target(labels)
        reference = -logp[valid].gather(1, labels[valid][:, None]).mean()
    else:  # Dr. GRPO on packed rows, with a z_loss term in the same mode: both divided by C = 5
        segment_ids = torch.cumsum(torch.rand(6, 7, generator=g) < 0.3, dim=1)
        z_loss = [{"name": "z_loss", "weight": 0.1}]
        loss_fn = PipelineLoss(
            lambda: (weight, None),
            n_microbatches=3,
            loss_agg=loss_agg,
            regularizers=z_loss,
            scale_grads=scale_grads,
            loss_agg_norm=5.0,
        )
        target = loss_fn.target(labels, segment_ids)
        nll = -logp.gather(-1, labels.clamp_min(0)[..., None])[..., 0]
        lse_sq = torch.logsumexp(logits, -1).square()
        reference = dr_grpo(nll + 0.1 * lse_sq, labels, segment_ids, 5.0)
    losses = split_losses(loss_fn, hidden, target, 3)
    # the schedule sums the micro-batch gradients, then divides them by n when scale_grads
    total = sum(losses) / (3 if scale_grads else 1)
    got = torch.autograd.grad(total, (hidden, weight))
    for a, b in zip(got, torch.autograd.grad(reference, (hidden, weight)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(loss_fn.step_loss(losses), reference.detach(), rtol=1e-12, atol=0)


def test_target_must_come_first_and_bad_options_are_refused():
    loss_fn = PipelineLoss(lambda: (torch.zeros(3, 2), None), n_microbatches=2)
    with pytest.raises(RuntimeError, match=r"call loss_fn\.target\(labels\) before"):
        loss_fn(torch.zeros(1, 2, 2), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"mask keys \['answer_mask'\]"):
        PipelineLoss(lambda: None, 2, regularizers=[{"name": "z_loss", "mask_key": "answer_mask"}])
    with pytest.raises(ConfigError, match="n_microbatches must be >= 1, got 0"):
        PipelineLoss(lambda: None, 0)
    with pytest.raises(
        ConfigError,
        match=r"^PipelineLoss: model\.loss_agg_norm is required .*used by model\.loss_agg$",
    ):
        PipelineLoss(lambda: None, 2, loss_agg="seq-mean-token-sum-norm")
    with pytest.raises(ConfigError, match=r"loss_agg_norm is required .*used by regularizer 'z'$"):
        PipelineLoss(
            lambda: None, 2, regularizers=[{"name": "z", "fn": "z_loss", "agg": "seq-mean-token-sum-norm"}]
        )
    with pytest.raises(ConfigError, match=r"loss_agg_norm must be a finite number > 0 .*got -1"):
        PipelineLoss(lambda: None, 2, loss_agg="seq-mean-token-sum-norm", loss_agg_norm=-1)
