"""The rollout corrections written again from their sources (float64, padded ``[B, T]`` rows, one
sequence per row), to test `lit_losses.objectives.mismatch` and the corrected losses against.

- TRL (``trl/trainer/grpo_trainer.py``, main of 2026-07): the importance-sampling ratio of
  ``_generate_and_score_completions`` (``vllm_importance_sampling_mode``, ``_clip_min``/``_clip_max``),
  ``get_off_policy_mask``, ``get_gamma_weights`` with ``importance_sampling_ratio``, and the order in
  which ``_compute_loss`` applies them: ``per_token_loss × off_policy_mask × importance_sampling_ratio``
  (not for ``vespo``, whose gamma weight takes the ratio), then ``+ β · KL``, then the ``loss_type``'s
  normalization with the completion mask (the masked tokens stay in the counts).
- verl (``verl/trainer/ppo/rollout_corr_helper.py`` and ``core_algos.py``, main of 2026-01):
  ``compute_rollout_correction_weights`` (no batch normalization), ``compute_rollout_rejection_mask``
  with ``_parse_rollout_rs_thresholds``, ``compute_policy_loss_vanilla`` (dual-clip PPO, ``pg_losses ×
  rollout_is_weights``) and ``agg_loss`` over the response mask that the rejection replaced.

Notation: ``lp`` the policy's log-probabilities (with gradient), ``old`` π_old's, ``sampling`` the
engine's (π_rollout), ``mask`` the completion mask, ``adv`` one advantage per row.
"""

from __future__ import annotations

import math

import torch

from tests.objectives import trl_reference

SAFETY_BOUND = 20.0
TRL_DEFAULTS = {
    "vllm_importance_sampling_correction": False,
    "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_min": None,
    "vllm_importance_sampling_clip_max": 3.0,
    "off_policy_mask_threshold": None,
}


# ---- TRL ----------------------------------------------------------------------------------------------
def trl_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """``vllm_importance_sampling_ratio``: ``(B, T)`` per token, ``(B, 1)`` per sequence."""
    per_token_logps_diff = (old - sampling) * mask
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True) if sequence_level_is else per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    min_val = clip_min if clip_min is not None else -math.inf
    max_val = clip_max if clip_max is not None else math.inf
    invalid = (ratio < min_val) | (ratio > max_val)
    return ratio.masked_fill(invalid, value=0.0)


def trl_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
    """``get_off_policy_mask``: ``(B, 1)``, 1 = keep."""
    kl_div = sampling_per_token_logps - per_token_logps.detach()
    seq_kl_sum = (kl_div * mask).sum(dim=1, keepdim=True)
    avg_seq_kl = seq_kl_sum / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    is_pos_adv = advantages >= 0
    is_low_kl = avg_seq_kl <= off_policy_threshold
    return (is_pos_adv | is_low_kl).to(dtype=mask.dtype)


