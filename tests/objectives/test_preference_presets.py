"""The preference presets (``model.dpo``, ``model.kto``, ``model.cpo``, ``model.orpo``): each bad field is one
`ConfigError` naming ``model.<trainer>.<field>``; what each preset tells the module it reads."""

from __future__ import annotations

import pytest
import torch

from lit_losses import ConfigError, CPOPreset, DPOPreset, KTOPreset, ORPOPreset
from lit_losses.objectives import PREFERENCE_PRESETS, ld_sequence_logps, select_preset, sequence_logps

BAD = [
    (DPOPreset, {"loss_type": "sigmod"}, "model.dpo.loss_type 'sigmod' is not one of"),
    (DPOPreset, {"loss_type": ["ipo", "aot_unpared"]}, "did you mean 'aot_unpaired'?"),
    (DPOPreset, {"loss_type": []}, "model.dpo.loss_type is empty"),
    (DPOPreset, {"beta": 0.0}, "model.dpo.beta must be a finite number > 0, got 0.0"),
    (DPOPreset, {"beta": -0.1}, "model.dpo.beta must be a finite number > 0, got -0.1"),
    (
        DPOPreset,
        {"loss_type": "robust", "label_smoothing": 0.5},
        "model.dpo.label_smoothing must lie in [0, 0.5)",
    ),
    (DPOPreset, {"loss_type": "robust", "label_smoothing": -0.1}, "model.dpo.label_smoothing must lie in"),
    (DPOPreset, {"loss_type": "exo_pair"}, "model.dpo.label_smoothing must be > 0 with loss_type 'exo_pair'"),
    (
        DPOPreset,
        {"label_smoothing": 0.1},
        "model.dpo.label_smoothing is set but loss_type ('sigmoid',) does not",
    ),
    (
        DPOPreset,
        {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]},
        "model.dpo.loss_weights=[1.0]: one finite weight per loss type, 2 for ('sigmoid', 'sft')",
    ),
    (DPOPreset, {"loss_weights": [float("nan")]}, "model.dpo.loss_weights=[nan]: one finite weight"),
    (DPOPreset, {"discopop_tau": 0.1}, "model.dpo.discopop_tau is set but loss_type ('sigmoid',) does not"),
    (
        DPOPreset,
        {"loss_type": "discopop", "discopop_tau": 0.0},
        "model.dpo.discopop_tau must be a finite number",
    ),
    (DPOPreset, {"f_divergence_type": "reverse"}, "model.dpo.f_divergence_type 'reverse' is not one of"),
    (
        DPOPreset,
        {"loss_type": "sft", "f_divergence_type": "js_divergence"},
        "model.dpo.f_divergence_type is set but loss_type ('sft',) reads no f-divergence scores",
    ),
    (
        DPOPreset,
        {"loss_type": ["sigmoid", "nca_pair"], "f_divergence_type": "forward_kl"},
        "model.dpo.f_divergence_type='forward_kl' applies only to loss types",
    ),
    (
        DPOPreset,
        {"f_alpha_divergence_coef": 0.3},
        "model.dpo.f_alpha_divergence_coef is set but only f_divergence_type 'alpha_divergence' reads it",
    ),
    (DPOPreset, {"ld_alpha": 1.5}, "model.dpo.ld_alpha must lie in [0, 1] (or be null), got 1.5"),
    (
        DPOPreset,
        {"loss_type": "aot", "use_weighting": True},
        "model.dpo.use_weighting is set but WPO weights do not apply to loss_type ('aot',)",
    ),
    (DPOPreset, {"loss_type": ["sigmoid", "sft"], "use_weighting": True}, "model.dpo.use_weighting is set"),
    (
        DPOPreset,
        {"reference_free": True, "precompute_ref_log_probs": True},
        "model.dpo.precompute_ref_log_probs=True reads reference log-probabilities that model.dpo.reference_",
    ),
    (DPOPreset, {"reference_free": "yes"}, "model.dpo.reference_free must be true or false, got 'yes'"),
    (
        KTOPreset,
        {"loss_type": "kto_pair"},
        "model.kto.loss_type 'kto_pair' is not one of ('kto', 'apo_zero_unpaired')",
    ),
    (KTOPreset, {"beta": 0}, "model.kto.beta must be a finite number > 0, got 0"),
    (KTOPreset, {"desirable_weight": 0.0}, "model.kto.desirable_weight must be a finite number > 0, got 0.0"),
    (KTOPreset, {"undesirable_weight": -1.0}, "model.kto.undesirable_weight must be a finite number > 0"),
    (CPOPreset, {"loss_type": "simp"}, "model.cpo.loss_type 'simp' is not one of"),
    (CPOPreset, {"beta": float("inf")}, "model.cpo.beta must be a finite number > 0, got inf"),
    (CPOPreset, {"label_smoothing": 0.6}, "model.cpo.label_smoothing must lie in [0, 0.5)"),
    (
        CPOPreset,
        {"loss_type": "hinge", "label_smoothing": 0.1},
        "model.cpo.label_smoothing is set but loss_type",
    ),
    (CPOPreset, {"loss_type": "ipo", "simpo_gamma": 1.0}, "model.cpo.simpo_gamma is set but loss_type 'ipo'"),
    (
        CPOPreset,
        {"loss_type": "alphapo", "cpo_alpha": 1.0},
        "model.cpo.cpo_alpha is set but loss_type 'alphapo'",
    ),
    (CPOPreset, {"cpo_alpha": -1.0}, "model.cpo.cpo_alpha must be a finite number >= 0, got -1.0"),
    (CPOPreset, {"alpha": float("nan")}, "model.cpo.alpha must be a finite number, got nan"),
    (ORPOPreset, {"beta": 0.0}, "model.orpo.beta must be a finite number > 0, got 0.0"),
]


