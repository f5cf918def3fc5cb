"""TRL's ``GRPOTrainer._compute_loss`` and Liger-Kernel's ``LigerFusedLinearGRPOFunction.ppo_loss_fn``,
written again here from their formulas (float64, padded ``[B, T]`` rows, one sequence per row), with the
normalizers they use in one process's micro-batch.

Notation as in TRL: ``lp`` the policy's per-token log-probabilities (with gradient), ``old`` the
sampler's, ``ref`` the reference's, ``adv`` one advantage per row ``(B,)``, ``mask`` the completion mask.
``coef_1`` the importance ratio (per token, or per row for ``importance_sampling_level="sequence"``).
Liger-Kernel computes the same per-token losses and, for one chunk that holds the whole micro-batch, the
same normalizers (its ``grpo``/``sapo`` divide by ``full_attention_mask.shape[0]``, its ``dapo`` by
``num_items_in_batch / world_size``); it refuses sequence-level ratios for ``cispo``, ``sapo`` and
``vespo``, which TRL accepts.
"""

from __future__ import annotations

import math

import torch

DEFAULTS = {
    "loss_type": "dapo",
    "epsilon": 0.2,
    "epsilon_high": None,
    "delta": None,
    "beta": 0.0,
    "use_bias_correction_kl": True,
    "importance_sampling_level": "token",
    "max_completion_length": None,
    "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,
    "vespo_k_pos": 2.0,
    "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0,
}
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def importance_weights(lp, old, mask, level):
    """``coef_1 = exp(log_importance_weights)``: ``[B, T]`` per token, ``[B, 1]`` per sequence."""
    log_ratio = lp - old
    if level == "token":
        return torch.exp(log_ratio)
    per_row = []
    for b in range(lp.shape[0]):  # the mean of log_ratio over the row's completion tokens
        valid = mask[b].bool()
        per_row.append(log_ratio[b][valid].sum() / max(int(valid.sum()), 1))
    return torch.exp(torch.stack(per_row))[:, None]


def gamma_weights(lp, old, adv, mask, cfg):
    """VESPO's ``phi_seq`` ``[B, 1]``: ``exp(λ + k log w − λ w)``, ``log w = clamp(Σ_t clamp(log ratio,
    ±20) · mask, log 1e-8, 20)``, ``(k, λ)`` by the sign of the row's advantage; no gradient."""
    rows = []
    with torch.no_grad():
        for b in range(lp.shape[0]):
            seq = ((lp[b] - old[b]).clamp(-20.0, 20.0) * mask[b]).sum()
            log_w = seq.clamp(math.log(1e-8), 20.0)
            pos = bool(adv[b] >= 0)
            k = cfg["vespo_k_pos"] if pos else cfg["vespo_k_neg"]
            lam = max(cfg["vespo_lambda_pos"] if pos else cfg["vespo_lambda_neg"], 1e-4)
            rows.append(torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(0.0, 0.0, 0.0))
    return torch.stack(rows)[:, None]


def per_token_terms(lp, old, ref, adv, mask, cfg):
    """``(per_token_loss, per_token_kl or None, coef_1, phi or None)``: TRL's per-token loss before
    aggregation (the KL already added with weight ``beta``; its bias correction uses ``coef_1`` before
    ``delta``), and ``coef_1`` as TRL's clip metrics read it (after ``delta``)."""
    cfg = {**DEFAULTS, **cfg}
    loss_type, eps_low = cfg["loss_type"], cfg["epsilon"]
    eps_high = eps_low if cfg["epsilon_high"] is None else cfg["epsilon_high"]
    coef_1 = importance_weights(lp, old, mask, cfg["importance_sampling_level"])
    a = adv[:, None]
    phi = None
    if loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=eps_high).detach() * a * lp
    elif loss_type in CLIPPED:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        capped = coef_1 if cfg["delta"] is None else torch.clamp(coef_1, max=cfg["delta"])
        per_token = -torch.min(capped * a, coef_2 * a)
    elif loss_type == "sapo":
        temperatures = [
            cfg["sapo_temperature_pos"] if bool(v > 0) else cfg["sapo_temperature_neg"] for v in adv
        ]
        tau = torch.tensor(temperatures, dtype=lp.dtype)[:, None]
        per_token = -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * a
    elif loss_type == "vespo":
        phi = gamma_weights(lp, old, adv, mask, cfg)
        per_token = -phi * a * lp
    else:
        raise KeyError(loss_type)
    kl = None
    if cfg["beta"] != 0.0:
        kl = torch.exp(ref - lp) - (ref - lp) - 1
        if cfg["use_bias_correction_kl"]:
            kl = kl * coef_1
        per_token = per_token + cfg["beta"] * kl
    if loss_type in CLIPPED and cfg["delta"] is not None:
        coef_1 = torch.clamp(coef_1, max=cfg["delta"])
    return per_token, kl, coef_1, phi