def trl_gamma_weights(advantages, log_ratio_per_token, mask, importance_sampling_ratio, cfg):
    """``get_gamma_weights`` (VESPO's ``φ`` per row) with TRL's importance-sampling ratio in log space."""
    lower_clamp = math.log(1e-8)
    with torch.no_grad():
        log_ratio_clamped = torch.clamp(log_ratio_per_token, -20.0, 20.0)
        seq_log_ratio = torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)
        if importance_sampling_ratio is not None:
            log_is_ratio = torch.clamp(torch.log(importance_sampling_ratio), lower_clamp, 20.0)
            seq_log_ratio += torch.sum(log_is_ratio, dim=-1, keepdim=True)
        log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
        w_seq = torch.exp(log_w_seq)
        is_nonneg_adv = advantages >= 0
        # TRL's torch.where of two Python floats gives the default dtype; float64 here, as the loss is
        k_seq = torch.where(
            is_nonneg_adv, *(w_seq.new_tensor(cfg[k]) for k in ("vespo_k_pos", "vespo_k_neg"))
        )
        lambdas = (w_seq.new_tensor(cfg[k]) for k in ("vespo_lambda_pos", "vespo_lambda_neg"))
        lambda_seq = torch.where(is_nonneg_adv, *lambdas).clamp(min=1e-4)
        log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
        return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def trl_corrected_per_token(lp, old, sampling, ref, adv, mask, cfg):
    """``_compute_loss``'s ``per_token_loss`` (before the normalization) with the vLLM
    importance-sampling correction and the off-policy mask; ``old`` may be ``lp.detach()``."""
    cfg = {**trl_reference.DEFAULTS, **TRL_DEFAULTS, **cfg}
    m = mask.to(lp.dtype)
    ratio = None
    if cfg["vllm_importance_sampling_correction"]:
        mode = cfg["vllm_importance_sampling_mode"]
        clip_min, clip_max = (
            cfg["vllm_importance_sampling_clip_min"],
            cfg["vllm_importance_sampling_clip_max"],
        )
        ratio = trl_is_ratio(old, sampling, m, mode, clip_min, clip_max)
    a = adv[:, None]
    if cfg["loss_type"] == "vespo":
        phi = trl_gamma_weights(a, lp - old, m, ratio, cfg)
        per_token = -phi * a * lp
    else:
        per_token, _, _, _ = trl_reference.per_token_terms(lp, old, ref, adv, mask, {**cfg, "beta": 0.0})
    if cfg["off_policy_mask_threshold"] is not None:
        per_token = per_token * trl_off_policy_mask(a, lp, sampling, m, cfg["off_policy_mask_threshold"])
    if ratio is not None and cfg["loss_type"] != "vespo":
        per_token = per_token * ratio
    if cfg["beta"] != 0.0:
        kl = torch.exp(ref - lp) - (ref - lp) - 1
        if cfg["use_bias_correction_kl"]:
            kl = kl * trl_reference.importance_weights(lp, old, mask, cfg["importance_sampling_level"])
        per_token = per_token + cfg["beta"] * kl
    return per_token


def trl_corrected_loss(lp, old, sampling, ref, adv, mask, cfg):
    """TRL's loss of one micro-batch of one process."""
    per_token = trl_corrected_per_token(lp, old, sampling, ref, adv, mask, cfg)
    return trl_reference.trl_aggregate(per_token, mask, {**trl_reference.DEFAULTS, **cfg})


