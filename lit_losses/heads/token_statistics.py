"""`token_stats`: per-token statistics of a head's output distribution (entropy, ``log Σ_v p_v²``, the mean
logit, whether the target is the most likely token), without ``[tokens × V]`` logits and without gradient.

With ``z`` a position's logits (``z / T`` with the head's temperature), ``m = max_v z_v``,
``e_v = exp(z_v − m)``, ``S₁ = Σ_v e_v``, ``S₂ = Σ_v e_v²`` and ``S_d = Σ_v e_v (z_v − m)``:

- ``entropy = −Σ_v p_v log p_v = log S₁ − S_d / S₁``;
- ``log_sum_sq_probs = log Σ_v p_v² = log S₂ − 2 log S₁`` (minus the Rényi entropy of order 2; WPO's
  weights read it);
- ``mean_logit = Σ_v z_v / V``;
- ``is_top1``: the target is ``argmax_v z_v``, the first one on a tie (``torch.argmax``'s rule).

One pass over the logits, no gradient: the vocabulary in blocks (each block of the weight cast once to the
matmul's operand dtype), the valid tokens in chunks of the head's ``chunk_size``, and per token a running
maximum (and its first index) with the sums rescaled to it (an online log-sum-exp). Only the requested
statistics are accumulated. Over a vocabulary-parallel head each rank folds its own rows, then the group
exchanges ``O(tokens)`` numbers: one all-reduce MAX of the maxima, one all-reduce SUM of the rescaled sums,
and for ``is_top1`` one all-reduce MIN of the first global index of the maximum.

Cost beside the head's own pass: one more forward matmul ``2·N·D·V`` FLOPs over the ``N`` valid tokens
(the head's per-token outputs take four, with their backward), an ``exp`` over the ``N × V`` logits;
memory one ``[chunk, V_b]`` logits block (``V_b = V`` when the weight is already in the operand dtype,
else at most ``chunk · V / D`` rows: the cast block is no larger than a logits chunk; two with the
entropy, the default chunk then half as long) and ``O(N)`` statistics; nothing is saved for backward.
A vocabulary-parallel head casts its local rows once, as its own pass does
(`lit_losses.heads.VocabParallelHead`), so there the cast shard is added instead. The mean logit alone
takes no pass: ``Σ_v z_v = h · Σ_v W_v + Σ_v b_v``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Literal, get_args

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

__all__ = ["TOKEN_STATISTICS", "TokenStatistic", "TokenStats", "token_stats"]

TokenStatistic = Literal["entropy", "log_sum_sq_probs", "mean_logit", "is_top1"]
"""A per-token statistic `token_stats` computes."""
TOKEN_STATISTICS: tuple[str, ...] = get_args(TokenStatistic)
"""The names of the statistics, the fields of `TokenStats`."""


@dataclass
class TokenStats:
    """Per-token statistics of a head's distribution, each ``[...]`` shaped like the targets (0, or
    ``False``, at ignored positions), ``None`` when not requested.

    Attributes:
        entropy: ``−Σ_v p_v log p_v`` (in ``[0, log V]``).
        log_sum_sq_probs: ``log Σ_v p_v²`` (in ``[−log V, 0]``).
        mean_logit: ``Σ_v z_v / V`` of the (tempered) logits.
        is_top1: the target is the first ``argmax_v z_v`` (bool).
    """

    entropy: Tensor | None = None
    log_sum_sq_probs: Tensor | None = None
    mean_logit: Tensor | None = None
    is_top1: Tensor | None = None


@dataclass
class _Running:
    """The running statistics ``[n]`` of the valid tokens over the rows folded so far (`_fold_`)."""

    m: Tensor
    s1: Tensor
    s2: Tensor | None = None
    sd: Tensor | None = None
    zsum: Tensor | None = None
    top: Tensor | None = None

    @classmethod
    def empty(cls, n: int, *, dtype: torch.dtype, device: torch.device, wanted: frozenset[str]) -> _Running:
        m = torch.full((n,), float("-inf"), dtype=dtype, device=device)

        def zeros(name: str) -> Tensor | None:
            return torch.zeros_like(m) if name in wanted else None

        top = torch.zeros(n, dtype=torch.long, device=device) if "is_top1" in wanted else None
        return cls(
            m,
            torch.zeros_like(m),
            s2=zeros("log_sum_sq_probs"),
            sd=zeros("entropy"),
            zsum=zeros("mean_logit"),
            top=top,
        )

    def chunk(self, start: int, end: int) -> _Running:
        """Views of tokens ``[start, end)``."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return _Running(**{k: None if v is None else v[start:end] for k, v in values.items()})


