"""The rollout corrections against TRL's and verl's formulas written again from their current source
(`rollout_reference`, float64): per-token weights and masks, loss and gradient on one micro-batch (with
sequences that are masked or rejected whole), the identity when ``old_logprobs == sampling_logprobs``
(bit for bit), ``π_old`` = the current policy detached without ``old_logprobs`` (ratio 1), the telemetry,
and packed rows."""

from __future__ import annotations

import math

import pytest
import torch

from lit_losses.aggregation import GlobalStats
from lit_losses.heads import FusedLMHead
from lit_losses.loss.objective import Objective
from lit_losses.objectives.correction import RolloutCorrectionOptions
from lit_losses.objectives.correction_batch import dense_sequence_index
from lit_losses.objectives.mismatch import importance_weights, off_policy_keep, rejection_keep
from tests.objectives import rollout_reference as ref
from tests.objectives.test_trl import make_case, policy_logprobs

LENGTHS = (6, 3, 5, 2, 4)
RS_OPTIONS = [
    ("token_k1", "0.7_1.3"),
    ("token_k2", 0.05),
    ("token_k3", 0.05),
    ("seq_sum_k1", "0.3_3.0"),
    ("seq_sum_k2", 0.2),
    ("seq_sum_k3", 0.2),
    ("seq_mean_k1", 1.2),  # one upper ratio bound: lower = 1/1.2
    ("seq_mean_k2", 0.04),
    ("seq_mean_k3", 0.04),
    ("seq_max_k2", 0.15),
    ("seq_max_k3", 0.15),
    ("token_k1,seq_max_k3,token_k1", "0.7_1.3,0.2"),  # chained, a duplicate dropped as verl drops it
]


