"""The preference losses against Liger-Kernel's chunked ones (``liger_kernel.chunked_loss``, pure torch on
CPU) where they compute the same thing: the same hidden states and output projections, our sequence
values from the fused head (`linear_logprobs`) into `dpo_loss`/`cpo_loss`/`simpo_loss`/`orpo_loss`/
`kto_loss`, Liger's fused loss; the loss, its gradients with respect to the hidden states and the
projection, and the rewards agree to float32 precision (Liger computes its log-softmax in float32).

What is the same: Liger averages each loss over the pairs (sequences for KTO) of the call and its NLL term
over the chosen target tokens, as TRL does within a micro-batch. What Liger does not have, and is
therefore compared with TRL's formulas only (`test_preference_dpo`, `test_preference`): DPO's ``ipo``,
``aot``, ``aot_unpaired``, ``sft`` and ``sigmoid_norm`` types, f-divergences, LD-DPO, WPO weights,
several loss types at once, precomputed references; CPO's ``hinge``/``ipo`` types and AlphaPO; KTO's
``apo_zero_unpaired``, its desirable/undesirable weights and the clamp of the KL estimate (Liger takes the
estimate as given).
"""

from __future__ import annotations

import pytest
import torch

from lit_losses import cpo_loss, dpo_loss, kto_loss, linear_logprobs, orpo_loss, simpo_loss
from lit_losses.objectives import sequence_logps

chunked_loss = pytest.importorskip("liger_kernel.chunked_loss")

TOL = {"rtol": 2e-5, "atol": 2e-6}
V, H = 23, 16


