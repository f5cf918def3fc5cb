"""Distillation losses from materialized logits in float64, written again from their peers' formulas.

``generalized_jsd`` is TRL's ``GKDTrainer.generalized_jsd_loss`` (and Liger-Kernel's
``LigerFusedLinearJSDFunction.distillation_loss_fn``) per token, before their reduction: both logits divided
by the temperature, ``log_softmax``; ``β = 0``: ``kl_div(student, teacher)`` = KL(teacher ‖ student);
``β = 1``: ``kl_div(teacher, student)`` = KL(student ‖ teacher); otherwise the mixture's log-probabilities
``logsumexp([log p_s + log(1 − β), log p_t + log β])`` and ``β kl_div(m, teacher) + (1 − β) kl_div(m,
student)``, with ``kl_div(input, target, log_target=True) = Σ e^target (target − input)``.

``topk_bins`` is the top-k comparison of TRL's server distillation, from the student's full softmax:
the ``k`` probabilities and ``1 − Σ`` of each model as a tail bin, or both renormalized over the ids.
"""

from __future__ import annotations

import math

import torch


def kl_div(input_log: torch.Tensor, target_log: torch.Tensor) -> torch.Tensor:
    """``F.kl_div(input, target, reduction="none", log_target=True).sum(-1)``."""
    return (target_log.exp() * (target_log - input_log)).sum(-1)


def logits(hidden, weight, bias):
    z = hidden.double() @ weight.double().T
    return z if bias is None else z + bias.double()


def generalized_jsd(student_logits, teacher_logits, beta: float, temperature: float) -> torch.Tensor:
    """Per-token generalized JSD of TRL (β = 0: forward KL, β = 1: reverse KL)."""
    lp = torch.log_softmax(student_logits / temperature, -1)
    lq = torch.log_softmax(teacher_logits / temperature, -1)
    if beta == 0:
        return kl_div(lp, lq)
    if beta == 1:
        return kl_div(lq, lp)
    lm = torch.logsumexp(torch.stack([lp + math.log(1 - beta), lq + math.log(beta)]), dim=0)
    return beta * kl_div(lm, lq) + (1 - beta) * kl_div(lm, lp)


def divergence(student_logits, teacher_logits, loss: str, beta: float, temperature: float) -> torch.Tensor:
    """``forward_kl`` = ``generalized_jsd`` at β = 0, ``reverse_kl`` at β = 1, ``jsd`` at ``beta``."""
    beta = {"forward_kl": 0.0, "reverse_kl": 1.0}.get(loss, beta)
    return generalized_jsd(student_logits, teacher_logits, beta=beta, temperature=temperature)


def bins_divergence(p: torch.Tensor, q: torch.Tensor, loss: str, beta: float) -> torch.Tensor:
    """The divergence between two distributions over bins, given as probabilities (0 · log 0 = 0)."""

    def kl(a, b):
        return torch.where(a > 0, a * (a.log() - b.log()), 0.0).sum(-1)

    beta = {"forward_kl": 0.0, "reverse_kl": 1.0}.get(loss, beta)
    if beta == 0:
        return kl(q, p)
    if beta == 1:
        return kl(p, q)
    m = (1 - beta) * p + beta * q
    return beta * kl(q, m) + (1 - beta) * kl(p, m)


def topk_bins(student_logits, ids, teacher_logprobs, tail: bool, temperature: float):
    """``(p_bins, q_bins)``: the student's and the teacher's probabilities over the ids (+ the tail)."""
    p = torch.softmax(student_logits / temperature, -1).gather(-1, ids)
    q = teacher_logprobs.double().exp()
    if tail:
        return (
            torch.cat([p, 1 - p.sum(-1, keepdim=True)], -1),
            torch.cat([q, (1 - q.sum(-1, keepdim=True)).clamp_min(0)], -1),
        )
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
