"""``model.grpo`` (TRL's ``loss_type`` presets) and the objectives behind them against TRL's
``GRPOTrainer`` / Liger-Kernel's GRPO loss formulas (`trl_reference`, float64): one micro-batch of one
process gives their loss, gradients and clip metrics to 1e-10; options are checked with one error each."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pytest
import torch

from lit_losses import ConfigError, GRPOPreset, TinyLM
from lit_losses.aggregation import GlobalStats
from lit_losses.heads import FusedLMHead
from lit_losses.loss.objective import Objective
from lit_losses.objectives import TRLLossType
from tests.objectives import trl_reference

V, F = 7, 4
LENGTHS = (5, 3, 6, 2)  # completions of different lengths: padded rows
SAME = (4, 4, 4)  # unpadded rows (Liger-Kernel's luspo with a KL term sums over padding positions)
BIAS_KL = {"beta": 0.04, "use_bias_correction_kl": True}
SEQ = {"importance_sampling_level": "sequence"}

CASES = {
    "grpo": ({"loss_type": "grpo"}, LENGTHS),
    "grpo-clip_higher-delta-kl": (
        {"loss_type": "grpo", "epsilon_high": 0.28, "delta": 1.5, "beta": 0.04},
        LENGTHS,
    ),
    "gspo-bias_kl": ({"loss_type": "grpo", **SEQ, **BIAS_KL}, LENGTHS),
    "bnpo": ({"loss_type": "bnpo", "epsilon": 0.1}, LENGTHS),
    "bnpo-gspo": ({"loss_type": "bnpo", **SEQ}, LENGTHS),
    "dr_grpo-kl": ({"loss_type": "dr_grpo", "max_completion_length": 9, "beta": 0.1}, LENGTHS),
    "dapo": ({"loss_type": "dapo", "epsilon_high": 0.28}, LENGTHS),
    "dapo-bias_kl-delta": ({"loss_type": "dapo", "delta": 1.3, **BIAS_KL}, LENGTHS),
    "dapo-gspo": ({"loss_type": "dapo", **SEQ, "beta": 0.02}, LENGTHS),
    "cispo-default_cap": ({"loss_type": "cispo"}, LENGTHS),  # TRL's epsilon_high = epsilon = 0.2: the cap
    "cispo-kl": ({"loss_type": "cispo", "epsilon_high": 1.25, **BIAS_KL}, LENGTHS),
    "cispo-gspo": ({"loss_type": "cispo", "epsilon_high": 1.1, **SEQ}, LENGTHS),
    "sapo": ({"loss_type": "sapo"}, LENGTHS),
    "sapo-temperatures-kl": (
        {"loss_type": "sapo", "sapo_temperature_pos": 2.0, "sapo_temperature_neg": 0.5, **BIAS_KL},
        LENGTHS,
    ),
    "sapo-gspo": ({"loss_type": "sapo", **SEQ}, LENGTHS),
    "luspo": ({"loss_type": "luspo", **SEQ}, LENGTHS),
    "luspo-delta-kl": ({"loss_type": "luspo", **SEQ, "delta": 1.4, "beta": 0.05}, SAME),
    "vespo": ({"loss_type": "vespo"}, LENGTHS),
    "vespo-gammas-bias_kl": (
        {"loss_type": "vespo", "vespo_k_pos": 1.0, "vespo_lambda_neg": 0.7, **BIAS_KL},
        LENGTHS,
    ),
    "vespo-sequence_kl": ({"loss_type": "vespo", **SEQ, **BIAS_KL}, LENGTHS),
}


def make_case(lengths, seed: int = 0, weight: torch.Tensor | None = None) -> dict:
    """Rows of completions (``lengths`` tokens, padded), a linear head, sampler and reference
    log-probabilities near the policy's (some ratios clipped, some not), one advantage per row."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    labels = torch.where(mask, torch.randint(0, V, (B, T), generator=g), -100)
    x = torch.randn(B, T, F, generator=g, dtype=torch.float64)
    if weight is None:
        weight = torch.randn(V, F, generator=g, dtype=torch.float64)
    lp = policy_logprobs(x, weight, labels).detach()
    old = torch.where(mask, lp + 0.35 * torch.randn(B, T, generator=g, dtype=torch.float64), 0.0)
    ref = torch.where(mask, lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64), 0.0)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return {"x": x, "weight": weight, "labels": labels, "mask": mask, "old": old, "ref": ref, "adv": adv}


