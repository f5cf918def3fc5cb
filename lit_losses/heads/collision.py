"""`log_sum_sq_probs`: each token's log collision probability ``log Σ_v p_v²`` of a head's output
distribution, without ``[tokens × V]`` logits and without gradient (WPO's weights read it).

``log Σ_v p_v² = lse(2z) − 2 lse(z)``: the ``log_sum_sq_probs`` field of `lit_losses.heads.token_stats`,
one pass over the logits in blocks with an online log-sum-exp of ``z`` and ``2z`` together
(`lit_losses.heads.token_statistics` gives the cost: one more forward matmul over the valid tokens,
no gradient, ``O(tokens)`` exchanged over a vocabulary-parallel group).
"""

from __future__ import annotations

from torch import Tensor

from lit_losses.heads.fused_head import FusedLMHead
from lit_losses.heads.token_statistics import token_stats

__all__ = ["log_sum_sq_probs"]


def log_sum_sq_probs(head: FusedLMHead, hidden: Tensor, targets: Tensor) -> Tensor:
    """``log Σ_v p_{t,v}²`` of ``head``'s distribution at every position with a target, no gradient.

    ``p = softmax(z / T)`` with ``z = h Wᵀ + b`` and ``T`` the head's ``temperature``: the distribution of
    the head's ``logprobs``, in its compute dtype and matmul operand precision (`lit_losses.heads.precision`).
    The value lies in ``[−log V, 0]`` (``−log V``: uniform; ``0``: one certain token); it is minus the
    Rényi entropy of order 2. A `lit_losses.heads.VocabParallelHead` gives the value of the whole
    vocabulary, equal on every rank of its group (every rank makes the call with the same inputs).
    Costs one more forward matmul over the valid tokens and no ``[tokens × V]`` tensor
    (`lit_losses.heads.token_stats`, which gives it with other statistics in the same pass).

    Args:
        head: the output head (`FusedLMHead`, or `lit_losses.heads.VocabParallelHead`); its backend is not
            used (the pass is its own).
        hidden: ``[..., D]`` hidden states (detached here).
        targets: ``[...]`` token ids; positions equal to the head's ``ignore_index`` are skipped.

    Returns:
        ``[...]`` shaped like ``targets`` in the head's compute dtype, 0 at ignored positions, without
        gradient.

    Raises:
        ValueError: the head's input checks (shapes, target range, non-finite hidden states).

    Example:
        >>> import torch
        >>> from lit_losses.heads import FusedLMHead, log_sum_sq_probs
        >>> g = torch.Generator().manual_seed(0)
        >>> weight, hidden = torch.randn(7, 3, generator=g), torch.randn(2, 4, 3, generator=g)
        >>> targets = torch.tensor([[1, 2, -100, 0], [6, -100, 5, 4]])
        >>> out = log_sum_sq_probs(FusedLMHead(weight, chunk_size=2), hidden, targets)
        >>> p = torch.softmax(hidden @ weight.T, -1)  # the full logits, for the comparison
        >>> torch.allclose(out, torch.where(targets >= 0, (p**2).sum(-1).log(), 0.0), atol=1e-6)
        True
        >>> out.requires_grad, float(out[0, 2])
        (False, 0.0)
    """
    return token_stats(head, hidden, targets, statistics=("log_sum_sq_probs",)).log_sum_sq_probs
