"""TRL's preference losses written again from its current source, in TRL's own layout (float64).

Each function takes what TRL's trainer has in one micro-batch of one process: the full logits
``[2P or B, L, V]`` of the policy (and of the reference), ``input_ids`` and ``completion_mask`` (or
``labels`` with ``-100``) ``[rows, L]`` of prompt + completion, and returns TRL's scalar loss and the
metrics it logs, step by step as its code does:

- ``DPOTrainer._compute_loss`` (``trl/trainer/dpo_trainer.py``): shifted per-token log-probabilities,
  sums (or LD-DPO's shared/tail sums), f-divergence scores, the loss-type loop with ``loss_weights``,
  WPO weights from the logits, ``sft`` as ``F.cross_entropy`` over the chosen completion tokens;
- ``CPOTrainer`` (``trl/experimental/cpo``): ``get_batch_logps`` (means for ``ipo``/``simpo``),
  ``cpo_loss``, the chosen NLL ``nn.CrossEntropyLoss`` and ``losses.mean() + cpo_alpha * nll_loss``;
- ``ORPOTrainer`` (``trl/experimental/orpo``): mean log-probabilities, ``odds_ratio_loss`` and the
  chosen NLL over the whole chosen sequence (prompt and completion), ``nll_loss − losses.mean()``;
- ``KTOTrainer._compute_loss`` (``trl/trainer/kto_trainer.py``): sums, the KL estimate from the
  mismatched rows (mean, detached, clamped at 0), the ``kto``/``apo_zero_unpaired`` losses,
  ``losses.nanmean()``.

Deviations, all of dtype only: TRL's ``alpha_divergence`` casts the exponent to float32 (and has no
float64 entry in its cap table: it fails on float64); ORPO casts the log-probabilities to float32. Both
are computed here in float64, so the comparison is to float64 precision.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

DPO_DEFAULTS = {
    "loss_type": ["sigmoid"],
    "loss_weights": None,
    "beta": 0.1,
    "label_smoothing": 0.0,
    "ld_alpha": None,
    "f_divergence_type": "reverse_kl",
    "f_alpha_divergence_coef": 0.5,
    "use_weighting": False,
    "discopop_tau": 0.05,
}


def selective_log_softmax(logits, index):
    """``log_softmax(logits)[index]`` (TRL's ``selective_log_softmax``)."""
    return torch.log_softmax(logits, dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)


def dpo_sequence_logps(per_token_logps, shift_completion_mask, ld_alpha):
    """The sums of TRL's ``_compute_loss`` (or LD-DPO's ``shared + ld_alpha · tail``)."""
    if ld_alpha is None:
        return per_token_logps.sum(dim=1)
    comp_pos = shift_completion_mask.cumsum(dim=1)
    comp_lens = shift_completion_mask.sum(dim=1).long()
    chosen_lens, rejected_lens = comp_lens.chunk(2, dim=0)
    shared_lens = torch.minimum(chosen_lens, rejected_lens)
    shared_lens = torch.cat([shared_lens, shared_lens], dim=0)
    shared_mask = (comp_pos > 0) & (comp_pos <= shared_lens.unsqueeze(1))
    tail_mask = comp_pos > shared_lens.unsqueeze(1)
    return (per_token_logps * shared_mask).sum(dim=1) + ld_alpha * (per_token_logps * tail_mask).sum(dim=1)


def f_scores(logratios, cfg):
    """TRL's f-divergence branch (``alpha_divergence`` in the input's dtype, see the module)."""
    kind = cfg["f_divergence_type"]
    if kind == "reverse_kl":
        return logratios
    if kind == "forward_kl":
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    alpha = cfg["f_alpha_divergence_coef"]
    if abs(alpha - 1.0) < 1e-6:
        return logratios
    coef = 1.0 / (alpha - 1.0)
    t = (alpha - 1.0) * logratios
    return (torch.exp(torch.clamp(t, max=80.0)) - 1.0) * coef


def dpo_per_sequence(name, v, cfg):
    """One iteration of TRL's loss-type loop: ``per_sequence_loss`` of ``name``."""
    beta, ls = cfg["beta"], cfg["label_smoothing"]
    cs, rs = v["chosen_scores"], v["rejected_scores"]
    delta_score = cs - rs
    if name == "sigmoid":
        return -F.logsigmoid(beta * delta_score)
    if name == "hinge":
        return torch.relu(1 - beta * delta_score)
    if name in ("ipo", "sigmoid_norm"):
        chosen_mask, rejected_mask = v["completion_mask"].chunk(2, dim=0)
        chosen_avg_score = cs / chosen_mask.sum(dim=1).clamp(min=1.0)
        rejected_avg_score = rs / rejected_mask.sum(dim=1).clamp(min=1.0)
        if name == "ipo":
            return (chosen_avg_score - rejected_avg_score - 1 / (2 * beta)) ** 2
        return -F.logsigmoid(beta * (chosen_avg_score - rejected_avg_score))
    if name == "exo_pair":
        epsilon = torch.tensor(ls, dtype=cs.dtype)
        qw = torch.sigmoid(beta * delta_score)
        log_qw = F.logsigmoid(beta * delta_score)
        log_pw = torch.log1p(-epsilon)
        ql = torch.sigmoid(-beta * delta_score)
        log_ql = F.logsigmoid(-beta * delta_score)
        log_pl = torch.log(epsilon)
        return qw * (log_qw - log_pw) + ql * (log_ql - log_pl)
    if name == "nca_pair":
        chosen_rewards, rejected_rewards = beta * v["chosen_logratios"], beta * v["rejected_logratios"]
        return (
            -F.logsigmoid(chosen_rewards)
            - 0.5 * F.logsigmoid(-chosen_rewards)
            - 0.5 * F.logsigmoid(-rejected_rewards)
        )
    if name == "robust":
        clean_loss_term = -(1 - ls) * F.logsigmoid(beta * delta_score)
        flipped_loss_term = -ls * F.logsigmoid(-beta * delta_score)
        return (clean_loss_term - flipped_loss_term) / (1 - 2 * ls)
    if name == "bco_pair":
        return -F.logsigmoid(beta * v["chosen_logratios"]) - F.logsigmoid(-(beta * v["rejected_logratios"]))
    if name == "sppo_hard":
        return (v["chosen_logratios"] - 0.5 / beta) ** 2 + (v["rejected_logratios"] + 0.5 / beta) ** 2
    return dpo_per_sequence_more(name, v, cfg)


def dpo_per_sequence_more(name, v, cfg):
    """The rest of the loop (``aot`` ... ``sft``)."""
    beta, ls = cfg["beta"], cfg["label_smoothing"]
    delta_score = v["chosen_scores"] - v["rejected_scores"]
    if name in ("aot", "aot_unpaired"):
        if name == "aot":
            a = torch.sort(v["chosen_logps"] - v["rejected_logps"], dim=0)[0]
            b = torch.sort(v["ref_chosen_logps"] - v["ref_rejected_logps"], dim=0)[0]
        else:
            a = torch.sort(v["chosen_logratios"], dim=0)[0]
            b = torch.sort(v["rejected_logratios"], dim=0)[0]
        delta = a - b
        return -F.logsigmoid(beta * delta) * (1 - ls) - F.logsigmoid(-beta * delta) * ls
    if name == "apo_zero":
        return 1 - torch.sigmoid(beta * v["chosen_logratios"]) + torch.sigmoid(beta * v["rejected_logratios"])
    if name == "apo_down":
        logratios = v["chosen_logratios"] - v["rejected_logratios"]
        return torch.sigmoid(beta * v["chosen_logratios"]) + 1 - torch.sigmoid(beta * logratios)
    if name == "discopop":
        logits = delta_score * beta
        log_ratio_modulation = torch.sigmoid(logits / cfg["discopop_tau"])
        return -F.logsigmoid(logits) * (1 - log_ratio_modulation) + torch.exp(-logits) * log_ratio_modulation
    assert name == "sft", name
    chosen_logits, _ = v["shift_logits"].chunk(2, dim=0)
    chosen_labels, _ = v["shift_labels"].chunk(2, dim=0)
    chosen_mask, _ = v["shift_completion_mask"].chunk(2, dim=0)
    batch_loss = F.cross_entropy(chosen_logits[chosen_mask.bool()], chosen_labels[chosen_mask.bool()])
    return batch_loss.expand(chosen_logits.size(0))


def wpo_pair_weights(v):
    """TRL's ``use_weighting`` block: ``chosen_weights * rejected_weights``."""
    shift_logits, mask = v["shift_logits"], v["shift_completion_mask"]
    completion_lengths = mask.sum(dim=1).clamp_min(1)
    with torch.no_grad():
        lse1 = torch.logsumexp(shift_logits, dim=-1)
        lse2 = torch.logsumexp(2.0 * shift_logits, dim=-1)
        log_denom = lse2 - 2.0 * lse1
        aligned_logps = (v["per_token_logps"] - log_denom) * mask
    weights = torch.exp(aligned_logps.sum(dim=1) / completion_lengths)
    chosen_weights, rejected_weights = weights.chunk(2, dim=0)
    return chosen_weights * rejected_weights


def trl_dpo(logits, ref_logits, input_ids, completion_mask, cfg, ref_logps=None):
    """``DPOTrainer._compute_loss``: ``(loss, metrics)``; ``ref_logps``: precomputed ``(chosen,
    rejected)`` (``precompute_ref_log_probs``) instead of ``ref_logits``; neither: reference-free
    (TRL's former ``reference_free``: zeros)."""
    cfg = {**DPO_DEFAULTS, **cfg}
    shift_logits = logits[..., :-1, :]
    shift_labels = input_ids[..., 1:]
    shift_completion_mask = completion_mask[..., 1:]
    per_token_logps = selective_log_softmax(shift_logits, shift_labels)
    per_token_logps = per_token_logps.masked_fill(shift_completion_mask == 0, 0.0)
    logps = dpo_sequence_logps(per_token_logps, shift_completion_mask, cfg["ld_alpha"])
    chosen_logps, rejected_logps = logps.chunk(2, dim=0)
    if ref_logps is not None:
        ref_chosen_logps, ref_rejected_logps = ref_logps
    elif ref_logits is not None:
        with torch.no_grad():
            ref_per_token_logps = selective_log_softmax(ref_logits[..., :-1, :], shift_labels)
            ref_per_token_logps[shift_completion_mask == 0] = 0.0
            ref = dpo_sequence_logps(ref_per_token_logps, shift_completion_mask, cfg["ld_alpha"])
        ref_chosen_logps, ref_rejected_logps = ref.chunk(2, dim=0)
    else:
        ref_chosen_logps = ref_rejected_logps = torch.zeros_like(chosen_logps).detach()
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    v = {
        "chosen_logps": chosen_logps,
        "rejected_logps": rejected_logps,
        "ref_chosen_logps": ref_chosen_logps,
        "ref_rejected_logps": ref_rejected_logps,
        "chosen_logratios": chosen_logratios,
        "rejected_logratios": rejected_logratios,
        "chosen_scores": f_scores(chosen_logratios, cfg),
        "rejected_scores": f_scores(rejected_logratios, cfg),
        "completion_mask": completion_mask,
        "shift_logits": shift_logits,
        "shift_labels": shift_labels,
        "shift_completion_mask": shift_completion_mask,
        "per_token_logps": per_token_logps,
    }
    loss_types = cfg["loss_type"]
    loss_weights = cfg["loss_weights"] or [1.0] * len(loss_types)
    loss = 0.0
    for loss_type, loss_weight in zip(loss_types, loss_weights, strict=True):
        per_sequence_loss = dpo_per_sequence(loss_type, v, cfg)
        if cfg["use_weighting"]:
            per_sequence_loss = per_sequence_loss * wpo_pair_weights(v)
        loss = loss + per_sequence_loss.mean() * loss_weight
    chosen_rewards = cfg["beta"] * chosen_logratios.detach()
    rejected_rewards = cfg["beta"] * rejected_logratios.detach()
    metrics = {
        "chosen_rewards": chosen_rewards,
        "rejected_rewards": rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).double().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": chosen_logps.detach().mean(),
        "logps/rejected": rejected_logps.detach().mean(),
    }
    return loss, metrics