def policy_logprobs(x, weight, labels):
    """``log softmax(x Wᵀ)[label]`` from materialized logits (0 where there is no label)."""
    logp = torch.log_softmax(x @ weight.T, -1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    return torch.where(labels != -100, logp, torch.zeros_like(logp))


def rl_batch(case: dict) -> dict:
    """The case as lit_losses' RL micro-batch (per-token keys aligned with ``labels``)."""
    mask = case["mask"]
    return {
        "labels": case["labels"],
        "sampling_logprobs": case["old"],
        "advantages": torch.where(mask, case["adv"][:, None].expand_as(mask), 0.0),
        "ref_logprobs": case["ref"],
    }


def ours(case: dict, objective: Objective, x=None, weight=None, stats: GlobalStats | None = None):
    """Our `LossOutput` of the case in training (default: the case's hidden states, a weight with
    gradient, the case's own counts)."""
    x = case["x"] if x is None else x
    weight = case["weight"].clone().requires_grad_() if weight is None else weight
    batch = rl_batch(case)
    head = FusedLMHead(weight, backend="chunked", chunk_size=4)
    stats = GlobalStats.local_only(batch) if stats is None else stats
    return objective(head, x, batch, stats, step=0, stage="train")


def theirs(case: dict, cfg: dict, x, weight):
    lp = policy_logprobs(x, weight, case["labels"])
    return trl_reference.trl_loss(lp, case["old"], case["ref"], case["adv"], case["mask"], cfg)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_preset_is_trl_s_loss_and_gradient_on_one_micro_batch(name):
    cfg, lengths = CASES[name]
    case = make_case(lengths)
    objective = Objective.from_options(grpo=cfg)
    leaves = [case["x"].clone().requires_grad_(), case["weight"].clone().requires_grad_()]
    loss = ours(case, objective, *leaves).total
    grads = torch.autograd.grad(loss, leaves)
    ref_leaves = [case["x"].clone().requires_grad_(), case["weight"].clone().requires_grad_()]
    reference = theirs(case, cfg, *ref_leaves)
    ref_grads = torch.autograd.grad(reference, ref_leaves)
    torch.testing.assert_close(loss, reference, rtol=1e-10, atol=1e-10)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10)
    assert float(ref_grads[1].abs().max()) > 1e-3  # a gradient that the comparison can see


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_preset_is_liger_kernel_s_loss_where_liger_takes_it(name):
    cfg, lengths = CASES[name]
    case = make_case(lengths)
    level = cfg.get("importance_sampling_level", "token")
    if level == "sequence" and cfg["loss_type"] in trl_reference.LIGER_REFUSES_SEQUENCE:
        pytest.skip("Liger-Kernel refuses sequence-level ratios for this loss type (TRL takes them)")
    leaves = [case["x"].clone().requires_grad_(), case["weight"].clone().requires_grad_()]
    loss = ours(case, Objective.from_options(grpo=cfg), *leaves).total
    lp = policy_logprobs(*leaves, case["labels"])
    liger = trl_reference.liger_loss(lp, case["old"], case["ref"], case["adv"], case["mask"], cfg)
    torch.testing.assert_close(loss, liger, rtol=1e-10, atol=1e-10)
    for grad, ref_grad in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(liger, leaves)):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_preset_logs_trl_s_clip_ratios_and_kl(name):
    cfg, lengths = CASES[name]
    case = make_case(lengths)
    preset = GRPOPreset(**cfg)
    out = ours(case, Objective.from_options(grpo=preset))
    lp = policy_logprobs(case["x"], case["weight"], case["labels"])
    expected = trl_reference.trl_metrics(lp, case["old"], case["ref"], case["adv"], case["mask"], cfg)
    per_sequence = preset.importance_sampling_level == "sequence"
    for key, value in expected.items():
        if key == "kl":  # the KL term's value, in the loss's aggregation: TRL's token mean in token-mean
            if preset.options()["loss_agg"] == "token-mean":
                assert float(out.terms["kl_reference"]["value"]) == pytest.approx(value, rel=1e-10)
        elif not per_sequence:  # TRL's sequence-level clip ratios are means over sequences, ours over tokens
            assert float(out.base_metrics[key]) == pytest.approx(value, rel=1e-10, abs=1e-12), key
    if preset.loss_type in trl_reference.CLIPPED and not per_sequence:
        assert 0 < expected["clip_ratio_region"] < 1  # the data clips some tokens and not others


