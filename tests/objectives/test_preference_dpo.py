"""`dpo_loss` through `DPOPreset` against TRL's ``DPOTrainer._compute_loss`` (`preference_reference`,
float64): for every ``loss_type``, several ``beta``/``label_smoothing`` values and the options (f-DPO,
LD-DPO, WPO, MPO combinations, reference-free, precomputed references), the loss, its gradient with
respect to the policy's logits, the rewards and the metrics TRL logs agree to 1e-10."""

from __future__ import annotations

import dataclasses
from typing import get_args

import pytest
import torch

from lit_losses import DPOPreset, dpo_loss
from lit_losses.objectives import DPOLossType, sequence_logps, wpo_weights
from tests.objectives import preference_reference as trl
from tests.objectives.preference_cases import log_sum_sq_probs, next_token_labels, paired_case, token_logps

TOL = {"rtol": 1e-10, "atol": 1e-12}
BETAS = (0.1, 0.7)
SMOOTHING = {
    "exo_pair": (1e-3, 0.2),
    "robust": (0.0, 0.1, 0.3),
    "aot": (0.0, 0.2),
    "aot_unpaired": (0.0, 0.2),
}

CASES = {
    f"{name}-beta{beta}-ls{ls}": {"loss_type": name, "beta": beta, "label_smoothing": ls}
    for name in get_args(DPOLossType)
    for beta in BETAS
    for ls in SMOOTHING.get(name, (0.0,))
}
SCORED = ("sigmoid", "hinge", "ipo", "exo_pair", "robust", "discopop", "sigmoid_norm")  # TRL's f-DPO types
F_DIVERGENCES = {
    "forward_kl": {"f_divergence_type": "forward_kl"},
    "js": {"f_divergence_type": "js_divergence"},
    "alpha0.5": {"f_divergence_type": "alpha_divergence"},
    "alpha1.5": {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 1.5},
    "alpha1": {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 1.0},
}
for name in SCORED:
    for key, fields in F_DIVERGENCES.items():
        smoothing = {"label_smoothing": 0.1} if name in ("robust", "exo_pair") else {}
        CASES[f"{name}-f_{key}"] = {"loss_type": name, "beta": 0.5, **smoothing, **fields}
CASES |= {
    "sigmoid-ld0.5": {"loss_type": "sigmoid", "ld_alpha": 0.5},
    "ipo-ld0": {"loss_type": "ipo", "ld_alpha": 0.0, "beta": 0.5},
    "aot-ld0.3": {"loss_type": "aot", "ld_alpha": 0.3},
    "sigmoid-wpo": {"loss_type": "sigmoid", "use_weighting": True, "beta": 0.5},
    "ipo-wpo": {"loss_type": "ipo", "use_weighting": True},
    "bco_pair-wpo-ld": {"loss_type": "bco_pair", "use_weighting": True, "ld_alpha": 0.5},
    "mpo": {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
    "rpo": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.3], "beta": 0.3},
    "ipo+sft-unweighted": {"loss_type": ["ipo", "sft"]},
    "discopop-tau0.2": {"loss_type": "discopop", "discopop_tau": 0.2, "beta": 0.5},
    "sigmoid-reference_free": {"loss_type": "sigmoid", "reference_free": True},
    "apo_zero-reference_free": {"loss_type": "apo_zero", "reference_free": True, "beta": 0.5},
    "sigmoid-precomputed": {"loss_type": "sigmoid", "precompute_ref_log_probs": True},
    "robust-precomputed-ld": {
        "loss_type": "robust",
        "label_smoothing": 0.2,
        "precompute_ref_log_probs": True,
        "ld_alpha": 0.5,
    },
}


def trl_config(fields: dict) -> dict:
    types = fields["loss_type"]
    return {**fields, "loss_type": [types] if isinstance(types, str) else list(types)}


def precomputed_reference(case: dict, preset: DPOPreset):
    """The reference's sequence values as they come with the data (from the reference logits)."""
    labels = next_token_labels(case["input_ids"], case["completion_mask"])
    with torch.no_grad():
        values = preset.sequence_logps(token_logps(case["ref_logits"], labels), labels != -100)
    return values.chunk(2)


def ours(case: dict, preset: DPOPreset):
    """`DPOPreset.loss` on the values a module forms from per-token log-probabilities: `DPOLoss`."""
    labels = next_token_labels(case["input_ids"], case["completion_mask"])
    mask = labels != -100
    lp = token_logps(case["logits"], labels)
    chosen, rejected = preset.sequence_logps(lp, mask).chunk(2)
    refs = precomputed_reference(case, preset) if preset.needs_reference else (None, None)
    values = {}
    chosen_lengths, rejected_lengths = mask.sum(-1).chunk(2)
    if preset.needs_lengths:
        values |= {"chosen_lengths": chosen_lengths, "rejected_lengths": rejected_lengths}
    if preset.nll_tokens == "completion":
        values |= {"chosen_nll": -sequence_logps(lp, mask).chunk(2)[0], "chosen_nll_tokens": chosen_lengths}
    if preset.needs_wpo_weights:
        chosen_w, rejected_w = wpo_weights(lp, log_sum_sq_probs(case["logits"]), mask).chunk(2)
        values |= {"chosen_weights": chosen_w, "rejected_weights": rejected_w}
    return preset.loss(chosen, rejected, *refs, **values)


