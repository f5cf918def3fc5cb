"""Sequence values of the preference losses, from per-token log-probabilities of completion tokens.

The preference losses (`dpo_loss`, `cpo_loss`, `simpo_loss`, `orpo_loss`, `kto_loss`) are functions of
one value per sequence: the sum (or mean) of its completion tokens' log-probabilities, optionally
LD-DPO's length-desensitized sum, WPO's weight, and the chosen completions' negative log-likelihood as
each pair's share of its token mean. Rows ``[2P, T]`` hold the chosen completions of pairs ``0..P-1``
then their rejected completions (TRL's concatenated layout); ``mask`` marks the completion tokens
(labels ``!= -100``).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from lit_losses.errors import ConfigError

SequenceReduction = Literal["sum", "mean"]
"""How a sequence's completion-token log-probabilities become its value: their sum or their mean."""


def sequence_logps(token_logps: Tensor, mask: Tensor, *, reduction: SequenceReduction = "sum") -> Tensor:
    """Each row's sum (or mean) of ``token_logps`` over its completion tokens ``mask``.

    ``sum``: ``Σ_t m_t ℓ_t`` (TRL's DPO, KTO and CPO ``sigmoid``/``hinge``); ``mean``: the sum over
    ``max(Σ_t m_t, 1)`` (TRL's CPO ``simpo``/``ipo``, ORPO: ``average_log_prob=True``).

    Args:
        token_logps: ``[rows, T]`` log-probabilities (any value at positions outside ``mask``).
        mask: ``[rows, T]`` bool, the completion tokens.
        reduction: ``sum`` or ``mean``.

    Returns:
        ``[rows]``, differentiable with respect to ``token_logps``.

    Example:
        >>> import torch
        >>> lp = torch.tensor([[-1.0, -2.0, 9.0], [-3.0, 9.0, 9.0]])
        >>> mask = torch.tensor([[True, True, False], [True, False, False]])
        >>> sequence_logps(lp, mask), sequence_logps(lp, mask, reduction="mean")
        (tensor([-3., -3.]), tensor([-1.5000, -3.0000]))
    """
    sums = torch.where(mask, token_logps, torch.zeros_like(token_logps)).sum(-1)
    if reduction == "sum":
        return sums
    if reduction == "mean":
        return sums / mask.sum(-1).clamp_min(1).to(sums.dtype)
    raise ConfigError(f"sequence_logps reduction {reduction!r} is not one of ('sum', 'mean')")


def ld_sequence_logps(token_logps: Tensor, mask: Tensor, ld_alpha: float) -> Tensor:
    """LD-DPO's length-desensitized sums of paired rows (TRL's ``DPOConfig.ld_alpha``).

    Rows ``0..P-1`` are the chosen completions of pairs ``0..P-1``, rows ``P..2P-1`` their rejected
    ones. With ``ℓ_s = min(|y_w|, |y_l|)`` the pair's shared length, a row's value is the sum over its
    first ``ℓ_s`` completion tokens plus ``ld_alpha`` times the sum over the rest:
    ``Σ_{k ≤ ℓ_s} ℓ_k + α Σ_{k > ℓ_s} ℓ_k``. ``α = 1`` is the plain sum. The same rule gives the
    reference's values (TRL applies it to both).

    Args:
        token_logps: ``[2P, T]`` log-probabilities.
        mask: ``[2P, T]`` bool, the completion tokens.
        ld_alpha: ``α`` in ``[0, 1]``.

    Returns:
        ``[2P]``.

    Example:
        >>> import torch
        >>> lp = torch.tensor([[-1.0, -1.0, 0.0], [-2.0, -2.0, -2.0]])  # chosen: 2 tokens, rejected: 3
        >>> mask = torch.tensor([[True, True, False], [True, True, True]])
        >>> ld_sequence_logps(lp, mask, ld_alpha=0.5)  # the rejected row's third token counts half
        tensor([-2., -5.])
    """
    if token_logps.shape[0] % 2:
        raise ValueError(f"ld_sequence_logps takes paired rows [2P, T], got {tuple(token_logps.shape)}")
    rank = mask.long().cumsum(-1)  # 1, 2, ... at completion tokens
    lengths = mask.sum(-1)
    chosen, rejected = lengths.chunk(2)
    shared = torch.minimum(chosen, rejected).repeat(2)[:, None]
    values = torch.where(mask, token_logps, torch.zeros_like(token_logps))
    shared_part = torch.where(mask & (rank <= shared), values, torch.zeros_like(values)).sum(-1)
    tail_part = torch.where(mask & (rank > shared), values, torch.zeros_like(values)).sum(-1)
    return shared_part + ld_alpha * tail_part