def rollout_case(lengths=LENGTHS, seed: int = 0, engine: float = 0.25) -> dict:
    """`make_case` (policy, π_old ``old`` near it, reference, advantages) plus the engine's
    log-probabilities ``sampling``: ``old − noise``; row 0's engine is off by 0.8 per token, so that its
    sequence ratio leaves every band (a sequence masked or rejected whole)."""
    case = make_case(lengths, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    noise = engine * torch.randn(case["mask"].shape, generator=g, dtype=torch.float64)
    noise[0] += 0.8
    case["sampling"] = torch.where(case["mask"], case["old"] - noise, 0.0)
    return case


def batch_of(case: dict, old: bool = True) -> dict:
    mask = case["mask"]
    batch = {
        "labels": case["labels"],
        "sampling_logprobs": case["sampling"],
        "advantages": torch.where(mask, case["adv"][:, None].expand_as(mask), 0.0),
        "ref_logprobs": case["ref"],
    }
    return batch | ({"old_logprobs": case["old"]} if old else {})


def ours(case: dict, objective: Objective, leaves, old: bool = True, batch: dict | None = None):
    """The `LossOutput` of the case as `RegularizedLM` computes it: the rejection before the counts."""
    batch = objective.reject(batch_of(case, old) if batch is None else batch)
    stats = GlobalStats.local_only(batch, objective.mask_keys())
    head = FusedLMHead(leaves[1], backend="chunked", chunk_size=4)
    return objective(head, leaves[0], batch, stats, step=0, stage="train")


def leaves_of(case: dict):
    return [case["x"].clone().requires_grad_(), case["weight"].clone().requires_grad_()]


def assert_loss_and_grads(loss, reference, leaves, ref_leaves):
    torch.testing.assert_close(loss, reference, rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad(loss, leaves)
    ref_grads = torch.autograd.grad(reference, ref_leaves)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert float(ref_grads[1].abs().max()) > 1e-3


def flat(case: dict):
    """``(log ρ, sequence index)`` at the valid tokens, row-major."""
    mask = case["mask"]
    return (case["old"] - case["sampling"])[mask], dense_sequence_index({}, mask)


# ---- per-token weights and masks ------------------------------------------------------------------------
TRL_WEIGHTS = [
    ("token_truncate", None, 3.0),
    ("token_truncate", 0.8, 1.25),
    ("token_mask", 0.5, 2.0),  # IcePop's band
    ("token_mask", None, 1.3),
    ("sequence_truncate", 0.5, 2.0),
    ("sequence_mask", None, 3.0),  # TRL's default
    ("sequence_mask", 0.6, None),
]


@pytest.mark.parametrize(("mode", "low", "high"), TRL_WEIGHTS)
def test_trl_importance_weights_are_trl_s(mode, low, high):
    case = rollout_case()
    options = RolloutCorrectionOptions(
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=low,
        vllm_importance_sampling_clip_max=high,
    )
    log_ratio, index = flat(case)
    ours_w = importance_weights(options.resolve("x"), log_ratio, index).weight
    mask = case["mask"]
    theirs = ref.trl_is_ratio(case["old"], case["sampling"], mask.double(), mode, low, high)
    expected = theirs.expand_as(mask)[mask]
    torch.testing.assert_close(ours_w, expected, rtol=1e-13, atol=0)
    if mode.endswith("mask"):
        assert 0 < int((expected == 0).sum()) < expected.numel()  # some tokens masked, some kept
    if mode == "sequence_mask" and low is None:
        assert bool((expected[: LENGTHS[0]] == 0).all())  # row 0 masked whole


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_verl_importance_weights_are_verl_s(level):
    case = rollout_case()
    correction = RolloutCorrectionOptions(rollout_is=level, rollout_is_threshold=1.5).resolve("x")
    log_ratio, index = flat(case)
    mask = case["mask"]
    expected = ref.verl_is_weights(case["old"] - case["sampling"], mask.double(), level, 1.5)[mask]
    weights = importance_weights(correction, log_ratio, index)
    torch.testing.assert_close(weights.weight, expected, rtol=1e-13, atol=0)
    assert 0 < int(weights.truncated.sum()) < expected.numel()


@pytest.mark.parametrize(("options", "threshold"), RS_OPTIONS, ids=[o for o, _ in RS_OPTIONS])
def test_verl_rejection_keeps_the_tokens_verl_keeps(options, threshold):
    case = rollout_case()
    correction = RolloutCorrectionOptions(rollout_rs=options, rollout_rs_threshold=threshold).resolve("x")
    log_ratio, index = flat(case)
    mask = case["mask"]
    expected = ref.verl_rejection_mask(case["old"] - case["sampling"], mask.double(), options, threshold)
    keep = rejection_keep(correction.rejection, log_ratio, index)
    assert keep.tolist() == expected[mask].bool().tolist()
    assert 0 < int((~keep).sum()) < keep.numel()  # the criterion rejects some tokens, not all


def test_off_policy_mask_is_trl_s():
    case = rollout_case(engine=0.4)
    mask = case["mask"]
    lp = policy_logprobs(case["x"], case["weight"], case["labels"])
    adv = torch.where(mask, case["adv"][:, None].expand_as(mask), 0.0)
    keep = off_policy_keep(0.1, case["sampling"][mask], lp[mask], adv[mask], dense_sequence_index({}, mask))
    expected = ref.trl_off_policy_mask(case["adv"][:, None], lp, case["sampling"], mask.double(), 0.1)
    assert keep.tolist() == expected.expand_as(mask)[mask].bool().tolist()
    assert 0 < int((~keep).sum()) < keep.numel()


# ---- loss and gradient against TRL's _compute_loss --------------------------------------------------------
VLLM = {"vllm_importance_sampling_correction": True}
TRL_CASES = {
    "dapo-token_truncate": {"loss_type": "dapo", **VLLM, "vllm_importance_sampling_mode": "token_truncate"},
    "grpo-token_mask-icepop": {"loss_type": "grpo", "rollout_correction_preset": "icepop"},
    "dapo-sequence_truncate-kl": {
        "loss_type": "dapo",
        **VLLM,
        "vllm_importance_sampling_mode": "sequence_truncate",
        "vllm_importance_sampling_clip_max": 2.0,
        "beta": 0.04,
        "use_bias_correction_kl": True,
    },
    "bnpo-sequence_mask": {"loss_type": "bnpo", **VLLM},  # TRL's default mode and C_max
    "dr_grpo-sequence_mask-cap": {
        "loss_type": "dr_grpo",
        "max_completion_length": 8,
        **VLLM,
        "vllm_importance_sampling_cap": 2.5,
    },
    "cispo-sequence_mask-off_policy": {
        "loss_type": "cispo",
        "epsilon_high": 1.25,
        **VLLM,
        "vllm_importance_sampling_clip_min": 0.2,
        "off_policy_mask_threshold": 0.05,
    },
    "sapo-token_truncate": {
        "loss_type": "sapo",
        **VLLM,
        "vllm_importance_sampling_mode": "token_truncate",
        "vllm_importance_sampling_clip_min": 0.5,
        "vllm_importance_sampling_clip_max": 1.5,
    },
    "vespo-token_mask": {"loss_type": "vespo", **VLLM, "vllm_importance_sampling_mode": "token_mask"},
    "vespo-token_truncate-kl": {
        "loss_type": "vespo",
        **VLLM,
        "vllm_importance_sampling_mode": "token_truncate",
        "vllm_importance_sampling_clip_max": 1.2,
        "beta": 0.05,
    },
    "gspo-token_truncate": {
        "loss_type": "grpo",
        "importance_sampling_level": "sequence",
        **VLLM,
        "vllm_importance_sampling_mode": "token_truncate",
        "vllm_importance_sampling_clip_max": 1.5,
    },
    "dapo-off_policy": {"loss_type": "dapo", "off_policy_mask_threshold": 0.02},
}


@pytest.mark.filterwarnings("ignore:model.grpo.vllm_importance_sampling_cap is deprecated")
@pytest.mark.parametrize("old", [True, False], ids=["old_logprobs", "old_absent"])
@pytest.mark.parametrize("name", sorted(TRL_CASES))
def test_grpo_with_a_correction_is_trl_s_loss_and_gradient(name, old):
    """``old_absent``: TRL's π_old when each generation is used once, the current policy detached, under
    an importance-sampling correction; without one (the off-policy mask alone) the records'
    ``logprobs`` are π_old, as they are TRL's ``old_per_token_logps`` without vLLM."""
    cfg = TRL_CASES[name]
    case = rollout_case()
    objective = Objective.from_options(grpo=cfg)
    leaves = leaves_of(case)
    loss = ours(case, objective, leaves, old=old).total
    ref_leaves = leaves_of(case)
    lp = policy_logprobs(*ref_leaves, case["labels"])
    uses_old = objective.base_loss.correction.uses_old
    trl_old = case["old"] if old else lp.detach() if uses_old else case["sampling"]
    trl_cfg = {
        k: v for k, v in cfg.items() if k not in ("rollout_correction_preset", "vllm_importance_sampling_cap")
    }
    if cfg.get("rollout_correction_preset") == "icepop":
        trl_cfg |= {**VLLM, "vllm_importance_sampling_mode": "token_mask"}
        trl_cfg |= {"vllm_importance_sampling_clip_min": 0.5, "vllm_importance_sampling_clip_max": 5.0}
    if "vllm_importance_sampling_cap" in cfg:
        trl_cfg["vllm_importance_sampling_clip_max"] = cfg["vllm_importance_sampling_cap"]
    mask = case["mask"]
    reference = ref.trl_corrected_loss(lp, trl_old, case["sampling"], case["ref"], case["adv"], mask, trl_cfg)
    assert_loss_and_grads(loss, reference, leaves, ref_leaves)
    # the correction is not vacuous on this data: the uncorrected loss differs
    plain = {k: v for k, v in trl_cfg.items() if not k.startswith(("vllm_", "off_policy"))}
    with torch.no_grad():
        uncorrected = ref.trl_corrected_loss(
            lp, trl_old, case["sampling"], case["ref"], case["adv"], mask, plain
        )
    assert abs(float(uncorrected - reference.detach())) > 1e-6 * abs(float(reference.detach())) + 1e-9


def test_a_sequence_masked_whole_keeps_its_tokens_in_trl_s_counts():
    """TRL's ``sequence_mask`` zeroes row 0's loss; ``bnpo``'s token mean still divides by its tokens."""
    case = rollout_case()
    objective = Objective.from_options(grpo={"loss_type": "bnpo", **VLLM})
    out = ours(case, objective, leaves_of(case))
    assert out.stats.get().num_tokens == int(case["mask"].sum())
    assert float(out.base_metrics["rollout_is_masked_fraction"]) >= LENGTHS[0] / sum(LENGTHS)


# ---- loss and gradient against verl's decoupled mode ---------------------------------------------------
VERL_CASES = {
    "token_is": ({"rollout_is": "token", "rollout_is_threshold": 1.5}, "token-mean"),
    "seq_is_rs-preset": ({"rollout_correction_preset": "decoupled_seq_is_rs"}, "seq-mean-token-mean"),
    "token_k1+seq_max_k2": (
        {"rollout_rs": "token_k1,seq_max_k2", "rollout_rs_threshold": "0.7_1.3,0.15"},
        "token-mean",
    ),
    "k3_rs_token_tis": (
        {"rollout_is": "token", "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.04},
        "seq-mean-token-sum",
    ),
    "seq_is+token_k2": (
        {"rollout_is": "sequence", "rollout_rs": "token_k2", "rollout_rs_threshold": 0.05},
        "seq-mean-token-mean",
    ),
}
PPO_AS_VERL = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "delta": 3.0}  # dual clip c = 3


@pytest.mark.parametrize("name", sorted(VERL_CASES))
def test_rollout_is_and_rs_are_verl_s_loss_and_gradient(name):
    """verl's dual-clip PPO (``clip_ratio_c``) is ``ppo``'s two-sided clip ``delta``; the rejection
    replaces the response mask, so a sequence rejected whole leaves the sequence count."""
    options, agg = VERL_CASES[name]
    case = rollout_case()
    objective = Objective.from_options(base_loss="ppo", base_loss_args=PPO_AS_VERL | options, loss_agg=agg)
    leaves = leaves_of(case)
    out = ours(case, objective, leaves)
    ref_leaves = leaves_of(case)
    lp = policy_logprobs(*ref_leaves, case["labels"])
    resolved = {**options, **ref.preset_fields(options)}
    cfg = {**resolved, "clip_ratio": 0.2, "clip_ratio_c": 3.0, "loss_agg_mode": agg}
    # without the 1e-8 verl adds to a sequence's token count (here the count itself: 1e-9 relative)
    reference = ref.verl_corrected_loss(
        lp, case["old"], case["sampling"], case["adv"], case["mask"], cfg, eps=0
    )
    assert_loss_and_grads(out.total, reference, leaves, ref_leaves)
    if "rollout_rs" in resolved:
        log_ratio = case["old"] - case["sampling"]
        kept = ref.verl_rejection_mask(
            log_ratio, case["mask"].double(), resolved["rollout_rs"], resolved["rollout_rs_threshold"]
        )
        assert out.stats.get().num_tokens == int(kept.sum()) < int(case["mask"].sum())
        assert out.stats.get("rollout_valid").num_tokens == int(case["mask"].sum())


def test_a_sequence_rejected_whole_leaves_the_sequence_count():
    case = rollout_case()
    options = {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.5_2.0"}
    objective = Objective.from_options(
        base_loss="ppo", base_loss_args=options, loss_agg="seq-mean-token-mean"
    )
    out = ours(case, objective, leaves_of(case))
    assert out.stats.get().num_sequences == len(LENGTHS) - 1  # row 0: mean log ρ ≈ 0.8 > log 2
    expected = LENGTHS[0] / sum(LENGTHS)
    assert float(out.base_metrics["rollout_rs_masked_fraction"]) == pytest.approx(expected, rel=1e-12)


# ---- the identity, and π_old without old_logprobs ---------------------------------------------------------
IDENTITY = [
    {**VLLM, "vllm_importance_sampling_mode": mode, "vllm_importance_sampling_clip_min": 0.5}
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
] + [
    {"rollout_correction_preset": "icepop"},
    {"rollout_is": "token"},
    {"rollout_is": "sequence", "rollout_is_threshold": 1.0},
    *({"rollout_rs": o, "rollout_rs_threshold": t} for o, t in RS_OPTIONS),
    {"rollout_correction_preset": "decoupled_k3_rs_seq_tis"},
]


@pytest.mark.parametrize("base_loss", ["ppo", "vespo"])
def test_every_correction_is_the_identity_when_the_engine_is_the_trainer(base_loss):
    """``old_logprobs == sampling_logprobs``: the loss and its gradient are today's, bit for bit (no
    ``old_logprobs``, no correction), on the fused path where today's is fused."""
    case = rollout_case()
    case["old"] = case["sampling"]
    today_objective = Objective.from_options(base_loss=base_loss)
    today_leaves = leaves_of(case)
    today = ours(case, today_objective, today_leaves, old=False).total
    today_grads = torch.autograd.grad(today, today_leaves)
    for options in IDENTITY:
        if base_loss == "vespo" and RolloutCorrectionOptions(**options).resolve("x").level == "sequence":
            continue  # vespo takes token-level weights only (TRL's rule)
        objective = Objective.from_options(base_loss=base_loss, base_loss_args=options)
        batch = batch_of(case)
        assert objective.path("train", objective.head_outputs_needed(), batch) == today_objective.path(
            "train", today_objective.head_outputs_needed(), batch_of(case, old=False)
        )
        leaves = leaves_of(case)
        loss = ours(case, objective, leaves).total
        assert torch.equal(loss, today), options
        for grad, today_grad in zip(torch.autograd.grad(loss, leaves), today_grads, strict=True):
            assert torch.equal(grad, today_grad), options


def test_without_old_logprobs_the_ratio_is_1_and_the_weight_carries_the_mismatch():
    """No ``old_logprobs``: π_old is the current policy detached, so PPO's ratio is 1 (nothing is clipped,
    however tight the bounds) and the weight is ``clip(exp(ℓ − q))``; with them the ratio is
    ``exp(ℓ − o)``."""
    case = rollout_case()
    args = {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01, **VLLM}
    args |= {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 2.0}
    objective = Objective.from_options(base_loss="ppo", base_loss_args=args, loss_agg="token-sum")
    leaves = leaves_of(case)
    out = ours(case, objective, leaves, old=False)
    assert float(out.base_metrics["clip_fraction"]) == 0.0
    lp = policy_logprobs(*leaves, case["labels"])
    mask = case["mask"]
    weight = torch.exp(lp.detach() - case["sampling"]).clamp(max=2.0)
    adv = case["adv"][:, None].expand_as(mask)
    expected = -(weight * adv * torch.exp(lp - lp.detach()))[mask].sum()
    assert_loss_and_grads(out.total, expected, leaves, leaves)
    assert float(ours(case, objective, leaves_of(case)).base_metrics["clip_fraction"]) > 0.1


# ---- telemetry and packing ---------------------------------------------------------------------------------
def test_telemetry_is_the_mismatch_and_the_shares_truncated_masked_and_rejected():
    case = rollout_case()
    args = {"rollout_is": "token", "rollout_is_threshold": 1.2, "rollout_rs": "token_k2"}
    args |= {"rollout_rs_threshold": 0.1, "off_policy_mask_threshold": 0.05}
    objective = Objective.from_options(base_loss="ppo", base_loss_args=args)
    out = ours(case, objective, leaves_of(case))
    mask = case["mask"]
    log_ratio = (case["old"] - case["sampling"])[mask]
    n = log_ratio.numel()
    weights = torch.exp(log_ratio).clamp(max=1.2)
    kept = 0.5 * log_ratio**2 <= 0.1
    lp = policy_logprobs(case["x"], case["weight"], case["labels"])
    opsm = ref.trl_off_policy_mask(
        case["adv"][:, None], lp, case["sampling"], (mask & out_labels_mask(objective, case)).double(), 0.05
    ).expand_as(mask)[mask & out_labels_mask(objective, case)]
    expected = {
        "rollout_logprob_diff_mean": log_ratio.abs().mean(),
        "rollout_logprob_diff_max": log_ratio.abs().max(),
        "rollout_k3_kl": (torch.exp(log_ratio) - log_ratio - 1).mean(),
        "rollout_is_weight_mean": weights.mean(),
        "rollout_is_truncated_fraction": (torch.exp(log_ratio) > 1.2).double().mean(),
        "rollout_is_masked_fraction": torch.tensor(0.0),
        "rollout_rs_masked_fraction": (~kept).double().mean(),
        "off_policy_masked_fraction": (opsm == 0).double().sum() / n,
    }
    for key, value in expected.items():
        torch.testing.assert_close(out.base_metrics[key], value.double(), rtol=1e-12, atol=0, msg=key)
    for key in ("rollout_is_truncated_fraction", "rollout_rs_masked_fraction", "off_policy_masked_fraction"):
        assert 0 < float(expected[key]) < 1, key


def out_labels_mask(objective: Objective, case: dict) -> torch.Tensor:
    return objective.reject(batch_of(case))["labels"] != -100


def test_packed_rows_give_the_loss_of_one_sequence_per_row():
    """Sequence-level weights and rejections take a (row, segment) pair as the sequence."""
    case = rollout_case(lengths=(4, 4, 4, 4))
    args = {"rollout_is": "sequence", "rollout_rs": "seq_mean_k2", "rollout_rs_threshold": 0.04}
    objective = Objective.from_options(base_loss="ppo", base_loss_args=args, loss_agg="seq-mean-token-mean")
    leaves = leaves_of(case)
    rows = ours(case, objective, leaves).total
    batch = batch_of(case)
    packed = {k: v.reshape(2, 8, *v.shape[2:]) for k, v in batch.items()}
    packed["segment_ids"] = torch.tensor([[1] * 4 + [2] * 4] * 2)
    packed_case = {**case, "x": case["x"].reshape(2, 8, -1)}
    packed_leaves = [packed_case["x"].clone().requires_grad_(), case["weight"].clone().requires_grad_()]
    together = ours(packed_case, objective, packed_leaves, batch=packed).total
    torch.testing.assert_close(together, rows, rtol=1e-12, atol=1e-14)
    assert math.isfinite(float(rows))
