"""``model.grpo`` against TRL's own ``GRPOTrainer._compute_loss`` (the installed ``trl``): on one micro-batch
of a tiny Llama (float64 weights), every ``loss_type`` and option of ``GRPOConfig`` that we take gives
TRL's loss, the gradient of every parameter and its logged clip ratios, KL and entropy.

TRL's fused head computes the log-probabilities in float32 (whatever the model's dtype), ours in the
model's dtype: the two agree to float32's precision, hence ``rtol = 1e-5``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re
from typing import get_args

import pytest
import torch
from transformers import TrainingArguments
from trl import GRPOConfig, GRPOTrainer

from lit_losses import GRPOPreset, HFCausalLM
from lit_losses.aggregation.loader import GLOBAL_STATS_KEY
from lit_losses.objectives import TRLLossType
from lit_losses.trl_fields import trl_hint
from tests.aggregation.test_modes import split_step_loss
from tests.objectives import trl_grpo_trainer as trl
from tests.objectives.peer_trainers import perturbed

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

SEQ = {"importance_sampling_level": "sequence"}
BIAS_KL = {"beta": 0.04, "use_bias_correction_kl": True}
CASES = {
    "grpo": {"loss_type": "grpo"},
    "grpo-clip_higher-delta-kl": {"loss_type": "grpo", "epsilon_high": 0.28, "delta": 1.5, "beta": 0.04},
    "grpo-plain_kl": {"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": False},
    "gspo-bias_kl": {"loss_type": "grpo", **SEQ, **BIAS_KL},
    "bnpo": {"loss_type": "bnpo", "epsilon": 0.1},
    "dr_grpo-kl": {"loss_type": "dr_grpo", "max_completion_length": 9, "beta": 0.1},
    "dr_grpo-plain_kl": {
        "loss_type": "dr_grpo",
        "max_completion_length": 9,
        "beta": 0.1,
        "use_bias_correction_kl": False,
    },
    "dapo": {"loss_type": "dapo", "epsilon_high": 0.28},
    "dapo-bias_kl-delta": {"loss_type": "dapo", "delta": 1.3, **BIAS_KL},
    "dapo-gspo-kl": {"loss_type": "dapo", **SEQ, "beta": 0.02},
    "dapo-plain_kl": {"loss_type": "dapo", "beta": 0.02, "use_bias_correction_kl": False},
    "cispo-default_cap": {"loss_type": "cispo"},
    "cispo-kl": {"loss_type": "cispo", "epsilon_high": 1.25, **BIAS_KL},
    "sapo-temperatures-kl": {
        "loss_type": "sapo",
        "sapo_temperature_pos": 2.0,
        "sapo_temperature_neg": 0.5,
        **BIAS_KL,
    },
    "sapo-gspo": {"loss_type": "sapo", **SEQ},
    "luspo": {"loss_type": "luspo", **SEQ},
    "luspo-delta-kl": {"loss_type": "luspo", **SEQ, "delta": 1.4, "beta": 0.05},
    "luspo-token-plain_kl": {"loss_type": "luspo", "beta": 0.05, "use_bias_correction_kl": False},
    "vespo": {"loss_type": "vespo"},
    "grpo-entropy_bonus-kl": {"loss_type": "grpo", "entropy_coef": 0.05, "beta": 0.04},
    "dapo-entropy_bonus": {"loss_type": "dapo", "entropy_coef": 0.1},
    "vespo-gammas-bias_kl": {"loss_type": "vespo", "vespo_k_pos": 1.0, "vespo_lambda_neg": 0.7, **BIAS_KL},
}
RTOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The policy (float64) and a perturbed reference, saved where TRL loads it from."""
    policy = trl.llama(seed=0)
    reference = perturbed(policy, seed=1, scale=0.05)
    saved = tmp_path_factory.mktemp("reference")
    reference.save_pretrained(saved)
    return policy, reference, saved


def trl_run(models, cfg: dict, tmp_path, inputs=None):
    policy, reference, saved = models
    trainer = trl.grpo_trainer(copy.deepcopy(policy), tmp_path, reference=saved, **cfg)
    inputs = trl.trl_inputs(trainer, reference) if inputs is None else inputs
    loss, out = trl.trl_loss_and_grads(trainer, inputs)
    return inputs, loss, out