def test_the_cases_clip_and_the_ratio_bounds_matter():
    """Within the same data, a different ε changes the loss (the presets pass ε through)."""
    case = make_case(LENGTHS)
    objectives = [Objective.from_options(grpo={"loss_type": "dapo", "epsilon": eps}) for eps in (0.05, 0.2)]
    values = [float(ours(case, o).total.detach()) for o in objectives]
    assert abs(values[0] - values[1]) > 1e-4


def test_presets_set_the_base_loss_its_aggregation_and_the_kl_term():
    options = GRPOPreset("cispo", epsilon_high=5.0, beta=0.01).options()
    assert options["base_loss"] == "cispo"
    assert options["base_loss_args"]["clip_high_threshold"] == 5.0  # TRL's epsilon_high is the cap itself
    assert options["base_loss_args"]["clip_low_threshold"] == 0.0
    assert options["loss_agg"] == "token-mean"
    assert options["regularizers"][0]["agg"] == "token-mean"
    model = TinyLM(vocab_size=16, d_model=8, n_layers=1, n_heads=2, grpo={"loss_type": "grpo", "beta": 0.1})
    assert model.loss_agg == "seq-mean-token-mean" and model.objective.base_loss.name == "ppo"
    assert model.regularizer_set.terms["kl_reference"].spec.agg == "seq-mean-token-mean"
    gspo = Objective.from_options(grpo={"loss_type": "grpo", **SEQ})
    assert gspo.path("train", gspo.head_outputs_needed()) == "general"  # needs whole sequences
    dapo = Objective.from_options(grpo={"loss_type": "dapo", "beta": 0.1})
    assert dapo.path("train", dapo.head_outputs_needed()) == "fused"  # per token: the fused pointwise path


BAD = [
    ({"loss_type": "grpoo"}, "model.grpo.loss_type 'grpoo' is not one of"),
    ({"loss_type": "dr_grpo"}, "model.grpo.max_completion_length is required by loss_type 'dr_grpo'"),
    ({"loss_type": "sapo", "delta": 2.0}, "model.grpo.delta=2.0: loss_type 'sapo' ignores it (it applies to"),
    ({"beta": -0.1}, "model.grpo.beta must be a finite number >= 0, got -0.1"),
    ({"epsilon": 1.5}, "model.grpo.epsilon must be a finite number in [0, 1], got 1.5"),
    (
        {"loss_type": "sapo", "sapo_temperature_pos": 0},
        "model.grpo.sapo_temperature_pos must be a finite number > 0",
    ),
    (
        {"loss_type": "vespo", "vespo_k_neg": -1.0},
        "model.grpo.vespo_k_neg must be a finite number >= 0, got -1.0",
    ),
    ({"delta": float("inf")}, "model.grpo.delta must be a finite number > 0, got inf"),
    ({"entropy_coef": -0.1}, "model.grpo.entropy_coef must be a finite number >= 0, got -0.1"),
    ({"top_entropy_quantile": 0.2}, "model.grpo.top_entropy_quantile: not a field of model.grpo; TRL's"),
    (
        {"loss_type": "vespo", "importance_sampling_level": "sequence"},
        "model.grpo.importance_sampling_level='sequence': loss_type 'vespo' ignores it",
    ),
    ({"importance_sampling_level": "seq"}, "model.grpo.importance_sampling_level 'seq' is not one of"),
    ({"epsilon_hi": 0.3}, "model.grpo.epsilon_hi: not a field of model.grpo; did you mean 'epsilon_high'?"),
    ([("loss_type", "grpo")], "model.grpo must be a mapping of GRPOConfig fields"),
]