def get_batch_logps(logits, labels, average_log_prob):
    """CPO's/ORPO's ``get_batch_logps`` (decoder-only: shift inside)."""
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    loss_mask = labels != -100
    labels[labels == -100] = 0
    per_token_logps = selective_log_softmax(logits, labels)
    if average_log_prob:
        return (per_token_logps * loss_mask).sum(-1) / loss_mask.sum(-1)
    return (per_token_logps * loss_mask).sum(-1)


def cross_entropy_loss(logits, labels):
    """CPO's/ORPO's ``cross_entropy_loss`` (shifted, mean over labels ``!= -100``)."""
    logits = logits[..., :-1, :].contiguous()
    labels = labels[..., 1:].contiguous()
    return nn.CrossEntropyLoss()(logits.view(-1, logits.shape[-1]), labels.view(-1))


CPO_DEFAULTS = {
    "loss_type": "sigmoid",
    "beta": 0.1,
    "label_smoothing": 0.0,
    "cpo_alpha": 1.0,
    "simpo_gamma": 0.5,
    "alpha": 0.0,
}


def cpo_losses(policy_chosen_logps, policy_rejected_logps, cfg):
    """``CPOTrainer.cpo_loss``: ``(losses, chosen_rewards, rejected_rewards)``."""
    beta, ls, alpha = cfg["beta"], cfg["label_smoothing"], cfg["alpha"]
    if alpha != 0.0:
        chosen_probs = torch.exp(policy_chosen_logps)
        rejected_probs = torch.exp(policy_rejected_logps)
        policy_chosen_rewards = (1 - chosen_probs.pow(-alpha)) / alpha
        policy_rejected_rewards = (1 - rejected_probs.pow(-alpha)) / alpha
        logits = policy_chosen_rewards - policy_rejected_rewards
    else:
        logits = policy_chosen_logps - policy_rejected_logps
    if cfg["loss_type"] == "simpo":
        logits = logits - cfg["simpo_gamma"] / beta
        losses = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
    elif cfg["loss_type"] == "sigmoid":
        losses = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
    elif cfg["loss_type"] == "hinge":
        losses = torch.relu(1 - beta * logits)
    else:
        assert cfg["loss_type"] == "ipo"
        losses = (logits - 1 / (2 * beta)) ** 2
    if alpha != 0.0:
        return losses, beta * policy_chosen_rewards.detach(), beta * policy_rejected_rewards.detach()
    return losses, beta * policy_chosen_logps.detach(), beta * policy_rejected_logps.detach()