def wpo_weights(token_logps: Tensor, token_log_sum_sq: Tensor, mask: Tensor) -> Tensor:
    """WPO's weight of each row (TRL's ``DPOConfig.use_weighting``), without gradient.

    ``w = exp(mean_t (ℓ_t − log Σ_v p_{t,v}²))`` over the row's completion tokens, where
    ``log Σ_v p_v² = lse(2z) − 2 lse(z)`` for the logits ``z`` of the position: the policy's
    length-normalized sequence probability, aligned with the probabilities it would sample. A pair's
    weight is its chosen weight times its rejected weight (`dpo_loss`'s ``chosen_weights`` and
    ``rejected_weights``), not clamped (as TRL's current ``DPOTrainer``: it exceeds 1 where the policy
    prefers the completion's tokens to its own samples). `lit_losses.heads.log_sum_sq_probs` gives
    ``token_log_sum_sq`` from hidden states without logits.

    Args:
        token_logps: ``[rows, T]`` the policy's log-probabilities of the completion tokens.
        token_log_sum_sq: ``[rows, T]`` ``log Σ_v p_{t,v}²`` at each position.
        mask: ``[rows, T]`` bool, the completion tokens.

    Returns:
        ``[rows]``, detached.

    Example:
        >>> import torch
        >>> z = torch.zeros(1, 2, 4)  # uniform over 4 tokens: p = 1/4, Σ p² = 1/4
        >>> lp = torch.log_softmax(z, -1)[..., 0]
        >>> log_sum_sq = torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1)
        >>> wpo_weights(lp, log_sum_sq, torch.ones(1, 2, dtype=torch.bool))
        tensor([1.])
    """
    with torch.no_grad():
        aligned = torch.where(mask, token_logps - token_log_sum_sq, torch.zeros_like(token_logps))
        return torch.exp(aligned.sum(-1) / mask.sum(-1).clamp_min(1).to(aligned.dtype))


def nll_shares(chosen_nll: Tensor, chosen_nll_tokens: Tensor | float) -> Tensor:
    """Each pair's share of the chosen completions' token-mean negative log-likelihood.

    TRL adds the NLL of the chosen completions as one token mean over the micro-batch:
    ``Σ_i nll_i / Σ_i n_i``. As a per-pair value, ``nll_i / n̄`` with ``n̄`` the mean token count per
    pair has the same mean over the pairs. ``chosen_nll_tokens`` is either each pair's count ``n_i``
    (then ``n̄`` is their mean: TRL's value for the pairs of the call) or one number ``n̄`` (the count
    per pair of the whole batch the losses are averaged over: the global value).

    Args:
        chosen_nll: ``[P]`` ``Σ_t −ℓ_t`` over each chosen sequence's NLL tokens (with gradient).
        chosen_nll_tokens: ``[P]`` token counts, or the mean count per pair (a number or 0-d tensor).

    Returns:
        ``[P]``.

    Example:
        >>> import torch
        >>> nll, tokens = torch.tensor([4.0, 2.0]), torch.tensor([3, 1])
        >>> nll_shares(nll, tokens).mean(), nll.sum() / tokens.sum()
        (tensor(1.5000), tensor(1.5000))
    """
    tokens = torch.as_tensor(chosen_nll_tokens, device=chosen_nll.device).to(chosen_nll.dtype)
    if tokens.dim() not in (0, 1) or (tokens.dim() == 1 and tokens.shape != chosen_nll.shape):
        raise ValueError(
            f"chosen_nll_tokens has shape {tuple(tokens.shape)}; expected one count per pair "
            f"{tuple(chosen_nll.shape)} or one number"
        )
    mean_tokens = tokens.mean()
    if not bool(mean_tokens > 0):
        raise ValueError(f"chosen_nll_tokens must count at least one token per pair on average, got {tokens}")
    return chosen_nll / mean_tokens