@pytest.mark.parametrize(("cfg", "message"), BAD)
def test_bad_preset_options_are_one_error_naming_the_field(cfg, message):
    with pytest.raises(ConfigError) as info:
        Objective.from_options(grpo=cfg)
    assert message in str(info.value) and "\n" not in str(info.value)


# a value other than the default for each field of model.grpo (that every loss type takes when it reads it)
CHANGED = {
    "epsilon": 0.05,
    "epsilon_high": 0.05,
    "delta": 1.05,
    "importance_sampling_level": "sequence",
    "max_completion_length": 12,
    "sapo_temperature_pos": 3.0,
    "sapo_temperature_neg": 0.3,
    "vespo_k_pos": 0.5,
    "vespo_lambda_pos": 0.4,
    "vespo_k_neg": 0.5,
    "vespo_lambda_neg": 0.4,
}
NEEDED = {
    "dr_grpo": {"max_completion_length": 9},
    "luspo": {"importance_sampling_level": "sequence"},
    "cispo": {"epsilon_high": 1.2},  # a cap that leaves some ratios below it
}
KL = {"beta": 0.04, "use_bias_correction_kl": True}


@pytest.mark.parametrize("kl", [False, True], ids=["no_kl", "bias_corrected_kl"])
@pytest.mark.parametrize("loss_type", get_args(TRLLossType))
def test_a_field_the_loss_type_ignores_is_refused_and_one_it_reads_is_taken(loss_type, kl):
    """TRL's loss (`trl_reference`) tells which fields a loss type reads: changing such a field changes
    the loss, and the preset takes it; changing any other is refused, naming the field and its value."""
    cases = []
    for seed in range(4):  # a few micro-batches: one may leave a field without effect by chance
        c = make_case(LENGTHS, seed=seed)
        cases.append(
            (policy_logprobs(c["x"], c["weight"], c["labels"]), c["old"], c["ref"], c["adv"], c["mask"])
        )
    base = {"loss_type": loss_type, **NEEDED.get(loss_type, {}), **(KL if kl else {})}

    def trl(cfg: dict) -> list[float]:
        return [float(trl_reference.trl_loss(*c, cfg)) for c in cases]

    reference = trl(base)
    for field, value in CHANGED.items():
        if base.get(field, trl_reference.DEFAULTS[field]) == value:
            continue
        cfg = {**base, field: value}
        if trl(cfg) != reference:  # TRL reads it: taken
            GRPOPreset(**cfg)
            continue
        with pytest.raises(ConfigError) as info:
            GRPOPreset(**cfg)
        expected = f"model.grpo.{field}={value!r}: loss_type {loss_type!r} ignores it"
        assert str(info.value).startswith(expected), str(info.value)


def test_cispo_reads_epsilon_only_as_the_default_cap():
    case = make_case(LENGTHS)
    lp = policy_logprobs(case["x"], case["weight"], case["labels"])
    args = (lp, case["old"], case["ref"], case["adv"], case["mask"])
    cap = {"loss_type": "cispo", "epsilon_high": 0.9}
    assert trl_reference.trl_loss(*args, {**cap, "epsilon": 0.05}) == trl_reference.trl_loss(*args, cap)
    with pytest.raises(
        ConfigError, match=r"model\.grpo\.epsilon=0\.05: loss_type 'cispo' ignores it \(its ratio"
    ):
        GRPOPreset(**cap, epsilon=0.05)
    assert trl_reference.trl_loss(*args, {"loss_type": "cispo", "epsilon": 0.9}) != trl_reference.trl_loss(
        *args, {"loss_type": "cispo"}
    )
    assert GRPOPreset("cispo", epsilon=0.9).options()["base_loss_args"]["clip_high_threshold"] == 0.9