def our_run(policy, cfg: dict, batch: dict, **options):
    module = HFCausalLM(model=copy.deepcopy(policy), grpo=cfg, **options)
    module.train()
    out = module.compute_loss(batch)
    out.total.backward()
    grads = {n.removeprefix("model."): p.grad for n, p in module.named_parameters() if p.grad is not None}
    return out, grads


def assert_same_grads(ours: dict, theirs: dict) -> None:
    assert set(ours) == set(theirs) and len(ours) > 10
    scale = max(float(g.abs().max()) for g in theirs.values())
    assert scale > 1e-4  # a gradient the comparison can see
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, rtol=RTOL, atol=RTOL * scale, msg=name)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_loss_type_is_trl_s_compute_loss(models, name, tmp_path):
    """Loss, every parameter's gradient, the clip ratios (token-level ratios), the KL (token-mean
    types) and the entropy (with the entropy bonus) as TRL's ``_compute_loss`` logs them."""
    cfg = CASES[name]
    inputs, loss, theirs = trl_run(models, cfg, tmp_path)
    ours, grads = our_run(models[0], cfg, trl.our_batch(inputs))
    torch.testing.assert_close(ours.total.detach(), loss.double(), rtol=RTOL, atol=1e-6)  # float32 sums
    assert_same_grads(grads, theirs["grads"])
    preset = GRPOPreset(**cfg)
    metrics = theirs["metrics"]
    if preset.importance_sampling_level == "token":  # per sequence TRL's are means over sequences
        names = {"clip_ratio/low_mean": "clip_ratio_low", "clip_ratio/high_mean": "clip_ratio_high"}
        names |= {"clip_ratio/region_mean": "clip_ratio_region", "cispo_clip_ratio": "clip_ratio_high"}
        for key, value in metrics.items():
            if key in names:
                assert float(ours.base_metrics[names[key]]) == pytest.approx(value, rel=RTOL, abs=1e-9), key
    if "kl" in metrics and preset.options()["loss_agg"] == "token-mean":
        assert float(ours.terms["kl_reference"]["value"]) == pytest.approx(metrics["kl"], rel=RTOL)
    if preset.entropy_coef > 0:  # TRL's entropy: the bonus term's value (-H̄)
        assert -float(ours.terms["entropy"]["value"]) == pytest.approx(metrics["entropy"], rel=RTOL)
    clipped = preset.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo")
    if clipped and preset.importance_sampling_level == "token":
        assert 0 < metrics["clip_ratio/region_mean"] < 1  # the data clips some tokens and not others


