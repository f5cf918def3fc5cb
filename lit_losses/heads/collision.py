"""`log_sum_sq_probs`: each token's log collision probability ``log Σ_v p_v²`` of a head's output
distribution, without ``[tokens × V]`` logits and without gradient (WPO's weights read it).

With ``z`` a position's logits, ``e_v = exp(z_v − m)`` and ``m = max_v z_v``,

    ``log Σ_v p_v² = lse(2z) − 2 lse(z) = log Σ_v e_v² − 2 log Σ_v e_v``

(``m`` cancels). One pass over the logits, no gradient: the vocabulary in blocks (each block of the weight
cast once to the matmul's operand dtype), the valid tokens in chunks of the head's ``chunk_size``, and
per token a running maximum with the two sums rescaled to it (an online log-sum-exp of ``z`` and ``2z``
together). Over a vocabulary-parallel head each rank sums over its own rows, then the group exchanges
``3`` numbers per token (one all-reduce MAX of the maxima, one all-reduce SUM of the rescaled sums).

Cost beside the head's own pass: one more forward matmul ``2·N·D·V`` FLOPs over the ``N`` valid tokens
(the head's per-token outputs take four, with their backward), an ``exp`` over the ``N × V`` logits;
memory one ``[chunk, V_b]`` logits block (``V_b = V`` when the weight is already in the operand dtype,
else at most ``chunk · V / D`` rows: the cast block is no larger than a logits chunk) and ``O(N)``
statistics; nothing is saved for backward. A vocabulary-parallel head casts its local rows once, as its
own pass does (`lit_losses.heads.VocabParallelHead`), so there the cast shard is added instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lit_losses.heads.backend import valid_tokens
from lit_losses.heads.chunked_ops import default_chunk_size, mm_in, token_chunks
from lit_losses.heads.functional import HeadSettings
from lit_losses.heads.fused_head import FusedLMHead
from lit_losses.heads.precision import autocast_off, compute_dtype, operand_dtype
from lit_losses.heads.vocab_parallel import ShardedSettings, check_same_targets
from lit_losses.heads.vocab_parallel_functions import all_reduce_

__all__ = ["log_sum_sq_probs"]


def log_sum_sq_probs(head: FusedLMHead, hidden: Tensor, targets: Tensor) -> Tensor:
    """``log Σ_v p_{t,v}²`` of ``head``'s distribution at every position with a target, no gradient.

    ``p = softmax(z / T)`` with ``z = h Wᵀ + b`` and ``T`` the head's ``temperature``: the distribution of
    the head's ``logprobs``, in its compute dtype and matmul operand precision (`lit_losses.heads.precision`).
    The value lies in ``[−log V, 0]`` (``−log V``: uniform; ``0``: one certain token); it is minus the
    Rényi entropy of order 2. A `lit_losses.heads.VocabParallelHead` gives the value of the whole
    vocabulary, equal on every rank of its group (every rank makes the call with the same inputs).
    Costs one more forward matmul over the valid tokens and no ``[tokens × V]`` tensor (see the module
    docstring: `lit_losses.heads.collision`).

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
    settings = head.settings()
    settings.check_inputs(hidden, targets)
    with torch.no_grad():
        valid, h, y = valid_tokens(hidden.detach(), targets, settings.ignore_index)
        if isinstance(settings, ShardedSettings):
            values = _sharded(settings, h, y)
        else:
            values = _unsharded(settings, h)
    return values.new_zeros(valid.shape).masked_scatter(valid, values)


def _unsharded(settings: HeadSettings, h: Tensor) -> Tensor:
    """The valid tokens' values over the whole weight, in the compute dtype with the head's operands."""
    head, h = settings.tempered(h)
    dtype = compute_dtype(h, head.weight, head.bias, accum_dtype=head.accum_dtype)
    operands = operand_dtype(h, head.weight, dtype, matmul_precision=head.matmul_precision)
    with autocast_off(h.device):
        _, s1, s2 = _exp_sums(h.to(operands), head.weight, head.bias, dtype=dtype, chunk_size=head.chunk_size)
    return s2.log() - 2 * s1.log()


def _sharded(settings: ShardedSettings, h: Tensor, y: Tensor) -> Tensor:
    """The valid tokens' values over the vocabulary of a group whose ranks each hold some rows."""
    head, h = settings.tempered(h)
    config, h = head.local_rows(h)
    shard = config.shard
    if shard.group is not None:
        check_same_targets(y, shard)
    with autocast_off(h.device):
        m, s1, s2 = _exp_sums(h, config.weight, config.bias, dtype=h.dtype, chunk_size=config.chunk_size)
    if shard.group is not None:
        top = all_reduce_(m.clone(), dist.ReduceOp.MAX, shard.group)
        scale = torch.exp(m - top)  # 0 on a rank without rows (m = −inf)
        s1, s2 = all_reduce_(torch.stack([s1 * scale, s2 * scale.square()]), dist.ReduceOp.SUM, shard.group)
    return s2.log() - 2 * s1.log()


def _exp_sums(
    h: Tensor, weight: Tensor, bias: Tensor | None, *, dtype: torch.dtype, chunk_size: int | None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(m, Σ_v e_v, Σ_v e_v²)`` ``[n]`` in ``dtype`` over ``weight``'s rows, ``e_v = exp(z_v − m)``, ``m``
    the row maximum of the logits ``z = h Wᵀ + b`` (``−inf`` and zero sums without rows).

    ``h`` ``[n, D]`` is in the operand dtype; ``weight`` and ``bias`` in any: each block of vocabulary rows
    is cast as it is used (the whole weight at once when it is already in the operand dtype).
    """
    n, rows = h.shape[0], weight.shape[0]
    chunk = chunk_size or default_chunk_size(n, rows, device=h.device)
    block = rows if weight.dtype == h.dtype else min(rows, chunk * rows // max(1, h.shape[1]))
    block = max(1, block)
    m = torch.full((n,), float("-inf"), dtype=dtype, device=h.device)
    s1, s2 = torch.zeros_like(m), torch.zeros_like(m)
    for v0 in range(0, rows, block):
        w = weight[v0 : v0 + block].to(h.dtype).t()
        b = None if bias is None else bias[v0 : v0 + block].to(dtype)
        for start, end in token_chunks(n, chunk):
            z = mm_in(h[start:end], w, dtype)
            if b is not None:
                z.add_(b)
            _fold_(z, m=m[start:end], s1=s1[start:end], s2=s2[start:end])
    return m, s1, s2


def _fold_(z: Tensor, *, m: Tensor, s1: Tensor, s2: Tensor) -> None:
    """Fold a block of logits ``z`` ``[c, V_b]`` (overwritten) into the running maximum ``m`` and the sums
    ``s1 = Σ e``, ``s2 = Σ e²`` of its tokens, in place: both sums rescaled to the new maximum."""
    top = torch.maximum(m, z.amax(1))
    scale = torch.exp(m - top)
    e = z.sub_(top[:, None]).exp_()
    s1.mul_(scale).add_(e.sum(1))
    s2.mul_(scale.square()).add_(e.square_().sum(1))
    m.copy_(top)
