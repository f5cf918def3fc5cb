"""`Objective`: the one choice of loss path, and every path against a float64 reference."""

import pytest
import torch

from lit_losses.aggregation import GlobalStats
from lit_losses.heads import FusedLMHead
from lit_losses.loss.objective import Objective
from lit_losses.regularizers import RegularizerSet, RegularizerSpec


async def async_z_loss(ctx):
    return ctx.lse.square()


def setup(seed=0, B=3, T=7, V=23, D=5):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64, requires_grad=True)
    hidden = torch.randn(B, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :3] = -100
    batch = {"labels": labels}
    return FusedLMHead(weight, backend="chunked", chunk_size=4), weight, hidden, batch


def reference(weight, hidden, labels, z_weight=0.0):
    """Token-mean NLL (+ z_weight · mean lse²) from materialized float64 logits."""
    mask = labels != -100
    logits = hidden[mask] @ weight.T
    logp = torch.log_softmax(logits, -1).gather(-1, labels[mask][:, None]).squeeze(-1)
    lse = torch.logsumexp(logits, -1)
    return -logp.mean() + z_weight * lse.square().mean()


@pytest.mark.parametrize(
    ("specs", "stage", "grad", "expected"),
    [
        ([], "train", True, "plain_ce"),
        ([{"name": "z_loss"}], "train", True, "fused"),
        ([{"name": "z_loss"}], "train", False, "general"),
        ([{"name": "z_loss"}], "val", True, "general"),
        ([{"name": "z_loss", "pointwise": False}], "train", True, "general"),
        ([{"name": "az", "fn": async_z_loss, "needs": ["lse"]}], "train", True, "general"),
        ([{"name": "z_loss", "on_error": "skip"}], "train", True, "general"),
    ],
)
def test_path_choice(specs, stage, grad, expected):
    objective = Objective(RegularizerSet(specs))
    with torch.set_grad_enabled(grad):
        assert objective.path(stage, objective.head_outputs_needed()) == expected


@pytest.mark.parametrize(
    "specs",
    [[], [{"name": "z_loss", "weight": 0.3}], [{"name": "z_loss", "weight": 0.3, "pointwise": False}]],
    ids=["plain_ce", "fused", "general"],
)
def test_every_path_equals_the_float64_reference(specs):
    head, weight, hidden, batch = setup()
    objective = Objective(RegularizerSet([RegularizerSpec(**s) for s in specs]))
    out = objective(head, hidden, batch, GlobalStats.local_only(batch), step=0, stage="train")
    expected = reference(weight, hidden, batch["labels"], 0.3 if specs else 0.0)
    torch.testing.assert_close(out.total, expected, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.total, (weight, hidden))
    for g, r in zip(grads, torch.autograd.grad(expected, (weight, hidden)), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    assert out.num_tokens == int((batch["labels"] != -100).sum())


def test_base_loss_weight_and_validation():
    head, _, hidden, batch = setup(seed=1)
    objective = Objective(RegularizerSet([{"name": "z_loss", "weight": 0.1}]), base_loss_weight=0.5)
    out = objective(head, hidden, batch, GlobalStats.local_only(batch), 0, "val")
    torch.testing.assert_close(out.total, 0.5 * out.base + out.regularizer_total)
    with pytest.raises(ValueError, match="base_loss_weight must be >= 0"):
        Objective(RegularizerSet(), base_loss_weight=-1)
    with pytest.raises(ValueError, match="did you mean 'token-mean'"):
        Objective(RegularizerSet(), loss_agg="tokn-mean")


def test_missing_labels_names_the_batch_keys():
    head, _, hidden, _ = setup()
    with pytest.raises(KeyError, match=r"batch key 'labels' is missing; the batch has keys \['input_ids'\]"):
        Objective(RegularizerSet())(head, hidden, {"input_ids": hidden}, None, 0, "train")


def test_torch_backend_runs_a_pointwise_term_that_reads_logprobs_only():
    """`TinyLM(head_backend="torch", regularizers=[logprob_l1])` used to crash (torch gives no lse)."""
    from lit_losses import TinyLM

    g = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, 64, (2, 9), generator=g),
        "labels": torch.randint(0, 64, (2, 9), generator=g),
    }
    losses = []
    for backend in ("torch", "chunked"):
        torch.manual_seed(0)
        model = TinyLM(
            vocab_size=64,
            d_model=16,
            n_layers=1,
            n_heads=2,
            head_backend=backend,
            regularizers=[{"name": "logprob_l1", "weight": 0.1}],
        ).double()
        losses.append(model.compute_loss(batch).total)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-12, atol=1e-12)
