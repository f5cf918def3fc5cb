"""Built-in regularizers: formulas against naive float64 references, gradient checks, legacy callbacks."""

from __future__ import annotations

import pytest
import torch

from lit_losses.regularizers import REGISTRY, RegularizerSpec, sequence_logprobs
from lit_losses.regularizers.testing import check_regularizer
from tests.helpers import EmbeddingLM, random_batch

BUILTINS = {
    "z_loss": ({}, lambda lp, lse, h, ref: lse**2),
    "entropy": ({"mode": "bonus"}, lambda lp, lse, h, ref: -h),
    "confidence_penalty": ({"threshold": 1.5}, lambda lp, lse, h, ref: torch.relu(1.5 - h)),
    "logprob_l1": ({"target": -1.0}, lambda lp, lse, h, ref: (lp + 1.0).abs()),
    "kl_reference": ({"estimator": "k3"}, lambda lp, lse, h, ref: torch.exp(ref - lp) - (ref - lp) - 1),
}


def model_and_batch(spec):
    torch.manual_seed(0)
    model = EmbeddingLM(regularizers=[spec], head_backend="chunked").double()
    batch = random_batch()
    batch["ref_logprobs"] = -torch.rand(batch["labels"].shape, dtype=torch.float64) * 3
    return model, batch


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_matches_its_formula_with_exact_gradients(name):
    args, formula = BUILTINS[name]
    model, batch = model_and_batch(RegularizerSpec(name=name, weight=0.5, args=args))
    out = model.compute_loss(batch)
    logp, lse, h, mask = model.reference_head(batch)
    per_token = formula(logp, lse, h, batch["ref_logprobs"])
    expected = -logp[mask].mean() + 0.5 * per_token[mask].mean()
    torch.testing.assert_close(out.total, expected, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.total, list(model.parameters()))
    ref = torch.autograd.grad(expected, list(model.parameters()))
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12)
    assert REGISTRY[name].target.__doc__  # each built-in documents its formula


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_passes_check_regularizer(name):
    args, _ = BUILTINS[name]
    g = torch.Generator().manual_seed(1)
    shape = (2, 5)
    logprobs = -torch.rand(shape, generator=g, dtype=torch.float64) * 3 - 0.1
    report = check_regularizer(
        RegularizerSpec(name=name, args=args),
        logprobs,
        torch.rand(shape, generator=g) > 0.3,
        lse=torch.randn(shape, generator=g, dtype=torch.float64),
        entropy=torch.rand(shape, generator=g, dtype=torch.float64) * 3,
        batch={"ref_logprobs": -torch.rand(shape, generator=g, dtype=torch.float64)},
    )
    assert report.passed


def legacy_seq_mean(data, logprobs_list):
    """A legacy loss: the mean over sequences of each sequence's mean negative log-probability."""
    per_seq = torch.stack([-lp.mean() for lp in logprobs_list])
    return per_seq.mean(), {"num_sequences": len(logprobs_list)}


def test_legacy_callback_gets_unpadded_sequences_and_works_as_the_whole_loss():
    torch.manual_seed(0)
    batch = {
        **random_batch(B=2, T=9),
        "segment_ids": torch.tensor([[1, 1, 1, 2, 2, 3, 3, 3, 0], [1, 1, 1, 1, 2, 2, 2, 2, 2]]),
    }
    batch["labels"][batch["segment_ids"] == 0] = -100
    reference = EmbeddingLM(loss_agg="seq-mean-token-mean", head_backend="chunked").double()
    legacy = EmbeddingLM(
        loss_agg="seq-mean-token-mean",
        base_loss_weight=0.0,
        regularizers=[RegularizerSpec(name="legacy", fn=legacy_seq_mean, legacy=True)],
        head_backend="chunked",
    ).double()
    legacy.load_state_dict(reference.state_dict())
    expected = reference.compute_loss(batch, "val").total
    out = legacy.compute_loss(batch)
    torch.testing.assert_close(out.total, expected, rtol=1e-12, atol=1e-12)
    g_ref = torch.autograd.grad(reference.compute_loss(batch, "val").total, list(reference.parameters()))
    g_leg = torch.autograd.grad(out.total, list(legacy.parameters()))
    for a, b in zip(g_leg, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert out.terms["legacy"]["custom"]["num_sequences"] == 5.0

    # the sequences handed over: one unpadded tensor per (row, segment) with a valid label, in order
    from lit_losses.loss import LossContext

    logp, _, _, mask = legacy.reference_head(batch)
    ctx = LossContext(batch, type("H", (), {"logprobs": logp})(), None, mask, None, 0, "train")
    seqs = sequence_logprobs(ctx)
    expected_seqs = []
    for row in range(2):
        for seg in torch.unique(batch["segment_ids"][row]):
            sel = (batch["segment_ids"][row] == seg) & mask[row]
            if seg > 0 and sel.any():
                expected_seqs.append(logp[row][sel])
    assert len(seqs) == len(expected_seqs)
    for a, b in zip(seqs, expected_seqs, strict=True):
        torch.testing.assert_close(a, b)


def test_fused_pointwise_path_equals_the_general_path_across_chunks():
    """Built-ins run chunk by chunk inside the head (gradients in forward); forcing the general path
    (``pointwise: false``: per-token outputs, recompute in backward) gives the same loss and gradients."""
    batch = random_batch(B=4, T=9, seed=5)
    batch["ref_logprobs"] = -torch.rand(batch["labels"].shape, dtype=torch.float64) * 3
    results = []
    for pointwise in (None, False):
        specs = [
            RegularizerSpec(name=name, weight=0.3, args=args, pointwise=pointwise)
            for name, (args, _) in sorted(BUILTINS.items())
        ]
        torch.manual_seed(0)
        model = EmbeddingLM(regularizers=specs, head_backend="chunked", head_chunk_size=5).double()
        assert model.regularizer_set.fusable() == (pointwise is None)
        out = model.compute_loss(batch, "train")
        grads = torch.autograd.grad(out.total, list(model.parameters()))
        results.append((out, grads))
    (fused, g_fused), (general, g_general) = results
    torch.testing.assert_close(fused.total, general.total, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused.regularizer_total, general.regularizer_total, rtol=1e-12, atol=1e-12)
    for name in BUILTINS:
        torch.testing.assert_close(
            fused.terms[name]["value"], general.terms[name]["value"], rtol=1e-12, atol=1e-12
        )
    for a, b in zip(g_fused, g_general, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_every_builtin_has_a_reference_formula_here():
    """The shared tester covers every registered built-in: one added without a formula fails here."""
    builtins = {n for n in REGISTRY if REGISTRY[n].target.__module__ == "lit_losses.regularizers.builtins"}
    assert builtins == set(BUILTINS)
