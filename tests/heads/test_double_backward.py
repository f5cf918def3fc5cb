"""Double backward (``create_graph=True``) through every head path: exact, or one clear refusal."""

import pytest
import torch
import torch.nn.functional as F

from lit_losses.heads import HEAD_BACKENDS, FusedLMHead
from lit_losses.heads.higher_order import DoubleBackwardError

IGNORE = -100
ALL = ("logprobs", "lse", "entropy")


def problem(n=9, d=5, v=13, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(v, d, generator=g, dtype=torch.float64) * 0.7).requires_grad_()
    b = (torch.randn(v, generator=g, dtype=torch.float64) * 0.2).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::4] = IGNORE
    return hidden, weight, b, targets


def reference(hidden, weight, bias, targets):
    logits = F.linear(hidden, weight, bias)
    logp = F.log_softmax(logits, -1)
    valid = targets != IGNORE
    values = {
        "logprobs": logp.gather(-1, targets.clamp_min(0)[:, None])[:, 0],
        "lse": torch.logsumexp(logits, -1),
        "entropy": -(logp.exp() * logp).sum(-1),
    }
    return {k: torch.where(valid, v, 0.0) for k, v in values.items()}


def penalty(loss_fn, leaves):
    """A gradient penalty: ``‖∂loss/∂hidden‖² + ‖∂loss/∂weight‖²``, and its gradient w.r.t. every leaf."""
    present = [x for x in leaves if x is not None]
    first = torch.autograd.grad(loss_fn(*leaves), present[:2], create_graph=True)
    value = sum((g**2).sum() for g in first)
    return value, torch.autograd.grad(value, present)


UPSTREAM = torch.randn(9, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def per_token_loss(backend, outputs):
    def loss(hidden, weight, bias, targets):
        out = FusedLMHead(weight, bias, backend=backend, chunk_size=4)(hidden, targets, outputs)
        return sum((getattr(out, o) * UPSTREAM[:, i]).sum() for i, o in enumerate(outputs))

    return loss


def reference_loss(outputs):
    def loss(hidden, weight, bias, targets):
        ref = reference(hidden, weight, bias, targets)
        return sum((ref[o] * UPSTREAM[:, i]).sum() for i, o in enumerate(outputs))

    return loss


@pytest.mark.parametrize("outputs", [("logprobs",), ("lse",), ("entropy",), ALL])
@pytest.mark.parametrize("backend", ["chunked", "naive"])
def test_per_token_gradient_penalty_is_exact(backend, outputs):
    *leaves, targets = problem()
    got, got_grads = penalty(lambda h, w, b: per_token_loss(backend, outputs)(h, w, b, targets), leaves)
    ref, ref_grads = penalty(lambda h, w, b: reference_loss(outputs)(h, w, b, targets), leaves)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    for g, r in zip(got_grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_chunked_per_token_and_weighted_ce_pass_gradgradcheck():
    hidden, weight, b, targets = problem(n=6, d=3, v=7)
    head = lambda w, bias: FusedLMHead(w, bias, backend="chunked", chunk_size=4)  # noqa: E731

    def per_token(h, w, bias):
        out = head(w, bias)(h, targets, ALL)
        return out.logprobs, out.lse, out.entropy

    assert torch.autograd.gradgradcheck(per_token, (hidden, weight, b))
    weights = torch.rand(targets.shape, dtype=torch.float64)
    assert torch.autograd.gradgradcheck(
        lambda h, w, bias: head(w, bias).weighted_ce(h, targets, weights), (hidden, weight, b)
    )


@pytest.mark.parametrize("backend", ["chunked", "naive"])
def test_weighted_ce_gradient_penalty_is_exact(backend):
    *leaves, targets = problem()

    def loss(h, w, bias):
        return FusedLMHead(w, bias, backend=backend, chunk_size=4).weighted_ce(h, targets, 0.3)

    got, got_grads = penalty(loss, leaves)
    ref, ref_grads = penalty(
        lambda h, w, bias: -0.3 * reference(h, w, bias, targets)["logprobs"].sum(), leaves
    )
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    for g, r in zip(got_grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_weighted_ce_first_order_is_unchanged_by_the_double_backward_support():
    hidden, weight, b, targets = problem()
    loss = FusedLMHead(weight, b, backend="chunked", chunk_size=4).weighted_ce(hidden, targets, 0.3)
    first = torch.autograd.grad(loss, (hidden, weight, b))
    assert not any(g.requires_grad for g in first)  # without create_graph: the gradients of forward


def chunk_loss(s, e, lp, lse, ent):
    return (lp + 0.1 * lse**2).sum()


def test_fused_pointwise_refuses_double_backward():
    hidden, weight, b, targets = problem()
    loss = FusedLMHead(weight, b, backend="chunked").pointwise_loss(hidden, targets, chunk_loss)
    torch.autograd.grad(loss, hidden, retain_graph=True)  # first order is fine
    with pytest.raises(DoubleBackwardError, match=r"pointwise_loss .* cannot be differentiated twice"):
        torch.autograd.grad(loss, hidden, create_graph=True)


def test_naive_pointwise_supports_double_backward():
    *leaves, targets = problem()

    def loss(h, w, bias):
        return FusedLMHead(w, bias, backend="naive").pointwise_loss(h, targets, chunk_loss)

    def ref_loss(h, w, bias):
        ref = reference(h, w, bias, targets)
        return chunk_loss(0, 0, ref["logprobs"], ref["lse"], None)

    got, got_grads = penalty(loss, leaves)
    ref, ref_grads = penalty(ref_loss, leaves)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    for g, r in zip(got_grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(not HEAD_BACKENDS["torch"].available(), reason="needs F.linear_cross_entropy")
def test_torch_backend_refuses_double_backward_instead_of_a_silent_first_order_gradient():
    hidden, weight, b, targets = problem()
    head = FusedLMHead(weight, b, backend="torch")
    (ref,) = torch.autograd.grad(reference(hidden, weight, b, targets)["logprobs"].sum(), hidden)
    for scale, loss in (
        (1.0, head(hidden, targets).logprobs.sum()),
        (-0.5, head.weighted_ce(hidden, targets, 0.5)),
    ):
        (first,) = torch.autograd.grad(loss, hidden, retain_graph=True)  # first order: exact
        torch.testing.assert_close(first, scale * ref, rtol=1e-10, atol=1e-12)
        with pytest.raises(DoubleBackwardError, match=r"'torch' .* cannot be differentiated twice"):
            torch.autograd.grad(loss, hidden, create_graph=True)