def trl_cpo(logits, labels, cfg):
    """``CPOTrainer.get_batch_loss_metrics`` on concatenated ``[chosen; rejected]`` rows: ``(loss,
    metrics)``; ``labels`` mask the prompt and padding with ``-100``."""
    cfg = {**CPO_DEFAULTS, **cfg}
    len_chosen = logits.shape[0] // 2
    if cfg["cpo_alpha"] == 0:
        nll_loss = torch.tensor(0.0, dtype=logits.dtype)
    else:
        nll_loss = cross_entropy_loss(logits[:len_chosen], labels[:len_chosen])
    all_logps = get_batch_logps(logits, labels, average_log_prob=cfg["loss_type"] in ["ipo", "simpo"])
    chosen_logps, rejected_logps = all_logps[:len_chosen], all_logps[len_chosen:]
    losses, chosen_rewards, rejected_rewards = cpo_losses(chosen_logps, rejected_logps, cfg)
    loss = losses.mean() + cfg["cpo_alpha"] * nll_loss
    metrics = {
        "chosen_rewards": chosen_rewards,
        "rejected_rewards": rejected_rewards,
        "nll_loss": nll_loss.detach(),
        "logps/chosen": chosen_logps.detach().mean(),
    }
    return loss, metrics


def log1mexp(x):
    t = -0.6931471805599453
    return torch.where(x < t, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def trl_orpo(logits, labels, input_ids, attention_mask, beta):
    """``ORPOTrainer.get_batch_loss_metrics``: ``(loss, metrics)``; the chosen NLL's labels are every
    attended token (``torch.where(attention_mask == 1, input_ids, -100)``)."""
    len_chosen = logits.shape[0] // 2
    nll_labels = torch.where(attention_mask == 1, input_ids, -100)
    policy_nll_loss = cross_entropy_loss(logits[:len_chosen], nll_labels[:len_chosen])
    all_logps = get_batch_logps(logits, labels, average_log_prob=True)
    chosen_logps, rejected_logps = all_logps[:len_chosen], all_logps[len_chosen:]
    log_odds = (chosen_logps - rejected_logps) - (log1mexp(chosen_logps) - log1mexp(rejected_logps))
    ratio = F.logsigmoid(log_odds)
    losses = beta * ratio
    loss = policy_nll_loss - losses.mean()
    metrics = {
        "chosen_rewards": beta * chosen_logps.detach(),
        "rejected_rewards": beta * rejected_logps.detach(),
        "nll_loss": policy_nll_loss.detach(),
        "log_odds_ratio": torch.mean(ratio).detach(),
        "log_odds_chosen": torch.mean(log_odds).detach(),
    }
    return loss, metrics


def completion_logps(logits, input_ids, completion_mask):
    """KTO's shifted sums over the completion tokens."""
    per_token_logps = selective_log_softmax(logits[:, :-1, :], input_ids[:, 1:])
    per_token_logps = per_token_logps.masked_fill(completion_mask[:, 1:] == 0, 0.0)
    return per_token_logps.sum(-1)


def trl_kto(batch, logits, ref_logits, kl_logits, ref_kl_logits, cfg):
    """``KTOTrainer._compute_loss``: ``(loss, metrics)``; ``batch`` holds ``input_ids``,
    ``completion_mask``, ``KL_input_ids``, ``KL_completion_mask``, ``label``; ``kl_logits`` is ``None``
    for ``apo_zero_unpaired``."""
    loss_type, beta = cfg.get("loss_type", "kto"), cfg.get("beta", 0.1)
    desirable_weight, undesirable_weight = (
        cfg.get("desirable_weight", 1.0),
        cfg.get("undesirable_weight", 1.0),
    )
    calculate_kl = loss_type != "apo_zero_unpaired"
    logps = completion_logps(logits, batch["input_ids"], batch["completion_mask"])
    with torch.no_grad():
        ref = completion_logps(ref_logits, batch["input_ids"], batch["completion_mask"])
        if calculate_kl:
            kl_logps = completion_logps(kl_logits, batch["KL_input_ids"], batch["KL_completion_mask"])
            ref_kl_logps = completion_logps(ref_kl_logits, batch["KL_input_ids"], batch["KL_completion_mask"])
    bool_labels = batch["label"].bool()
    chosen_idx = torch.nonzero(bool_labels, as_tuple=False).view(-1)
    rejected_idx = torch.nonzero(~bool_labels, as_tuple=False).view(-1)
    chosen_logps, rejected_logps = logps.index_select(0, chosen_idx), logps.index_select(0, rejected_idx)
    ref_chosen_logps, ref_rejected_logps = ref.index_select(0, chosen_idx), ref.index_select(0, rejected_idx)
    if calculate_kl:
        kl = (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)
    else:
        kl = torch.zeros(1, dtype=logps.dtype)
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    if loss_type == "kto":
        chosen_losses = 1 - F.sigmoid(beta * (chosen_logratios - kl))
        rejected_losses = 1 - F.sigmoid(beta * (kl - rejected_logratios))
    else:
        chosen_losses = 1 - F.sigmoid(beta * chosen_logratios)
        rejected_losses = F.sigmoid(beta * rejected_logratios)
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0)
    metrics = {
        "kl": kl.reshape(()),
        "rewards/chosen": (beta * chosen_logratios.detach()).nansum() / len(chosen_idx),
        "rewards/rejected": (beta * rejected_logratios.detach()).nansum() / len(rejected_idx),
        "logps/chosen": chosen_logps.detach().nansum() / len(chosen_idx),
        "logps/rejected": rejected_logps.detach().nansum() / len(rejected_idx),
    }
    return losses.nanmean(), metrics