def make_rows(rows: int, shared_prompts: bool, seed: int) -> dict:
    """Leaf hidden states and projection (float32), a reference near them, next-token labels of the
    completions (``labels``) and of prompt + completion (``all_labels``), ``[rows, T]``."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, 4, (rows // 2 if shared_prompts else rows,), generator=g)
    prompts = prompts.repeat(2) if shared_prompts else prompts
    completions = torch.randint(1, 6, (rows,), generator=g)
    T = int((prompts + completions).max())
    position = torch.arange(T)[None]
    tokens = torch.randint(0, V, (rows, T), generator=g)
    ends = (prompts + completions - 1)[:, None]  # labels at t predict t + 1: positions < length - 1
    labels = torch.where((position >= (prompts - 1)[:, None]) & (position < ends), tokens, -100)
    all_labels = torch.where(position < ends, tokens, -100)
    hidden = torch.randn(rows, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    return {
        "hidden": hidden.requires_grad_(),
        "weight": weight.requires_grad_(),
        "ref_hidden": hidden.detach() + 0.3 * torch.randn(rows, T, H, generator=g),
        "ref_weight": weight.detach() + 0.05 * torch.randn(V, H, generator=g),
        "labels": labels,
        "all_labels": all_labels,
    }


def logps(case: dict, labels: torch.Tensor, reduction: str = "sum", ref: bool = False) -> torch.Tensor:
    """Our per-sequence values from the fused head."""
    hidden, weight = (case["ref_hidden"], case["ref_weight"]) if ref else (case["hidden"], case["weight"])
    with torch.set_grad_enabled(not ref):
        out = linear_logprobs(hidden, weight, labels, backend="chunked", chunk_size=8)
        return sequence_logps(out.logprobs, labels != -100, reduction=reduction)


def assert_same(ours: torch.Tensor, theirs: torch.Tensor, case: dict) -> None:
    leaves = [case["hidden"], case["weight"]]
    grads = torch.autograd.grad(ours, leaves, retain_graph=True)
    liger_grads = torch.autograd.grad(theirs, leaves, retain_graph=True)
    torch.testing.assert_close(ours, theirs, **TOL)
    for grad, liger_grad in zip(grads, liger_grads):
        torch.testing.assert_close(grad, liger_grad, **TOL)
    assert float(liger_grads[1].abs().max()) > 1e-4


def nll_values(case: dict, labels: torch.Tensor) -> dict:
    mask = labels != -100
    pairs = labels.shape[0] // 2
    return {"chosen_nll": -logps(case, labels)[:pairs], "chosen_nll_tokens": mask.sum(-1)[:pairs]}


DPO_CASES = [
    ("sigmoid", 0.1, 0.0),
    ("sigmoid", 1.0, 0.0),
    ("hinge", 0.5, 0.0),
    ("exo_pair", 0.5, 1e-3),
    ("nca_pair", 0.5, 0.0),
    ("robust", 0.5, 0.2),
    ("bco_pair", 0.5, 0.0),
    ("sppo_hard", 0.5, 0.0),
    ("apo_zero", 1.0, 0.0),
    ("apo_down", 1.0, 0.0),
    ("discopop", 0.5, 0.0),
]


@pytest.mark.parametrize(("loss_type", "beta", "label_smoothing"), DPO_CASES, ids=[c[0] for c in DPO_CASES])
def test_dpo_agrees_with_liger(loss_type, beta, label_smoothing):
    case = make_rows(8, shared_prompts=True, seed=len(loss_type))
    chosen, rejected = logps(case, case["labels"]).chunk(2)
    ref_chosen, ref_rejected = logps(case, case["labels"], ref=True).chunk(2)
    out = dpo_loss(
        chosen,
        rejected,
        ref_chosen,
        ref_rejected,
        loss_type=loss_type,
        beta=beta,
        label_smoothing=label_smoothing,
    )
    liger = chunked_loss.LigerFusedLinearDPOLoss(
        beta=beta, loss_type=loss_type, label_smoothing=label_smoothing, compiled=False
    )
    loss, metrics = liger(
        case["weight"], case["hidden"], case["labels"], None, case["ref_hidden"], case["ref_weight"]
    )
    assert_same(out.losses.mean(), loss, case)
    torch.testing.assert_close(out.chosen_rewards, metrics[5], **TOL)
    torch.testing.assert_close(out.rejected_rewards, metrics[6], **TOL)


@pytest.mark.parametrize(("cpo_alpha", "label_smoothing"), [(1.0, 0.0), (0.5, 0.1), (0.0, 0.0)])
def test_cpo_agrees_with_liger(cpo_alpha, label_smoothing):
    case = make_rows(8, shared_prompts=True, seed=3)
    chosen, rejected = logps(case, case["labels"]).chunk(2)
    out = cpo_loss(
        chosen,
        rejected,
        beta=0.5,
        label_smoothing=label_smoothing,
        cpo_alpha=cpo_alpha,
        **nll_values(case, case["labels"]),
    )
    liger = chunked_loss.LigerFusedLinearCPOLoss(
        beta=0.5,
        alpha=cpo_alpha,
        label_smoothing=label_smoothing,
        compute_nll_loss=cpo_alpha != 0,
        compiled=False,
    )
    loss, metrics = liger(case["weight"], case["hidden"], case["labels"])
    assert_same(out.losses.mean(), loss, case)
    torch.testing.assert_close(out.chosen_rewards, metrics[5], **TOL)


@pytest.mark.parametrize(("cpo_alpha", "gamma"), [(0.0, 0.5), (0.0, 1.5), (1.0, 0.5)])
def test_simpo_agrees_with_liger(cpo_alpha, gamma):
    case = make_rows(8, shared_prompts=True, seed=4)
    chosen, rejected = logps(case, case["labels"], reduction="mean").chunk(2)
    nll = nll_values(case, case["labels"]) if cpo_alpha else {}
    out = simpo_loss(chosen, rejected, beta=2.0, gamma=gamma, label_smoothing=0.1, cpo_alpha=cpo_alpha, **nll)
    liger = chunked_loss.LigerFusedLinearSimPOLoss(
        beta=2.0,
        gamma=gamma,
        label_smoothing=0.1,
        alpha=cpo_alpha,
        compute_nll_loss=cpo_alpha != 0,
        compiled=False,
    )
    loss, metrics = liger(case["weight"], case["hidden"], case["labels"])
    assert_same(out.losses.mean(), loss, case)
    torch.testing.assert_close(out.rejected_rewards, metrics[6], **TOL)


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_orpo_agrees_with_liger_given_trl_s_nll_target(beta):
    """Liger's NLL takes TRL's target (prompt and completion) through ``nll_target``."""
    case = make_rows(8, shared_prompts=True, seed=5)
    chosen, rejected = logps(case, case["labels"], reduction="mean").chunk(2)
    out = orpo_loss(chosen, rejected, beta=beta, **nll_values(case, case["all_labels"]))
    liger = chunked_loss.LigerFusedLinearORPOLoss(beta=beta, compute_nll_loss=True, compiled=False)
    loss, metrics = liger(case["weight"], case["hidden"], case["labels"], nll_target=case["all_labels"])
    assert_same(out.losses.mean(), loss, case)
    torch.testing.assert_close(out.log_odds_ratio.mean(), metrics[7], **TOL)
    torch.testing.assert_close(out.log_odds_chosen.mean(), metrics[8], **TOL)


@pytest.mark.parametrize("kl", [0.0, 0.4])
def test_kto_agrees_with_liger(kl):
    case = make_rows(6, shared_prompts=False, seed=6)
    label = torch.tensor([True, False, True, True, False, False])
    ours = logps(case, case["labels"])
    ref = logps(case, case["labels"], ref=True)
    out = kto_loss(ours, ref, label, beta=0.5, kl=kl)
    liger = chunked_loss.LigerFusedLinearKTOLoss(beta=0.5, use_ref_model=True, compiled=False)
    loss, metrics = liger(
        case["hidden"],
        case["weight"],
        case["labels"],
        preference_labels=label,
        ref_input=case["ref_hidden"],
        ref_weight=case["ref_weight"],
        kl=torch.tensor(kl),
    )
    assert_same(out.losses.mean(), loss, case)
    torch.testing.assert_close(out.rewards[label].sum(), metrics[-2], **TOL)
    torch.testing.assert_close(out.rewards[~label].sum(), metrics[-1], **TOL)
