"""`cpo_loss`/`simpo_loss` (`CPOPreset`), `orpo_loss` (`ORPOPreset`) and `kto_loss` (`KTOPreset`) against
TRL's ``CPOTrainer``, ``ORPOTrainer`` and ``KTOTrainer`` (`preference_reference`, float64): the loss, its
gradient with respect to the policy's logits, the rewards and the metrics TRL logs agree to 1e-10."""

from __future__ import annotations

import pytest
import torch

from lit_losses import CPOPreset, KTOPreset, ORPOPreset, cpo_loss, kto_loss, orpo_loss, simpo_loss
from lit_losses.objectives import sequence_logps
from tests.objectives import preference_reference as trl
from tests.objectives.preference_cases import next_token_labels, paired_case, token_logps, unpaired_case

TOL = {"rtol": 1e-10, "atol": 1e-12}


def assert_same_loss_and_gradient(loss, reference, leaf):
    (grad,) = torch.autograd.grad(loss, leaf, retain_graph=True)
    (ref_grad,) = torch.autograd.grad(reference, leaf, retain_graph=True)
    torch.testing.assert_close(loss, reference, **TOL)
    torch.testing.assert_close(grad, ref_grad, **TOL)
    assert float(ref_grad.abs().max()) > 1e-6  # a gradient the comparison sees


def trl_labels(case):
    """CPO's/ORPO's concatenated labels: the ids of completion tokens, ``-100`` elsewhere."""
    return torch.where(case["completion_mask"].bool(), case["input_ids"], -100)


CPO_CASES = {
    f"{loss_type}-beta{beta}-alpha{alpha}-cpo_alpha{cpo_alpha}": {
        "loss_type": loss_type,
        "beta": beta,
        "alpha": alpha,
        "cpo_alpha": cpo_alpha,
    }
    for loss_type in ("sigmoid", "hinge", "ipo", "simpo")
    for beta in (0.1, 1.0)
    for alpha in (0.0, 0.3)
    for cpo_alpha in (1.0, 0.0)
}
CPO_CASES |= {
    "sigmoid-smoothing": {"loss_type": "sigmoid", "label_smoothing": 0.2, "beta": 0.5},
    "simpo-gamma-smoothing": {"loss_type": "simpo", "simpo_gamma": 1.2, "label_smoothing": 0.1, "beta": 2.0},
    "cpo-simpo-weighted_nll": {"loss_type": "simpo", "cpo_alpha": 0.5, "beta": 2.5, "simpo_gamma": 0.3},
    "alphapo": {"loss_type": "alphapo", "alpha": 0.25, "beta": 2.0, "simpo_gamma": 0.8},
    "default": {},
}


def ours_cpo(case, preset):
    labels = next_token_labels(case["input_ids"], case["completion_mask"])
    mask = labels != -100
    lp = token_logps(case["logits"], labels)
    chosen, rejected = preset.sequence_logps(lp, mask).chunk(2)
    values = {}
    if preset.nll_tokens == "completion":
        values = {
            "chosen_nll": -sequence_logps(lp, mask).chunk(2)[0],
            "chosen_nll_tokens": mask.sum(-1).chunk(2)[0],
        }
    return preset.loss(chosen, rejected, **values)


@pytest.mark.parametrize("name", sorted(CPO_CASES))
def test_cpo_is_trl_s_loss_gradient_and_metrics(name):
    fields = CPO_CASES[name]
    preset = CPOPreset(**fields)
    case = paired_case(seed=len(name))
    out = ours_cpo(case, preset)
    trl_fields = {**fields, "loss_type": preset.cpo_loss_type, "cpo_alpha": preset.nll_weight}
    reference, metrics = trl.trl_cpo(case["logits"], trl_labels(case), trl_fields)
    assert_same_loss_and_gradient(out.losses.mean(), reference, case["logits"])
    torch.testing.assert_close(out.chosen_rewards, metrics["chosen_rewards"], **TOL)
    torch.testing.assert_close(out.rejected_rewards, metrics["rejected_rewards"], **TOL)
    torch.testing.assert_close(out.nll_loss.mean(), metrics["nll_loss"].to(out.nll_loss), **TOL)