VLLM = {"vllm_importance_sampling_correction": True}
CORRECTIONS = {
    "sequence_mask-default": {"loss_type": "dapo", **VLLM},
    "sequence_mask-band": {
        "loss_type": "grpo",
        **VLLM,
        "vllm_importance_sampling_clip_min": 0.5,
        "vllm_importance_sampling_clip_max": 1.5,
    },
    "sequence_truncate": {"loss_type": "bnpo", **VLLM, "vllm_importance_sampling_mode": "sequence_truncate"},
    "token_truncate-kl": {
        "loss_type": "dapo",
        **VLLM,
        "vllm_importance_sampling_mode": "token_truncate",
        "vllm_importance_sampling_clip_max": 1.2,
        "beta": 0.05,
    },
    "token_mask-band-plain_kl": {
        "loss_type": "cispo",
        **VLLM,
        "vllm_importance_sampling_mode": "token_mask",
        "vllm_importance_sampling_clip_min": 0.8,
        "vllm_importance_sampling_clip_max": 1.25,
        "beta": 0.05,
        "use_bias_correction_kl": False,
    },
    "token_truncate-deprecated_cap": {
        "loss_type": "bnpo",
        **VLLM,
        "vllm_importance_sampling_mode": "token_truncate",
        "vllm_importance_sampling_cap": 1.3,
    },
    "token_mask-vespo": {
        "loss_type": "vespo",
        **VLLM,
        "vllm_importance_sampling_mode": "token_mask",
        "vllm_importance_sampling_clip_max": 1.5,
    },
    "sapo-sequence_truncate-off_policy": {
        "loss_type": "sapo",
        **VLLM,
        "vllm_importance_sampling_mode": "sequence_truncate",
        "off_policy_mask_threshold": 0.02,
    },
    "off_policy_mask-gspo-kl": {
        "loss_type": "grpo",
        "importance_sampling_level": "sequence",
        "off_policy_mask_threshold": 0.02,
        **VLLM,
        "vllm_importance_sampling_mode": "token_truncate",
        "vllm_importance_sampling_clip_max": 1.5,
        "beta": 0.05,
    },
}


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_each_vllm_correction_is_trl_s_scoring_and_loss(models, name, tmp_path):
    """TRL's ``_generate_and_score_completions`` on a sampler's log-probabilities (its vLLM path) and then
    its ``_compute_loss``: our loss, gradients and sampling metrics on the same sampler, π_old and
    advantages."""
    policy, _, saved = models
    cfg = CORRECTIONS[name]
    trainer = trl.grpo_trainer(copy.deepcopy(policy), tmp_path, reference=saved, **cfg)
    scored = trl.generate_and_score(trainer)
    metrics = scored.pop("metrics")
    weights = scored["importance_sampling_ratio"]
    if weights.shape[1] > 1:
        weights = weights[scored["completion_mask"].bool()]
    mode = cfg.get("vllm_importance_sampling_mode", "sequence_mask")
    cap = cfg.get("vllm_importance_sampling_cap", cfg.get("vllm_importance_sampling_clip_max", 3.0))
    bounds = [cfg.get("vllm_importance_sampling_clip_min"), cap]
    acted = (weights == 0) if mode.endswith("mask") else torch.isin(weights, torch.tensor(bounds[1:]))
    assert 0 < float(acted.float().mean()) < 1, weights  # the correction masks or clips some, not all
    loss, theirs = trl.trl_loss_and_grads(trainer, scored)
    ours, grads = our_run(policy, cfg, trl.our_batch(scored, sampler="sampling_per_token_logps"))
    torch.testing.assert_close(ours.total.detach(), loss.double(), rtol=RTOL, atol=1e-6)  # float32 sums
    assert_same_grads(grads, theirs["grads"])
    logged = ours.base_metrics
    diff = metrics["sampling/sampling_logp_difference/mean"]
    assert float(logged["rollout_logprob_diff_mean"]) == pytest.approx(diff, rel=RTOL)
    diff_max = metrics["sampling/sampling_logp_difference/max"]
    assert float(logged["rollout_logprob_diff_max"]) == pytest.approx(diff_max, rel=RTOL)
    if mode.startswith("token"):  # TRL's sequence-level mean is over sequences, ours over tokens
        is_mean = metrics["sampling/importance_sampling_ratio/mean"]
        assert float(logged["rollout_is_weight_mean"]) == pytest.approx(is_mean, rel=RTOL)


# GRPOConfig fields (beyond TrainingArguments) that are no loss option: generation, rewards, vLLM, logging,
# the model's loading and the reference's syncing; the records carry completions, advantages and log-probs
NOT_LOSS = set(
    [
        "model_init_kwargs",
        "trust_remote_code",
        "disable_dropout",
        "cast_lm_head_to_fp32",
        "num_generations",
        "num_generations_eval",
        "ds3_gather_for_generation",
        "shuffle_dataset",
        "pad_to_multiple_of",
        "generation_batch_size",
        "steps_per_generation",
        "top_p",
        "top_k",
        "min_p",
        "generation_kwargs",
        "chat_template_kwargs",
        "repetition_penalty",
        "cache_implementation",
        "use_vllm",
        "num_iterations",
        "reward_weights",
        "multi_objective_aggregation",
        "scale_rewards",
        "sync_ref_model",
        "ref_model_mixup_alpha",
        "ref_model_sync_steps",
        "max_tool_calling_iterations",
        "log_completions",
        "log_multimodal",
        "num_completions_to_print",
        "log_unique_prompts",
        "log_completions_hub_repo",
        "router_aux_loss_coef",
        "use_transformers_continuous_batching",
        "transformers_continuous_batching_config",
        "use_transformers_paged",
        "entropy_coef_min",
        "entropy_coef_max",
        "entropy_coef_delta",
        "entropy_target",
    ]
)