# ---- verl ---------------------------------------------------------------------------------------------
def masked_sum(values, mask, axis=None):
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def masked_mean(values, mask, axis=None):
    return masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def verl_is_weights(log_ratio, response_mask, rollout_is, rollout_is_threshold):
    """``compute_rollout_correction_weights`` without batch normalization: detached, 0 at padding."""
    if rollout_is == "token":
        weights = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    else:
        log_ratio_sum = masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        weights = torch.exp(torch.clamp(log_ratio_sum, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(
            log_ratio
        )
    weights = weights * response_mask
    return weights.clamp(max=rollout_is_threshold).detach()


def verl_parse_thresholds(options, threshold_spec):
    """``_parse_rollout_rs_thresholds``: option → ``{"lower", "upper"}``."""
    raw = [str(threshold_spec)] if isinstance(threshold_spec, int | float) else threshold_spec.split(",")
    raw = [part.strip() for part in raw if part.strip()]
    if len(raw) == 1 and len(options) > 1:
        raw = raw * len(options)
    out = {}
    for option, spec in zip(options, raw, strict=False):
        if option.endswith("k1"):
            lower_str, upper_str = spec.split("_", 1) if "_" in spec else (str(1.0 / float(spec)), spec)
            out[option] = {"lower": float(lower_str), "upper": float(upper_str)}
        else:
            out[option] = {"lower": None, "upper": float(spec)}
    return out


def verl_rejection_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold):
    """``compute_rollout_rejection_mask``'s ``modified_response_mask`` (every option must pass)."""
    options = []
    for opt in (o.strip() for o in rollout_rs.split(",") if o.strip()):
        if opt not in options:
            options.append(opt)
    specs = verl_parse_thresholds(options, rollout_rs_threshold)
    log_ratio_safe = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    token = {
        "k1": -log_ratio_safe,
        "k2": 0.5 * log_ratio_safe**2,
        "k3": torch.exp(log_ratio_safe) - 1.0 - log_ratio_safe,
    }
    combined = torch.ones_like(response_mask, dtype=log_ratio.dtype)

    def sequence_max(values):
        masked = values.masked_fill(~response_mask.bool(), float("-inf"))
        top = masked.max(dim=-1).values
        return torch.where(top == float("-inf"), torch.zeros_like(top), top)

    for option in options:
        k = option[-2:]
        upper, lower = specs[option]["upper"], specs[option]["lower"]
        if option.startswith("token"):
            stat = token[k]
        elif option.startswith("seq_sum"):
            stat = masked_sum(token[k], response_mask, axis=-1).unsqueeze(-1).expand_as(response_mask)
        elif option.startswith("seq_mean"):
            stat = masked_mean(token[k], response_mask, axis=-1).unsqueeze(-1).expand_as(response_mask)
        else:
            stat = sequence_max(token[k]).unsqueeze(-1).expand_as(response_mask)
        keep = (stat >= math.log(lower)) & (stat <= math.log(upper)) if k == "k1" else stat <= upper
        combined = combined * keep.to(log_ratio.dtype)
    return (response_mask * combined).to(dtype=response_mask.dtype)


def verl_vanilla_pg_losses(old, lp, adv, clip_ratio_low, clip_ratio_high, clip_ratio_c):
    """``compute_policy_loss_vanilla``'s ``pg_losses`` (dual-clip PPO), before the correction weights."""
    negative_approx_kl = torch.clamp(lp - old, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -adv * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    return torch.where(adv < 0, clip_pg_losses2, clip_pg_losses1)


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, eps=1e-8):
    """``agg_loss`` of one process (``dp_size = 1``, the counts of this batch); ``eps``: the ``1e-8``
    verl adds to a sequence's token count in ``seq-mean-token-mean`` (lit_losses divides by the count)."""
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, loss_mask) / loss_mask.sum()
    seq_mask = torch.sum(loss_mask, dim=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
    else:  # seq-mean-token-mean
        count = seq_mask + eps if eps else seq_mask.clamp(min=1)  # a rejected sequence's 0 / 0, without NaN
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / count
    seq_valid = (seq_mask > 0).to(loss_mat.dtype)
    return masked_sum(seq_losses, seq_valid) / seq_valid.sum()


def verl_corrected_loss(lp, old, rollout, adv, response_mask, cfg, eps=1e-8):
    """verl's decoupled-mode policy loss: IS weights and the rejection from ``old``/``rollout`` over the
    original response mask, then dual-clip PPO × weights aggregated over the rejected mask (``eps``:
    `verl_agg_loss`'s)."""
    log_ratio = old - rollout
    m = response_mask.to(lp.dtype)
    weights = None
    if cfg.get("rollout_is") is not None:
        weights = verl_is_weights(log_ratio, m, cfg["rollout_is"], cfg.get("rollout_is_threshold", 2.0))
    if cfg.get("rollout_rs") is not None:
        m = verl_rejection_mask(log_ratio, m, cfg["rollout_rs"], cfg["rollout_rs_threshold"])
    pg_losses = verl_vanilla_pg_losses(
        old, lp, adv[:, None], cfg["clip_ratio"], cfg["clip_ratio"], cfg["clip_ratio_c"]
    )
    if weights is not None:
        pg_losses = pg_losses * weights
    return verl_agg_loss(pg_losses, m, cfg["loss_agg_mode"], eps=eps)


# verl's RolloutCorrectionConfig factories of decoupled mode (their default arguments), and IcePop's band
VERL_PRESETS = {
    "decoupled_token_is": {"rollout_is": "token", "rollout_is_threshold": 2.0},
    "decoupled_seq_is": {"rollout_is": "sequence", "rollout_is_threshold": 2.0},
    "decoupled_seq_is_rs": {
        "rollout_is": "sequence",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "seq_sum_k1",
        "rollout_rs_threshold": "0.5_2.0",
    },
    "decoupled_geo_rs": {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"},
    "decoupled_geo_rs_seq_tis": {
        "rollout_is": "sequence",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "seq_mean_k1",
        "rollout_rs_threshold": "0.999_1.001",
    },
    "decoupled_geo_rs_token_tis": {
        "rollout_is": "token",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "seq_mean_k1",
        "rollout_rs_threshold": "0.999_1.001",
    },
    "decoupled_k3_rs": {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01},
    "decoupled_k3_rs_seq_tis": {
        "rollout_is": "sequence",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "seq_mean_k3",
        "rollout_rs_threshold": 0.01,
    },
    "decoupled_k3_rs_token_tis": {
        "rollout_is": "token",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "seq_mean_k3",
        "rollout_rs_threshold": 0.01,
    },
}


def preset_fields(options: dict) -> dict:
    """The verl fields of ``options["rollout_correction_preset"]`` (empty without one)."""
    name = options.get("rollout_correction_preset")
    return dict(VERL_PRESETS[name]) if name else {}