def token_stats(
    head: FusedLMHead, hidden: Tensor, targets: Tensor, statistics: Iterable[TokenStatistic]
) -> TokenStats:
    """The requested ``statistics`` of ``head``'s distribution at every position with a target, no gradient.

    ``p = softmax(z / T)`` with ``z = h Wᵀ + b`` and ``T`` the head's ``temperature``: the distribution of
    the head's ``logprobs``, in its compute dtype and matmul operand precision (`lit_losses.heads.precision`).
    A `lit_losses.heads.VocabParallelHead` gives the values of the whole vocabulary, equal on every rank of
    its group (every rank makes the call with the same inputs). Costs one more forward matmul over the
    valid tokens and no ``[tokens × V]`` tensor (the module docstring: `lit_losses.heads.token_statistics`).

    Args:
        head: the output head (`FusedLMHead`, or `lit_losses.heads.VocabParallelHead`); its backend is not
            used (the pass is its own).
        hidden: ``[..., D]`` hidden states (detached here).
        targets: ``[...]`` token ids; positions equal to the head's ``ignore_index`` are skipped.
        statistics: which fields of `TokenStats` to compute (`TOKEN_STATISTICS`).

    Returns:
        A `TokenStats` whose requested fields are ``[...]`` shaped like ``targets``, in the head's compute
        dtype (``is_top1``: bool), 0 at ignored positions, without gradient.

    Raises:
        ValueError: an unknown statistic; the head's input checks (shapes, target range, non-finite hidden
            states).

    Example:
        >>> import torch
        >>> from lit_losses.heads import FusedLMHead, token_stats
        >>> g = torch.Generator().manual_seed(0)
        >>> weight, hidden = torch.randn(7, 3, generator=g), torch.randn(2, 4, 3, generator=g)
        >>> targets = torch.tensor([[1, 2, -100, 0], [6, -100, 5, 4]])
        >>> stats = token_stats(FusedLMHead(weight, chunk_size=2), hidden, targets, ["entropy", "is_top1"])
        >>> z = hidden @ weight.T  # the full logits, for the comparison
        >>> valid = targets >= 0
        >>> entropy = torch.distributions.Categorical(logits=z).entropy()
        >>> torch.allclose(stats.entropy, torch.where(valid, entropy, 0.0), atol=1e-6)
        True
        >>> torch.equal(stats.is_top1, valid & (z.argmax(-1) == targets)), stats.mean_logit
        (True, None)
    """
    wanted = frozenset(statistics)
    unknown = sorted(wanted - set(TOKEN_STATISTICS))
    if unknown:
        raise ValueError(f"unknown token statistics {unknown}; known: {list(TOKEN_STATISTICS)}")
    settings = head.settings()
    settings.check_inputs(hidden, targets)
    with torch.no_grad():
        valid, h, y = valid_tokens(hidden.detach(), targets, settings.ignore_index)
        if wanted == {"mean_logit"}:  # linear in the logits: no pass
            values = {"mean_logit": _mean_logit(settings, h)}
        else:
            sharded = isinstance(settings, ShardedSettings)
            run = _sharded(settings, h, y, wanted=wanted) if sharded else _unsharded(settings, h, wanted)
            values = _finish(run, y, vocab_size=settings.vocab_size)
    out = TokenStats()
    for name, value in values.items():
        setattr(out, name, value.new_zeros(valid.shape).masked_scatter(valid, value))
    return out


def _finish(run: _Running, y: Tensor, *, vocab_size: int) -> dict[str, Tensor]:
    """The statistics ``[n]`` of the valid tokens from their running sums over the whole vocabulary."""
    values = {}
    if run.sd is not None:
        values["entropy"] = run.s1.log() - run.sd / run.s1
    if run.s2 is not None:
        values["log_sum_sq_probs"] = run.s2.log() - 2 * run.s1.log()
    if run.zsum is not None:
        values["mean_logit"] = run.zsum / vocab_size
    if run.top is not None:
        values["is_top1"] = run.top == y
    return values


def _mean_logit(settings: HeadSettings, h: Tensor) -> Tensor:
    """``Σ_v z_v / V = (h · Σ_v W_v + Σ_v b_v) / V`` ``[n]`` (tempered) in the compute dtype, without logits;
    over a vocabulary-parallel group the ``D + 1`` column sums are all-reduced."""
    head, h = settings.tempered(h)
    if isinstance(head, ShardedSettings):
        config, h = head.local_rows(h)
        weight, bias, group = config.weight, config.bias, config.shard.group
    else:
        weight, bias, group = head.weight, head.bias, None
        h = h.to(compute_dtype(h, weight, bias, accum_dtype=head.accum_dtype))
    sums = torch.cat(
        [weight.sum(0, dtype=h.dtype), h.new_zeros(1) if bias is None else bias.sum(0, dtype=h.dtype)[None]]
    )
    if group is not None:
        sums = all_reduce_(sums, dist.ReduceOp.SUM, group)
    return (h @ sums[:-1] + sums[-1]) / settings.vocab_size