def test_simpo_loss_is_cpo_s_simpo_without_nll():
    case = paired_case(seed=11)
    preset = CPOPreset(loss_type="simpo", cpo_alpha=0.0, beta=2.0, simpo_gamma=1.0, label_smoothing=0.1)
    labels = next_token_labels(case["input_ids"], case["completion_mask"])
    mask = labels != -100
    chosen, rejected = sequence_logps(token_logps(case["logits"], labels), mask, reduction="mean").chunk(2)
    out = simpo_loss(chosen, rejected, beta=2.0, gamma=1.0, label_smoothing=0.1)
    reference, _ = trl.trl_cpo(case["logits"], trl_labels(case), {**preset.loss_kwargs()})
    assert_same_loss_and_gradient(out.losses.mean(), reference, case["logits"])


@pytest.mark.parametrize("beta", [0.1, 0.5, 1.0])
def test_orpo_is_trl_s_loss_gradient_and_metrics(beta):
    """ORPO's NLL covers the whole chosen sequence (prompt and completion), its odds ratio the completion."""
    preset = ORPOPreset(beta=beta)
    case = paired_case(seed=int(beta * 10))
    labels = next_token_labels(case["input_ids"], case["completion_mask"])
    mask = labels != -100
    chosen, rejected = preset.sequence_logps(token_logps(case["logits"], labels), mask).chunk(2)
    assert preset.nll_tokens == "prompt_and_completion"
    every = next_token_labels(case["input_ids"], case["attention_mask"])
    nll = -sequence_logps(token_logps(case["logits"], every), every != -100).chunk(2)[0]
    nll_tokens = (every != -100).sum(-1).chunk(2)[0]
    out = preset.loss(chosen, rejected, chosen_nll=nll, chosen_nll_tokens=nll_tokens)
    reference, metrics = trl.trl_orpo(
        case["logits"], trl_labels(case), case["input_ids"], case["attention_mask"], beta
    )
    assert_same_loss_and_gradient(out.losses.mean(), reference, case["logits"])
    for key in ("chosen_rewards", "rejected_rewards"):
        torch.testing.assert_close(getattr(out, key), metrics[key], **TOL)
    for key in ("nll_loss", "log_odds_ratio", "log_odds_chosen"):
        torch.testing.assert_close(getattr(out, key).mean(), metrics[key], **TOL)


KTO_CASES = {
    f"{loss_type}-beta{beta}-weights{weights}": {
        "loss_type": loss_type,
        "beta": beta,
        "desirable_weight": weights[0],
        "undesirable_weight": weights[1],
    }
    for loss_type in ("kto", "apo_zero_unpaired")
    for beta in (0.1, 0.5)
    for weights in ((1.0, 1.0), (1.0, 1.33), (0.7, 1.0))
}


def ours_kto(case, preset, kl_from="rows"):
    batch = case["batch"]
    labels = next_token_labels(batch["input_ids"], batch["completion_mask"])
    mask = labels != -100
    logps = preset.sequence_logps(token_logps(case["logits"], labels), mask)
    with torch.no_grad():
        ref = preset.sequence_logps(token_logps(case["ref_logits"], labels), mask)
    values = {}
    if preset.needs_kl_rows:
        kl_labels = next_token_labels(batch["KL_input_ids"], batch["KL_completion_mask"])
        with torch.no_grad():
            kl_rows = preset.sequence_logps(token_logps(case["kl_logits"], kl_labels), kl_labels != -100)
            ref_kl_rows = preset.sequence_logps(
                token_logps(case["ref_kl_logits"], kl_labels), kl_labels != -100
            )
        if kl_from == "rows":
            values = {"kl_logps": kl_rows, "ref_kl_logps": ref_kl_rows}
        else:  # the estimate, as a module forms it from all-reduced sums and counts
            values = {"kl": (kl_rows - ref_kl_rows).sum() / len(kl_rows)}
    return preset.loss(logps, ref, batch["label"], **values), logps