@pytest.mark.parametrize(("cls", "fields", "message"), BAD, ids=[m for _, _, m in BAD])
def test_each_bad_field_is_one_config_error_naming_it(cls, fields, message):
    with pytest.raises(ConfigError) as info:
        cls.coerce(fields)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_coerce_refuses_an_unknown_field_with_the_closest_name_and_a_non_mapping():
    with pytest.raises(
        ConfigError, match=r"model.dpo.betta: not a field of model.dpo; did you mean 'beta'\?"
    ):
        DPOPreset.coerce({"betta": 0.1})
    with pytest.raises(ConfigError, match=r"model.kto.loss_weights: not a field of model.kto"):
        KTOPreset.coerce({"loss_weights": [1.0]})  # a DPO field under model.kto
    with pytest.raises(ConfigError, match=r"model.orpo must be a mapping of ORPOConfig fields, got 0.1"):
        ORPOPreset.coerce(0.1)
    assert CPOPreset.coerce(None) is None
    preset = CPOPreset(beta=0.3)
    assert CPOPreset.coerce(preset) is preset


def test_select_preset_takes_one_of_the_options():
    assert select_preset(dpo=None, kto=None, cpo=None, orpo=None) is None
    assert select_preset(kto={"beta": 0.2}) == KTOPreset(beta=0.2)
    with pytest.raises(ConfigError, match=r"model\.dpo, model\.kto are set together"):
        select_preset(dpo={}, kto={})
    with pytest.raises(
        ConfigError, match=r"model.simpo: not a preference option \(SimPO is model.cpo with loss_type"
    ):
        select_preset(simpo={})
    with pytest.raises(ConfigError, match=r"model.dop: not a preference option; did you mean 'dpo'\?"):
        select_preset(dop={})
    assert {cls.where for cls in PREFERENCE_PRESETS.values()} == {f"model.{k}" for k in PREFERENCE_PRESETS}


READS = [  # (preset, paired, needs_reference, reduction, needs_lengths, nll_tokens, kl rows, wpo, couples)
    (DPOPreset(), True, True, "sum", False, None, False, False, False),
    (DPOPreset(loss_type="ipo"), True, True, "sum", True, None, False, False, False),
    (
        DPOPreset(loss_type=["sigmoid_norm", "sft"]),
        True,
        True,
        "sum",
        True,
        "completion",
        False,
        False,
        False,
    ),
    (
        DPOPreset(loss_type="aot_unpaired", reference_free=True),
        True,
        False,
        "sum",
        False,
        None,
        False,
        False,
        True,
    ),
    (DPOPreset(use_weighting=True), True, True, "sum", False, None, False, True, False),
    (KTOPreset(), False, True, "sum", False, None, True, False, False),
    (KTOPreset(loss_type="apo_zero_unpaired"), False, True, "sum", False, None, False, False, False),
    (CPOPreset(), True, False, "sum", False, "completion", False, False, False),
    (CPOPreset(loss_type="ipo", cpo_alpha=0.0), True, False, "mean", False, None, False, False, False),
    (CPOPreset(loss_type="alphapo", alpha=0.2), True, False, "mean", False, None, False, False, False),
    (ORPOPreset(), True, False, "mean", False, "prompt_and_completion", False, False, False),
]


@pytest.mark.parametrize("row", READS, ids=[repr(r[0]) for r in READS])
def test_what_each_preset_reads_from_the_module(row):
    preset, *expected = row
    got = [
        preset.paired,
        preset.needs_reference,
        preset.reduction,
        preset.needs_lengths,
        preset.nll_tokens,
        preset.needs_kl_rows,
        preset.needs_wpo_weights,
        preset.couples_pairs,
    ]
    assert got == expected


def test_sequence_logps_follow_the_reduction_and_ld_alpha():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    mask = torch.arange(6)[None] < torch.tensor([[2], [5], [4], [1]])
    torch.testing.assert_close(
        CPOPreset(loss_type="simpo").sequence_logps(lp, mask), (lp * mask).sum(-1) / mask.sum(-1)
    )
    torch.testing.assert_close(KTOPreset().sequence_logps(lp, mask), (lp * mask).sum(-1))
    torch.testing.assert_close(DPOPreset().sequence_logps(lp, mask), sequence_logps(lp, mask))
    ld = DPOPreset(ld_alpha=0.25).sequence_logps(lp, mask)
    torch.testing.assert_close(ld, ld_sequence_logps(lp, mask, 0.25))
    # pair 0: chosen 2 tokens, rejected 4: the rejected row's last 2 tokens count a quarter
    torch.testing.assert_close(ld[2], lp[2, :2].sum() + 0.25 * lp[2, 2:4].sum())
    torch.testing.assert_close(ld[0], lp[0, :2].sum())


def test_the_loss_methods_pass_the_fields():
    x, y = torch.tensor([-4.0, -6.0]), torch.tensor([-5.0, -5.0])
    dpo = DPOPreset(loss_type="hinge", beta=0.5, reference_free=True)
    torch.testing.assert_close(
        dpo.loss(x, y, x, y).losses, torch.relu(1 - 0.5 * (x - y))
    )  # references ignored
    orpo = ORPOPreset(beta=0.2).loss(x / 4, y / 4, chosen_nll=-x, chosen_nll_tokens=4.0)
    assert torch.equal(orpo.chosen_rewards, 0.2 * x / 4)