def _unsharded(settings: HeadSettings, h: Tensor, wanted: frozenset[str]) -> _Running:
    """The valid tokens' running sums over the whole weight, in the compute dtype with the head's operands."""
    head, h = settings.tempered(h)
    dtype = compute_dtype(h, head.weight, head.bias, accum_dtype=head.accum_dtype)
    operands = operand_dtype(h, head.weight, dtype, matmul_precision=head.matmul_precision)
    with autocast_off(h.device):
        return _exp_sums(
            h.to(operands), head.weight, head.bias, dtype=dtype, chunk_size=head.chunk_size, wanted=wanted
        )


def _sharded(settings: ShardedSettings, h: Tensor, y: Tensor, *, wanted: frozenset[str]) -> _Running:
    """The valid tokens' running sums over the vocabulary of a group whose ranks each hold some rows."""
    head, h = settings.tempered(h)
    config, h = head.local_rows(h)
    shard = config.shard
    if shard.group is not None:
        check_same_targets(y, shard)
    with autocast_off(h.device):
        run = _exp_sums(
            h, config.weight, config.bias, dtype=h.dtype, chunk_size=config.chunk_size, wanted=wanted
        )
    if shard.group is None:
        return run
    top = all_reduce_(run.m.clone(), dist.ReduceOp.MAX, shard.group)
    scale = torch.exp(run.m - top)  # 0 on a rank without rows (m = −inf)
    sums = [run.s1 * scale]
    if run.s2 is not None:
        sums.append(run.s2 * scale.square())
    if run.sd is not None:  # Σ e (z − top) = scale · (S_d + (m − top) S₁); no rows: 0
        shift = torch.where(torch.isfinite(run.m), run.m - top, 0.0)
        sums.append(scale * (run.sd + shift * run.s1))
    if run.zsum is not None:
        sums.append(run.zsum)
    reduced = iter(all_reduce_(torch.stack(sums), dist.ReduceOp.SUM, shard.group))
    out = _Running(top, next(reduced))
    out.s2 = None if run.s2 is None else next(reduced)
    out.sd = None if run.sd is None else next(reduced)
    out.zsum = None if run.zsum is None else next(reduced)
    if run.top is not None:  # the first global index of the maximum: the smallest among the ranks holding it
        first = torch.where(run.m == top, run.top + shard.start, shard.vocab_size)
        out.top = all_reduce_(first, dist.ReduceOp.MIN, shard.group)
    return out


def _exp_sums(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    dtype: torch.dtype,
    chunk_size: int | None,
    wanted: frozenset[str],
) -> _Running:
    """The running statistics ``[n]`` in ``dtype`` over ``weight``'s rows (``m = −inf`` and zero sums
    without rows); ``top``: the row index of the first maximum within ``weight``.

    ``h`` ``[n, D]`` is in the operand dtype; ``weight`` and ``bias`` in any: each block of vocabulary rows
    is cast as it is used (the whole weight at once when it is already in the operand dtype).
    """
    n, rows = h.shape[0], weight.shape[0]
    work = 8 if "entropy" in wanted else 4  # bytes per logit: the entropy's Σ e·(z − m) needs e beside z
    chunk = chunk_size or default_chunk_size(n, rows, bytes_per_elem=work, device=h.device)
    block = rows if weight.dtype == h.dtype else min(rows, chunk * rows // max(1, h.shape[1]))
    block = max(1, block)
    run = _Running.empty(n, dtype=dtype, device=h.device, wanted=wanted)
    for v0 in range(0, rows, block):
        w = weight[v0 : v0 + block].to(h.dtype).t()
        b = None if bias is None else bias[v0 : v0 + block].to(dtype)
        for start, end in token_chunks(n, chunk):
            z = mm_in(h[start:end], w, dtype)
            if b is not None:
                z.add_(b)
            _fold_(z, run.chunk(start, end), offset=v0)
    return run


def _fold_(z: Tensor, run: _Running, *, offset: int) -> None:
    """Fold a block of logits ``z`` ``[c, V_b]`` (overwritten; its first row is vocabulary row ``offset``)
    into the running statistics ``run`` of its tokens, in place: the sums rescaled to the new maximum."""
    if run.top is not None:
        block_max, block_top = z.max(1)
        run.top.copy_(torch.where(block_max > run.m, block_top + offset, run.top))  # ties: the earlier
    else:
        block_max = z.amax(1)
    top = torch.maximum(run.m, block_max)
    scale = torch.exp(run.m - top)
    if run.zsum is not None:
        run.zsum.add_(z.sum(1))
    if run.sd is not None:  # S_d relative to the new maximum: scale · (S_d + (m − top) S₁); first block: 0
        shift = torch.where(torch.isfinite(run.m), run.m - top, 0.0)
        run.sd.add_(shift * run.s1).mul_(scale)
    d = z.sub_(top[:, None])
    e = d.exp() if run.sd is not None else d.exp_()
    run.s1.mul_(scale).add_(e.sum(1))
    if run.sd is not None:
        run.sd.add_(d.mul_(e).sum(1))
    if run.s2 is not None:
        run.s2.mul_(scale.square()).add_(e.square_().sum(1))
    run.m.copy_(top)