def test_a_preset_refuses_the_options_it_sets_and_a_second_kl_term():
    with pytest.raises(ConfigError, match=r"model.grpo .* sets model.base_loss, .*; remove model.loss_agg"):
        Objective.from_options(grpo={"loss_type": "grpo"}, loss_agg="token-sum")
    with pytest.raises(ConfigError, match=r"remove model\.base_loss or model\.grpo"):
        Objective.from_options(grpo={"loss_type": "grpo"}, base_loss="ppo")
    with pytest.raises(ConfigError, match=r"model\.grpo\.beta=0\.1 adds the kl_reference term"):
        Objective.from_options([{"name": "kl_reference"}], grpo={"beta": 0.1})
    with pytest.raises(ConfigError, match=r"model\.grpo\.entropy_coef=0\.1 adds the entropy term"):
        Objective.from_options([{"name": "entropy"}], grpo={"entropy_coef": 0.1})


def test_sequence_level_bias_corrected_kl_refuses_a_chunk_of_tokens():
    """Beside a token-level base loss the KL term would be fused: a sequence ratio needs whole rows."""
    case = make_case(LENGTHS)
    terms = [
        {"name": "kl_reference", "args": {"bias_correction": True, "importance_sampling_level": "sequence"}}
    ]
    objective = Objective.from_options(terms, base_loss="ppo")
    with pytest.raises(Exception, match="set the term's `pointwise: false`"):
        ours(case, objective)
    terms[0]["pointwise"] = False
    ours(case, Objective.from_options(terms, base_loss="ppo"))


def test_the_docs_table_maps_each_loss_type_as_the_presets_do():
    section = (Path(__file__).resolve().parents[2] / "docs" / "tutorials" / "grpo.md").read_text()
    rows = re.findall(r"^\| `(\w+)`(?: \(default\))? \| `(\w+)`[^|]*\| `([\w-]+)`", section, flags=re.M)
    table = {loss_type: (base_loss, agg) for loss_type, base_loss, agg in rows if loss_type != "loss_type"}
    assert set(table) == set(get_args(TRLLossType))
    for loss_type, (base_loss, agg) in table.items():
        extra = {"max_completion_length": 8} if loss_type == "dr_grpo" else {}
        level = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
        options = GRPOPreset(loss_type, **extra, **level).options()
        assert (options["base_loss"], options["loss_agg"]) == (base_loss, agg), loss_type


@pytest.mark.parametrize("packed", [False, True])
def test_sequence_ratios_are_per_row_segment_pair(packed):
    """``importance_sampling`` with GSPO's ratio, by a loop over sequences: in packed rows each (row,
    segment) pair has its own ratio ``exp(mean (ℓ − q))``."""
    case = make_case(LENGTHS, seed=3)
    batch = rl_batch(case)
    if packed:  # split every row after its first two tokens into a second sequence
        batch["segment_ids"] = (torch.arange(case["mask"].shape[1]) >= 2).long().expand_as(case["mask"])
    objective = Objective.from_options(
        base_loss="importance_sampling",
        base_loss_args={"importance_sampling_level": "sequence"},
        loss_agg="token-sum",
    )
    weight = case["weight"].clone().requires_grad_()
    head = FusedLMHead(weight, backend="chunked", chunk_size=4)
    loss = objective(head, case["x"], batch, GlobalStats.local_only(batch), step=0, stage="train").total
    lp = policy_logprobs(case["x"], weight, case["labels"])
    expected = lp.new_zeros(())
    for b, length in enumerate(LENGTHS):
        cuts = [(0, min(2, length)), (2, length)] if packed else [(0, length)]
        for start, end in cuts:
            if end > start:
                ratio = torch.exp((lp[b, start:end] - case["old"][b, start:end]).mean())
                expected = expected - ratio * case["adv"][b] * (end - start)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-10)
    grads = [torch.autograd.grad(v, weight, retain_graph=True)[0] for v in (loss, expected)]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-10)
