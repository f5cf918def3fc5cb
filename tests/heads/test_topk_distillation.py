"""`topk_distillation` against a float64 reference from the student's full softmax (the teacher's top-k
probabilities and its tail, or both renormalized), with gradients; its refusals."""

import pytest
import torch

from lit_losses.errors import ConfigError
from lit_losses.heads import topk_distillation
from tests.heads import distillation_reference as ref

V = 40


def problem(k, dtype=torch.float64, n=11, d=6, seed=0, full_mass=False):
    """Student ``[n, d]`` with a bias, the teacher's top-k of a random distribution (all of its mass on
    the ids with ``full_mass``), targets with ignored positions."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = (torch.randn(V, d, generator=g, dtype=torch.float64) * 0.8).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=torch.float64) * 0.3).to(dtype).requires_grad_()
    teacher_logits = torch.randn(n, V, generator=g, dtype=torch.float64) * 2
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(n)])
    lq = torch.log_softmax(teacher_logits, -1).gather(1, ids)
    if full_mass:
        lq = torch.log_softmax(lq, -1)
    targets = torch.randint(0, V, (n,), generator=g)
    targets[::3] = -100
    return (h, w, b), ids, lq.to(dtype), targets


def reference(student, ids, lq, targets, loss, beta, temperature, tail):
    p, q = ref.topk_bins(ref.logits(*student), ids, lq, tail=tail, temperature=temperature)
    return ref.bins_divergence(p, q, loss=loss, beta=beta).masked_fill(targets == -100, 0.0)


def grads(value, student, seed=1):
    upstream = torch.randn(value.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.autograd.grad((value * upstream.to(value.dtype)).sum(), student)


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize(("loss", "beta"), [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3)])
def test_matches_the_float64_reference_with_its_gradient(loss, beta, k, tail):
    student, ids, lq, targets = problem(k, seed=k)
    h, w, b = student
    value = topk_distillation(
        h,
        w,
        ids,
        lq,
        loss=loss,
        beta=beta,
        temperature=0.7,
        tail=tail,
        student_bias=b,
        targets=targets,
        chunk_size=4,
    )
    expected = reference(student, ids, lq, targets, loss, beta, temperature=0.7, tail=tail)
    torch.testing.assert_close(value, expected, rtol=1e-9, atol=1e-12)
    for got, want in zip(grads(value, student), grads(expected, student)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    if k == 1 and not tail:  # one renormalized bin on each side: always 0
        assert bool(value.eq(0).all())


@pytest.mark.parametrize("tail", [True, False])
def test_float32_within_1e5_and_independent_of_the_chunk_size(tail):
    student, ids, lq, targets = problem(8, dtype=torch.float32, n=17)
    h, w, b = student
    expected = reference(student, ids, lq, targets, "forward_kl", 0.5, temperature=2.0, tail=tail)
    results = []
    for chunk in (1, 5, None):
        value = topk_distillation(
            h, w, ids, lq, temperature=2.0, tail=tail, student_bias=b, targets=targets, chunk_size=chunk
        )
        results.append((value, *grads(value, student)))
    torch.testing.assert_close(results[0][0].double(), expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(results[0][1:], grads(expected, student)):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-6)
    for other in results[1:]:
        for got, want in zip(other, results[0]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_a_teacher_with_all_its_mass_on_the_ids_has_an_empty_tail():
    student, ids, lq, targets = problem(8, full_mass=True)
    h, w, b = student
    value = topk_distillation(h, w, ids, lq, loss="jsd", beta=0.3, student_bias=b, targets=targets)
    expected = reference(student, ids, lq, targets, "jsd", 0.3, temperature=1.0, tail=True)
    torch.testing.assert_close(value, expected, rtol=1e-9, atol=1e-12)
    assert bool(torch.isfinite(torch.cat([g.flatten() for g in grads(value, student)])).all())
    with pytest.raises(ValueError, match=r"reverse_kl with tail=True is infinite .* valid position"):
        topk_distillation(h, w, ids, lq, loss="reverse_kl", targets=targets)
    renormalized = topk_distillation(h, w, ids, lq, loss="reverse_kl", tail=False, targets=targets)
    assert bool(torch.isfinite(renormalized).all())


def test_the_teacher_fields_get_no_gradient_and_ignored_positions_are_not_checked():
    student, ids, lq, targets = problem(8)
    lq = lq.clone().requires_grad_()
    bad_ids, bad_lq = ids.clone(), lq.detach().clone()
    bad_ids[targets == -100] = V + 5  # out of range where nothing counts
    bad_lq[targets == -100] = 0.0  # a mass of k
    value = topk_distillation(student[0], student[1], bad_ids, bad_lq, targets=targets)
    value.sum().backward()
    assert bool(value[targets == -100].eq(0).all()) and lq.grad is None
    assert bool(student[0].grad[targets == -100].eq(0).all())


def test_bad_inputs_name_the_value_and_position():
    (h, w, _), ids, lq, _ = problem(4)
    repeated = ids.clone()
    repeated[2, 1] = repeated[2, 0]
    with pytest.raises(ValueError, match=r"teacher_topk_ids repeat an id at position \(2,\)"):
        topk_distillation(h, w, repeated, lq)
    out_of_range = ids.clone()
    out_of_range[3, 2] = V
    with pytest.raises(
        ValueError, match=r"teacher_topk_ids hold 40 at position \(3,\), out of range for V=40"
    ):
        topk_distillation(h, w, out_of_range, lq)
    positive = lq.clone()
    positive[5, 0] = 0.1
    with pytest.raises(ValueError, match=r"hold 0.1 > 0 at position \(5,\)"):
        topk_distillation(h, w, ids, positive)
    heavy = torch.full_like(lq, -0.5)
    with pytest.raises(ValueError, match=r"at position \(0,\) hold a mass Σ exp = 2.4261 > 1"):
        topk_distillation(h, w, ids, heavy)
    with pytest.raises(ValueError, match="teacher_topk_logprobs shape"):
        topk_distillation(h, w, ids, lq[:, :2])
    with pytest.raises(ConfigError, match="beta must be in"):
        topk_distillation(h, w, ids, lq, loss="jsd", beta=-0.1)
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        topk_distillation(h, w, ids, lq, temperature=0.0)


@pytest.mark.parametrize("tail", [True, False])
def test_return_top1_compares_the_students_argmax_with_the_teachers_first_id(tail):
    student, ids, lq, targets = problem(3, n=40)
    value, agree = topk_distillation(*student[:2], ids, lq, tail=tail, targets=targets, return_top1=True)
    z = ref.logits(*student[:2], None)
    best = z.argmax(-1) if tail else ids.gather(1, z.gather(1, ids).argmax(-1, keepdim=True))[:, 0]
    teacher_best = ids.gather(1, lq.argmax(-1, keepdim=True))[:, 0]
    assert torch.equal(agree, (best == teacher_best) & (targets != -100))
    assert torch.equal(value, topk_distillation(*student[:2], ids, lq, tail=tail, targets=targets))