@pytest.mark.parametrize("name", sorted(KTO_CASES))
def test_kto_is_trl_s_loss_gradient_and_metrics(name):
    preset = KTOPreset(**KTO_CASES[name])
    case = unpaired_case(seed=len(name))
    (out, logps), label = ours_kto(case, preset), case["batch"]["label"]
    assert 0 < int(label.sum()) < len(label)  # both kinds of records
    reference, metrics = trl.trl_kto(
        case["batch"],
        case["logits"],
        case["ref_logits"],
        case["kl_logits"],
        case["ref_kl_logits"],
        KTO_CASES[name],
    )
    assert_same_loss_and_gradient(out.losses.mean(), reference, case["logits"])
    torch.testing.assert_close(out.kl, metrics["kl"], **TOL)
    torch.testing.assert_close(out.rewards[label].mean(), metrics["rewards/chosen"], **TOL)
    torch.testing.assert_close(out.rewards[~label].mean(), metrics["rewards/rejected"], **TOL)
    torch.testing.assert_close(logps[label].mean(), metrics["logps/chosen"], **TOL)
    assert not out.rewards.requires_grad and not out.kl.requires_grad


@pytest.mark.parametrize("negative_kl", [False, True], ids=["kl>0", "kl<0-clamped"])
def test_kto_takes_the_kl_estimate_itself_and_clamps_it_at_zero(negative_kl):
    preset = KTOPreset(beta=0.5)
    case = unpaired_case(seed=5, negative_kl=negative_kl)
    out, _ = ours_kto(case, preset, kl_from="estimate")
    reference, metrics = trl.trl_kto(
        case["batch"],
        case["logits"],
        case["ref_logits"],
        case["kl_logits"],
        case["ref_kl_logits"],
        {"beta": 0.5},
    )
    assert (float(metrics["kl"]) == 0.0) == negative_kl
    assert_same_loss_and_gradient(out.losses.mean(), reference, case["logits"])
    torch.testing.assert_close(out.kl, metrics["kl"], **TOL)


def test_kto_with_one_kind_of_record_only():
    """A micro-batch of desirable records only (TRL's empty rejected branch)."""
    preset = KTOPreset(beta=0.3)
    case = unpaired_case(records=4, seed=2, desirable=[True] * 4)
    out, _ = ours_kto(case, preset)
    reference, _ = trl.trl_kto(
        case["batch"],
        case["logits"],
        case["ref_logits"],
        case["kl_logits"],
        case["ref_kl_logits"],
        {"beta": 0.3},
    )
    assert_same_loss_and_gradient(out.losses.mean(), reference, case["logits"])


BAD_CALLS = [
    (lambda x: cpo_loss(x, x, loss_type="simpoo", cpo_alpha=0.0), "loss_type 'simpoo' is not one of"),
    (lambda x: cpo_loss(x, x), "cpo_alpha=1.0 needs chosen_nll and chosen_nll_tokens"),
    (lambda x: cpo_loss(x, x[:2], cpo_alpha=0.0), "cpo_loss takes one value per pair [P]"),
    (lambda x: simpo_loss(x, x, beta=-2.0), "beta must be a finite number > 0, got -2.0"),
    (lambda x: simpo_loss(x, x, label_smoothing=0.7), "label_smoothing must lie in [0, 0.5)"),
    (
        lambda x: orpo_loss(x, x, chosen_nll=x, chosen_nll_tokens=torch.ones(2)),
        "chosen_nll_tokens has shape (2,); expected one count per pair (3,) or one number",
    ),
    (lambda x: orpo_loss(x, x, chosen_nll=x, chosen_nll_tokens=0), "at least one token per pair"),
    (lambda x: kto_loss(x, x, x > 0), "loss_type 'kto' needs kl_logps and ref_kl_logps"),
    (lambda x: kto_loss(x, x, x > 0, kl=0.1, kl_logps=x), "give kl or (kl_logps, ref_kl_logps), not both"),
    (lambda x: kto_loss(x, x, x > 0, loss_type="apo_zero", kl=0.1), "did you mean 'apo_zero_unpaired'?"),
    (lambda x: kto_loss(x, x, x > 0, kl=0.1, undesirable_weight=0), "undesirable_weight must be a finite"),
    (lambda x: kto_loss(x, x[:2], x > 0, kl=0.1), "kto_loss takes one value per sequence [B]"),
]


@pytest.mark.parametrize(("call", "message"), BAD_CALLS, ids=[m for _, m in BAD_CALLS])
def test_bad_arguments_are_one_clear_error(call, message):
    with pytest.raises(ValueError) as info:
        call(-torch.ones(3))
    assert message in str(info.value)
