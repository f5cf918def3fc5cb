"""The sanity identity of policy gradients: with advantages 1, sampling log-probabilities equal to the
current ones and no clipping, ``∇(−r·A) = −∇log p``: ``importance_sampling`` and ``ppo`` (and ``cispo``,
``dro``) take the gradient of the negative log-likelihood weighted the same way."""

from __future__ import annotations

import pytest
import torch

from lit_losses import TinyLM
from tests.objectives.test_builtins import NORM

ARGS = {
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": 0.5},
}


def on_policy_batch(model: TinyLM, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 48, (3, 12), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[:, :3] = -100  # the prompt
    labels[:, -1] = -100
    segment_ids = torch.tensor([[1] * 6 + [2] * 6, [1] * 12, [1] * 4 + [2] * 8])
    labels[segment_ids != torch.roll(segment_ids, -1, 1)] = -100  # a document's last token has no target
    batch = {"input_ids": ids, "labels": labels, "segment_ids": segment_ids}
    valid = labels != -100
    with torch.no_grad():
        batch["sampling_logprobs"] = model.predict_step(batch, 0)  # the current policy's, exactly
    batch["advantages"] = valid.double()
    batch["loss_weights"] = torch.where(valid, torch.rand(3, 12, generator=g, dtype=torch.float64) + 0.5, 0.0)
    batch["sample_weights"] = torch.where(
        valid, segment_ids.double() * torch.tensor([[1.0], [0.5], [2.0]]), 0.0
    )
    return batch


def gradient(model: TinyLM, batch: dict) -> tuple[list[torch.Tensor], dict]:
    out = model.compute_loss(batch)
    return list(torch.autograd.grad(out.total, list(model.parameters()))), out.base_metrics


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("name", sorted(ARGS))
def test_on_policy_unit_advantage_gradient_is_the_weighted_nll_gradient(name, mode):
    dims = dict(vocab_size=48, d_model=16, n_layers=1, n_heads=2, head_backend="chunked", loss_agg=mode)
    torch.manual_seed(0)
    nll = TinyLM(**dims, loss_agg_norm=NORM).double()
    policy = TinyLM(**dims, loss_agg_norm=NORM, base_loss=name, base_loss_args=ARGS[name]).double()
    policy.load_state_dict(nll.state_dict())
    batch = on_policy_batch(nll)
    reference, _ = gradient(nll, batch)
    grads, metrics = gradient(policy, batch)
    assert policy.objective.path("train", policy.head_outputs_needed()) == "fused"
    for g, r in zip(grads, reference, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    n = int((batch["labels"] != -100).sum())
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0, abs=1e-12)  # on policy
    assert float(metrics["approx_kl"]) == pytest.approx(0.0, abs=1e-12)
    assert float(metrics["advantage_mean"]) == pytest.approx(1.0)
    assert float(metrics.get("clip_fraction", 0.0)) == 0.0  # no clipping is active
    assert n > 10


def test_the_identity_breaks_off_policy():
    """The identity is not vacuous: with sampling log-probabilities off by 0.1 the gradients differ."""
    dims = dict(vocab_size=48, d_model=16, n_layers=1, n_heads=2, head_backend="chunked")
    torch.manual_seed(0)
    nll = TinyLM(**dims).double()
    policy = TinyLM(**dims, base_loss="importance_sampling").double()
    policy.load_state_dict(nll.state_dict())
    batch = on_policy_batch(nll)
    batch["sampling_logprobs"] = batch["sampling_logprobs"] - 0.1 * (batch["labels"] != -100)
    reference, _ = gradient(nll, batch)
    grads, _ = gradient(policy, batch)
    assert max(float((g - r).abs().max()) for g, r in zip(grads, reference, strict=True)) > 1e-4