def trl_loss(lp, old, ref, adv, mask, cfg, num_items_in_batch=None, num_processes=1, accumulation=1):
    """The loss TRL's ``_compute_loss`` returns for one micro-batch of one process (before DDP's average
    over processes): ``grpo``/``sapo``/``bnpo``/``dr_grpo``/``luspo`` divided by the gradient-accumulation
    steps, ``dapo``/``cispo``/``vespo`` by ``num_items_in_batch / num_processes``."""
    cfg = {**DEFAULTS, **cfg}
    per_token, _, _, _ = per_token_terms(lp, old, ref, adv, mask, cfg)
    return trl_aggregate(per_token, mask, cfg, num_items_in_batch, num_processes, accumulation)


def trl_aggregate(per_token, mask, cfg, num_items_in_batch=None, num_processes=1, accumulation=1):
    """TRL's normalization of ``per_token_loss`` by ``loss_type`` (the end of ``_compute_loss``)."""
    lp = per_token
    mask = mask.to(lp.dtype)
    loss_type = cfg["loss_type"]
    if loss_type in ("grpo", "sapo"):
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * cfg["max_completion_length"]) / accumulation
    if loss_type in ("dapo", "cispo", "vespo"):
        items = (
            mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=lp.dtype)
        )
        return (per_token * mask).sum() / (items.clamp(min=1.0) / num_processes)
    if loss_type == "luspo":
        return (per_token * mask).sum(-1).mean() / accumulation
    raise KeyError(loss_type)


def trl_metrics(lp, old, ref, adv, mask, cfg) -> dict[str, float]:
    """TRL's logged ``clip_ratio/{low,high,region}_mean`` (token level), ``cispo_clip_ratio`` and ``kl``:
    masked means over the tokens (``global_masked_mean``)."""
    cfg = {**DEFAULTS, **cfg}
    _, kl, coef_1, _ = per_token_terms(lp.detach(), old, ref, adv, mask, cfg)
    eps_low = cfg["epsilon"]
    eps_high = eps_low if cfg["epsilon_high"] is None else cfg["epsilon_high"]
    a, m = adv[:, None], mask.to(lp.dtype)

    def mean(x):
        return float((x.to(lp.dtype) * m).sum() / m.sum())

    out = {}
    if kl is not None:
        out["kl"] = mean(kl)
    if cfg["loss_type"] in CLIPPED:
        low, high = (coef_1 < 1 - eps_low) & (a < 0), (coef_1 > 1 + eps_high) & (a > 0)
        out |= {
            "clip_ratio_low": mean(low),
            "clip_ratio_high": mean(high),
            "clip_ratio_region": mean(low | high),
        }
    elif cfg["loss_type"] == "cispo":
        out["clip_ratio_high"] = mean((coef_1 > eps_high) & (a > 0))
    return out


LIGER_REFUSES_SEQUENCE = ("cispo", "sapo", "vespo")


def liger_loss(lp, old, ref, adv, mask, cfg, num_items_in_batch=None):
    """Liger-Kernel's ``ppo_loss_fn`` on one chunk holding the whole micro-batch (``attention_mask`` =
    ``full_attention_mask``), one process: its per-token loss is TRL's; its normalizers are written over
    the full batch's mask (``full_attention_mask.shape[0]``, ``.sum()``, ``B · T``)."""
    cfg = {**DEFAULTS, **cfg}
    if cfg["importance_sampling_level"] == "sequence" and cfg["loss_type"] in LIGER_REFUSES_SEQUENCE:
        raise ValueError(f"Liger-Kernel refuses sequence-level importance sampling for {cfg['loss_type']!r}")
    per_token, _, _, _ = per_token_terms(lp, old, ref, adv, mask, cfg)
    m = mask.to(lp.dtype)
    rows = m.shape[0]
    loss_type = cfg["loss_type"]
    if loss_type in ("grpo", "sapo"):
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum() / rows
    if loss_type == "bnpo":
        return (per_token * m).sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * m).sum() / (rows * cfg["max_completion_length"])
    if loss_type in ("dapo", "cispo", "vespo"):
        items = m.sum() if num_items_in_batch is None else torch.as_tensor(float(num_items_in_batch))
        return (per_token * m).sum() / items.clamp(min=1.0)
    if loss_type == "luspo":
        weighted = per_token * m.sum(1, keepdim=True)
        return weighted.sum() / (rows * weighted.shape[1])
    raise KeyError(loss_type)