def theirs(case: dict, preset: DPOPreset, fields: dict):
    if preset.reference_free:
        ref_logits, ref_logps = None, None
    elif preset.precompute_ref_log_probs:
        ref_logits, ref_logps = None, precomputed_reference(case, preset)
    else:
        ref_logits, ref_logps = case["ref_logits"], None
    return trl.trl_dpo(
        case["logits"], ref_logits, case["input_ids"], case["completion_mask"], trl_config(fields), ref_logps
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_loss_type_is_trl_s_loss_gradient_and_rewards(name):
    fields = CASES[name]
    preset = DPOPreset(**fields)
    case = paired_case(seed=len(name))
    out = ours(case, preset)
    loss = out.losses.mean()
    (grad,) = torch.autograd.grad(loss, case["logits"])
    reference, metrics = theirs(case, preset, fields)
    (ref_grad,) = torch.autograd.grad(reference, case["logits"])
    torch.testing.assert_close(loss, reference, **TOL)
    torch.testing.assert_close(grad, ref_grad, **TOL)
    assert float(ref_grad.abs().max()) > 1e-6  # a gradient the comparison sees
    torch.testing.assert_close(out.chosen_rewards, metrics["chosen_rewards"], **TOL)
    torch.testing.assert_close(out.rejected_rewards, metrics["rejected_rewards"], **TOL)
    margins = out.chosen_rewards - out.rejected_rewards
    torch.testing.assert_close(margins.mean(), metrics["rewards/margins"], **TOL)
    accuracy = (out.chosen_rewards > out.rejected_rewards).double().mean()
    torch.testing.assert_close(accuracy, metrics["rewards/accuracies"], **TOL)
    assert not out.chosen_rewards.requires_grad and not out.rejected_rewards.requires_grad


def test_the_cases_cover_every_loss_type_and_field():
    types = {t for fields in CASES.values() for t in trl_config(fields)["loss_type"]}
    assert types == set(get_args(DPOLossType))
    fields = {key for c in CASES.values() for key in c}
    assert fields == {f.name for f in dataclasses.fields(DPOPreset)}


def test_sft_is_one_token_mean_over_the_chosen_completions_whatever_the_split():
    """The NLL shares of two halves of a batch, averaged over all pairs with the batch's tokens per pair,
    are TRL's ``sft`` loss of the whole batch (the property a global denominator needs)."""
    case = paired_case(pairs=6, seed=3)
    labels = next_token_labels(case["input_ids"], case["completion_mask"])
    mask = labels != -100
    lp = token_logps(case["logits"], labels)
    nll = -sequence_logps(lp, mask).chunk(2)[0]
    tokens = mask.sum(-1).chunk(2)[0]
    per_pair = tokens.double().mean()
    zeros = torch.zeros(6, dtype=torch.float64)
    halves = [
        dpo_loss(
            zeros[s], zeros[s], None, None, loss_type="sft", chosen_nll=nll[s], chosen_nll_tokens=per_pair
        ).losses.sum()
        for s in (slice(0, 2), slice(2, 6))
    ]
    whole, _ = trl.trl_dpo(
        case["logits"], None, case["input_ids"], case["completion_mask"], {"loss_type": ["sft"]}
    )
    torch.testing.assert_close(sum(halves) / 6, whole, **TOL)


BAD_CALLS = [
    ({"loss_type": "sigmiod"}, "loss_type 'sigmiod' is not one of"),
    ({"loss_type": ["sigmoid", "hing"]}, "did you mean 'hinge'?"),
    ({"loss_type": []}, "loss_type is empty"),
    ({"beta": 0.0}, "beta must be a finite number > 0, got 0.0"),
    ({"beta": float("nan")}, "beta must be a finite number > 0"),
    ({"loss_type": "robust", "label_smoothing": 0.5}, "label_smoothing must lie in [0, 0.5)"),
    ({"loss_type": "exo_pair"}, "label_smoothing must be > 0 with loss_type 'exo_pair'"),
    ({"loss_type": ["sigmoid", "hinge"], "loss_weights": [1.0]}, "loss_weights has 1 weights for 2"),
    ({"loss_type": "ipo"}, "loss_type 'ipo' needs chosen_lengths"),
    ({"loss_type": "sft"}, "loss_type 'sft' needs chosen_nll"),
    ({"loss_type": "discopop", "discopop_tau": 0.0}, "discopop_tau must be a finite number > 0"),
    ({"f_divergence_type": "kl"}, "f_divergence_type 'kl' is not one of"),
    ({"loss_type": "bco_pair", "f_divergence_type": "forward_kl"}, "('bco_pair',) has no f-divergence"),
    (
        {"loss_type": "aot", "chosen_weights": torch.ones(3), "rejected_weights": torch.ones(3)},
        "do not apply to 'aot'",
    ),
    ({"chosen_weights": torch.ones(3)}, "give both chosen_weights and rejected_weights"),
    ({"chosen_lengths": torch.ones(4)}, "chosen_lengths has shape (4,), chosen_logps (3,)"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_CALLS, ids=[m for _, m in BAD_CALLS])
def test_bad_arguments_are_one_clear_error(kwargs, message):
    x = torch.zeros(3)
    with pytest.raises(ValueError) as info:
        dpo_loss(x, x, x, x, **kwargs)
    assert message in str(info.value)


def test_one_reference_without_the_other_is_refused():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="both reference log-probabilities, or neither"):
        dpo_loss(x, x, x, None)