def test_every_grpo_config_field_is_taken_or_named_in_the_hint_or_no_loss_option():
    """TRL's ``GRPOConfig`` (the installed version): each of its own fields is a field of ``model.grpo``,
    or an unknown field whose error names where it goes (`trl_hint`), or no loss option (`NOT_LOSS`,
    ``vllm_*`` server fields); a field TRL adds fails here until it is placed."""
    own = {f.name for f in dataclasses.fields(GRPOConfig)}
    own -= {f.name for f in dataclasses.fields(TrainingArguments)}
    taken = {f.name for f in dataclasses.fields(GRPOPreset)}
    server = {n for n in own if n.startswith("vllm_") and n not in taken}
    unplaced = sorted(n for n in own - taken - NOT_LOSS - server if not trl_hint(n))
    assert unplaced == []
    assert own >= NOT_LOSS  # no stale names


def test_every_trl_loss_type_is_a_choice_of_model_grpo():
    """The loss types TRL's ``_compute_loss`` branches on are ``TRLLossType``'s."""
    source = inspect.getsource(GRPOTrainer._compute_loss)
    branches = re.findall(r"self\.loss_type (?:==|in|!=) (\[[^\]]*\]|\"\w+\")", source)
    named = {name for branch in branches for name in re.findall(r"\"(\w+)\"", branch)}
    assert named == set(get_args(TRLLossType))


SPLIT = ((6, 3), (5, 2, 4), (1,))  # one process, 3 accumulated micro-batches of unequal sizes
SPLIT_PRESETS = {
    "grpo": ({"loss_type": "grpo", "beta": 0.05}, "local"),
    "sapo": ({"loss_type": "sapo"}, "local"),
    "bnpo": ({"loss_type": "bnpo"}, "local"),
    "dr_grpo": ({"loss_type": "dr_grpo", "max_completion_length": 8}, "local"),
    "luspo": ({"loss_type": "luspo", **SEQ}, "local"),
    "dapo": ({"loss_type": "dapo", "beta": 0.05}, "global"),
    "cispo": ({"loss_type": "cispo", "epsilon_high": 1.2}, "global"),
    "vespo": ({"loss_type": "vespo"}, "global"),
}


@pytest.mark.parametrize("name", sorted(SPLIT_PRESETS))
def test_accumulated_micro_batches_give_the_full_batch_where_trl_s_own_normalization_may_not(
    models, name, tmp_path
):
    """TRL's ``_compute_loss`` over 3 accumulated micro-batches (``current_gradient_accumulation_steps =
    steps_per_generation = 3``, ``num_items_in_batch`` the window's tokens), summed as its training step
    does, against its value on the whole batch: equal for ``dapo``, ``cispo``, ``vespo``, off for the
    types that normalize each micro-batch by itself. Ours on the same split is the whole batch's."""
    cfg, normalization = SPLIT_PRESETS[name]
    policy, reference, saved = models
    trainer = trl.grpo_trainer(copy.deepcopy(policy), tmp_path, reference=saved, **cfg)
    lengths = tuple(n for micro in SPLIT for n in micro)
    full = trl.trl_inputs(trainer, reference, seed=7, lengths=lengths)
    full_loss, full_out = trl.trl_loss_and_grads(trainer, full)

    micro, start = [], 0
    for sizes in SPLIT:
        rows = slice(start, start + len(sizes))
        start += len(sizes)
        micro.append({k: v if k == "num_items_in_batch" else v[rows] for k, v in full.items()})
    trainer.current_gradient_accumulation_steps = trainer.args.steps_per_generation = len(SPLIT)
    trl_split = sum(trl.trl_loss_and_grads(trainer, m)[0] for m in micro)
    gap = float((trl_split - full_loss).abs() / full_loss.abs())
    assert gap < 1e-6 if normalization == "global" else gap > 1e-3, gap

    module = HFCausalLM(model=copy.deepcopy(policy), grpo=cfg)
    module.train()
    grid = [[trl.our_batch(m) for m in micro]]
    split = split_step_loss(
        grid, len(SPLIT), lambda batch, stats: module.compute_loss({**batch, GLOBAL_STATS_KEY: stats}).total
    )
    split.backward()
    grads = {n.removeprefix("model."): p.grad for n, p in module.named_parameters() if p.grad is not None}
    torch.testing.assert_close(split.detach(), full_loss.double(), rtol=RTOL, atol=1e-6)
    assert_same_grads(grads, full_out["grads"])
