"""The vocabulary-parallel head: the fused head over an output projection sharded along the vocabulary.

Under tensor parallelism each rank of a group holds rows ``[start, stop)`` of ``W`` (and of the bias), as
`torch.distributed.tensor.parallel.ColwiseParallel` leaves an ``lm_head`` (a DTensor with ``Shard(0)``) or
as a Megatron-style layout gives them explicitly (`VocabShard`). `VocabParallelHead` computes the same
per-token ``logprobs``, ``lse`` and ``entropy``, the plain-CE fast path and fused pointwise losses as
`FusedLMHead`, exactly and identically on every rank, while each rank computes only its own logits and
the group exchanges ``O(tokens)`` softmax statistics per chunk (the maths and the collectives:
`lit_losses.heads.vocab_parallel_functions`). It is the ``vocab_parallel`` backend of `HEAD_BACKENDS`; on
an unsharded weight it is a single shard that communicates nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lit_losses.heads.backend import (
    ChunkLoss,
    HeadBackend,
    register_backend,
    scatter_valid,
    valid_tokens,
    weight_vector,
)
from lit_losses.heads.chunked_ops import default_chunk_size
from lit_losses.heads.functional import HeadSettings
from lit_losses.heads.fused_head import FusedLMHead
from lit_losses.heads.output import HEAD_OUTPUTS, HeadOutput, check_head_inputs
from lit_losses.heads.precision import autocast_off, compute_dtype
from lit_losses.heads.vocab_parallel_functions import (
    VocabParallelLogProbs,
    VocabParallelPointwiseLoss,
    VocabParallelWeightedCE,
    all_reduce_,
)
from lit_losses.heads.vocab_shard import VocabShard, is_vocab_sharded

BACKEND_NAME = "vocab_parallel"
#: The backends a head over a vocabulary-sharded weight may be configured with (all give this one).
SHARDED_BACKENDS = ("auto", "chunked", BACKEND_NAME)


@dataclass(frozen=True)
class ShardedHeadConfig:
    """What the ``vocab_parallel`` backend reads: this rank's rows in the compute dtype, and the shard."""

    weight: Tensor
    bias: Tensor | None
    chunk_size: int | None
    ignore_index: int
    accum_dtype: torch.dtype
    shard: VocabShard

    @property
    def vocab_size(self) -> int:
        return self.shard.vocab_size


@dataclass(frozen=True, eq=False, kw_only=True)
class ShardedSettings(HeadSettings):
    """`HeadSettings` of a `VocabParallelHead`: the calls' steps over this rank's rows of the vocabulary.

    Its inputs are checked against the whole ``[V, D]`` weight (targets are global token ids), and a call
    computes in the compute dtype of this rank's rows (``matmul_precision`` is not applied: the operands
    stay in that dtype), autocast off, on the ``vocab_parallel`` backend its head is built with.
    """

    shard: VocabShard

    @property
    def vocab_size(self) -> int:
        """``V``, the whole vocabulary (not this rank's rows)."""
        return self.shard.vocab_size

    def check_inputs(self, hidden: Tensor, targets: Tensor, token_weights: Tensor | None = None) -> None:
        """`check_head_inputs` against the global ``[V, D]`` shape (meta tensors: no data)."""
        shape = (self.shard.vocab_size, self.weight.shape[-1])
        meta_w = torch.empty(shape, device="meta")
        meta_b = None if self.bias is None else torch.empty(shape[:1], device="meta")
        check_head_inputs(
            hidden,
            targets,
            meta_w,
            bias=meta_b,
            ignore_index=self.ignore_index,
            check_finite=self.check_finite,
            token_weights=token_weights,
        )

    def local_rows(self, hidden: Tensor) -> tuple[ShardedHeadConfig, Tensor]:
        """This rank's rows and ``hidden`` in the compute dtype (casts are differentiable)."""
        weight, bias = self.weight, self.bias
        if is_vocab_sharded(weight):
            weight, bias = weight.to_local(), None if bias is None else bias.to_local()
        dtype = compute_dtype(hidden, weight, bias, accum_dtype=self.accum_dtype)
        bias = None if bias is None else bias.to(dtype)
        config = ShardedHeadConfig(
            weight.to(dtype),
            bias,
            self.chunk_size,
            ignore_index=self.ignore_index,
            accum_dtype=self.accum_dtype,
            shard=self.shard,
        )
        return config, hidden.to(dtype)

    @contextmanager
    def computing(self, hidden: Tensor, backend: HeadBackend) -> Iterator[tuple[ShardedHeadConfig, Tensor]]:
        """`local_rows` of the `tempered` settings (``h / T`` and this rank's ``b / T``: the logits ``z / T``
        of every shard), autocast off."""
        head, h = self.tempered(hidden)
        with autocast_off(hidden.device):
            yield head.local_rows(h)


def _local_rows(head: Any) -> tuple[Tensor, Tensor | None, VocabShard]:
    """``(weight rows, bias rows, shard)`` of any head: a `ShardedHeadConfig`, a DTensor weight, or an
    unsharded weight (a single shard)."""
    shard = getattr(head, "shard", None)
    weight, bias = head.weight, head.bias
    if shard is not None:
        return weight, bias, shard
    if is_vocab_sharded(weight):
        shard = VocabShard.of_dtensor(weight)
        bias = None if bias is None else bias.to_local()
        return weight.to_local(), bias, shard
    return weight, bias, VocabShard.full(weight.shape[0])


def check_same_targets(y: Tensor, shard: VocabShard) -> None:
    """Raise on every rank unless every rank of the group holds the same valid targets ``y`` (their number
    and a position-weighted checksum, compared by one all-reduce MAX of 4 numbers). Different micro-batches
    on the ranks of a tensor-parallel group would otherwise mix their softmax statistics, or hang."""
    positions = torch.arange(1, y.numel() + 1, device=y.device).remainder(97).to(torch.float64)
    signature = torch.stack([positions.new_tensor(float(y.numel())), (y.to(torch.float64) * positions).sum()])
    extremes = all_reduce_(torch.cat([signature, -signature]), dist.ReduceOp.MAX, shard.group)
    if not torch.equal(extremes[:2], -extremes[2:]):
        raise RuntimeError(
            "the ranks of a vocabulary-parallel group gave the head different targets "
            f"({int(-extremes[2])} to {int(extremes[0])} valid tokens): every rank of a tensor-parallel "
            "group must compute the same micro-batch (shard the data over the data-parallel ranks only: the "
            "strategy's distributed_sampler_kwargs)"
        )


def _prepare(head: Any, y: Tensor) -> tuple[Tensor, Tensor | None, VocabShard, int]:
    """``(weight rows, bias rows, shard, chunk size)`` for a call on the valid targets ``y``, checked to be
    the same on every rank (`check_same_targets`). The default chunk size follows the group's average shard
    (``⌈V / ranks⌉`` rows): the same on every rank, as each chunk is a round of collectives."""
    weight, bias, shard = _local_rows(head)
    ranks = 1
    if shard.group is not None:
        check_same_targets(y, shard)
        ranks = dist.get_world_size(shard.group)
    chunk = head.chunk_size or default_chunk_size(y.numel(), -(-shard.vocab_size // ranks), device=y.device)
    return weight, bias, shard, chunk


def vocab_parallel_per_token(
    head: Any, hidden: Tensor, targets: Tensor, outputs: tuple[str, ...]
) -> HeadOutput:
    """Per-token ``logprobs``/``lse``/``entropy`` with `VocabParallelLogProbs` on the valid positions."""
    valid, h, y = valid_tokens(hidden, targets, head.ignore_index)
    weight, bias, shard, chunk = _prepare(head, y)
    logprobs, lse, entropy = VocabParallelLogProbs.apply(
        h, weight, bias, y, shard, "entropy" in outputs, chunk
    )
    return scatter_valid({"logprobs": logprobs, "lse": lse, "entropy": entropy}, outputs, valid)


def vocab_parallel_weighted_ce(head: Any, h: Tensor, y: Tensor, token_weights: Tensor | float) -> Tensor:
    """``Σ_t w_t · (−log p_t[y_t])`` over valid tokens with `VocabParallelWeightedCE`."""
    weight, bias, shard, chunk = _prepare(head, y)
    w = weight_vector(token_weights, h.shape[0], h.device)
    return VocabParallelWeightedCE.apply(h, weight, bias, y, w, shard, chunk)


def vocab_parallel_pointwise(
    head: Any, h: Tensor, y: Tensor, chunk_loss: ChunkLoss, with_entropy: bool
) -> Tensor:
    """A sum of per-token functions of ``(logprobs, lse, entropy)`` with `VocabParallelPointwiseLoss`."""
    weight, bias, shard, chunk = _prepare(head, y)
    return VocabParallelPointwiseLoss.apply(h, weight, bias, y, chunk_loss, with_entropy, shard, chunk)


#: The ``vocab_parallel`` backend (chosen by `VocabParallelHead`, never by ``auto``).
VOCAB_PARALLEL = register_backend(
    HeadBackend(
        BACKEND_NAME,
        description="W sharded along the vocabulary: O(tokens) statistics exchanged per chunk",
        outputs=HEAD_OUTPUTS,  # every per-token output, and fused losses with any token weights
        per_token=vocab_parallel_per_token,
        fused_ce=vocab_parallel_weighted_ce,
        fused_pointwise=vocab_parallel_pointwise,
    )
)

#: Explicit shards whose tiling of the vocabulary was checked (once per shard).
_CHECKED_SHARDS: set[VocabShard] = set()


class VocabParallelHead(FusedLMHead):
    """`FusedLMHead` over an output projection sharded along the vocabulary across a process group.

    Each rank passes its rows of ``W`` (and of the bias): either a DTensor placed ``Shard(0)``
    (``ColwiseParallel`` on the ``lm_head``; the shard and the group are read from it) or plain tensors with
    an explicit `VocabShard` ``(start, stop, vocab_size, group)``. Every call gives what `FusedLMHead` gives
    (per-token ``logprobs``, ``lse``, ``entropy``, `weighted_ce`, `pointwise_loss`), exact and equal on
    every rank of the group; targets are global token ids. Communication per chunk of ``c`` tokens: one
    all-reduce MAX of ``c`` numbers and one all-reduce SUM of ``2c`` (``3c`` with the entropy); once per
    call, an all-reduce of 4 numbers (the ranks hold the same targets: `check_same_targets`) and the
    all-reduce of ``∂/∂hidden`` ``[tokens, D]`` (in forward for the fused paths, in backward for per-token
    outputs). Never ``[tokens, V]`` logits. Gradients reach this rank's rows only (and ``hidden``). Every
    rank of the group must make the same calls with the same ``hidden`` and ``targets``. No double backward
    (`DoubleBackwardError`). The calls are `FusedLMHead`'s over `ShardedSettings`, which check the inputs
    against the whole vocabulary and compute on this rank's rows with the ``vocab_parallel`` backend.

    Args:
        weight: this rank's rows ``[stop − start, D]``, or a DTensor ``[V, D]`` placed ``Shard(0)``.
        bias: this rank's ``[stop − start]`` bias rows (a DTensor ``Shard(0)`` with a DTensor weight), or
            ``None``.
        shard: the explicit shard of plain tensors (checked once, collectively, to tile the vocabulary);
            ``None`` with a DTensor weight, or for an unsharded weight (one shard, no communication).
        chunk_size: tokens per chunk (default: `default_chunk_size` for ``⌈V / ranks⌉`` rows, the same on
            every rank).
        ignore_index: target value of positions without a label.
        accum_dtype: the least precise dtype logits and statistics are computed in (see `FusedLMHead`).
        check_finite: raise when hidden states contain NaN/Inf.
        temperature: ``T``: every output is that of the logits ``z / T`` (see `FusedLMHead`).

    Raises:
        ValueError: a weight whose rows do not match the shard, a DTensor with another placement, shards
            that do not tile the vocabulary.

    Example:
        >>> import torch
        >>> from lit_losses.heads import FusedLMHead
        >>> from lit_losses.heads.vocab_parallel import VocabParallelHead
        >>> g = torch.Generator().manual_seed(0)
        >>> weight = torch.randn(11, 4, generator=g, dtype=torch.float64)
        >>> hidden = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
        >>> targets = torch.tensor([[1, 5, -100], [0, 10, 3]])
        >>> head = VocabParallelHead(weight)  # unsharded: one shard (with a group: each rank its rows)
        >>> out = head(hidden, targets, ("logprobs", "entropy"))
        >>> ref = FusedLMHead(weight)(hidden, targets, ("logprobs", "entropy"))
        >>> torch.allclose(out.logprobs, ref.logprobs), torch.allclose(out.entropy, ref.entropy)
        (True, True)
    """

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None = None,
        shard: VocabShard | None = None,
        chunk_size: int | None = None,
        ignore_index: int = -100,
        accum_dtype: torch.dtype = torch.float32,
        check_finite: bool = True,
        temperature: float = 1.0,
    ) -> None:
        super().__init__(
            weight,
            bias,
            backend=BACKEND_NAME,
            chunk_size=chunk_size,
            ignore_index=ignore_index,
            accum_dtype=accum_dtype,
            check_finite=check_finite,
            temperature=temperature,
        )
        if is_vocab_sharded(weight):
            if shard is not None:
                raise ValueError("give the shard either as a DTensor weight or as `shard`, not both")
            if bias is not None and not is_vocab_sharded(bias):
                raise ValueError("with a DTensor weight placed Shard(0), the bias must be a Shard(0) DTensor")
            shard = VocabShard.of_dtensor(weight)
        elif shard is None:
            shard = VocabShard.full(weight.shape[0])
        elif shard not in _CHECKED_SHARDS:
            shard.check_tiling()
            _CHECKED_SHARDS.add(shard)
        local = weight.to_local() if is_vocab_sharded(weight) else weight
        if local.dim() != 2 or local.shape[0] != shard.size:
            raise ValueError(
                f"the output weight rows {tuple(local.shape)} do not match the vocabulary shard "
                f"[{shard.start}, {shard.stop}) of {shard.size} rows"
            )
        self.shard = shard

    @property
    def vocab_size(self) -> int:
        """``V``, the whole vocabulary (not this rank's rows)."""
        return self.shard.vocab_size

    def settings(self) -> ShardedSettings:
        """The weight, the bias, the options and the shard as one call takes them (`ShardedSettings`)."""
        return ShardedSettings(weight=self.weight, bias=self.bias, shard=self.shard, **self.options())

    def forward_logits(self, hidden: Tensor) -> Tensor:
        """Full logits ``[..., V]`` on every rank (inference: all-gathers ``[tokens, V]``; no gradient).

        Raises:
            RuntimeError: called where a gradient would be expected (use the per-token outputs).
        """
        if torch.is_grad_enabled() and (hidden.requires_grad or self.weight.requires_grad):
            raise RuntimeError(
                "VocabParallelHead.forward_logits gathers the logits for inference and has no gradient; "
                "call it under torch.no_grad() (train through the per-token outputs or the fused losses)"
            )
        head, h = self.settings().local_rows(hidden)
        local = torch.nn.functional.linear(h, head.weight, head.bias)
        if self.shard.group is None:
            return local
        return _all_gather_rows(local, self.shard)


def _all_gather_rows(local: Tensor, shard: VocabShard) -> Tensor:
    """``[..., V]`` from every rank's ``[..., stop − start]`` (padded to the largest shard for the gather)."""
    group = shard.group
    sizes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(sizes, shard.size, group=group)
    padded = torch.nn.functional.pad(local, (0, max(sizes) - shard.size))
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[..., :size] for part, size in zip(parts, sizes, strict=True)], dim=-1)


def head_for(weight: Tensor, bias: Tensor | None = None, backend: str = "auto", **kwargs: Any) -> FusedLMHead:
    """The head over an output projection: a `VocabParallelHead` when ``weight`` is a DTensor sharded along
    the vocabulary (tensor parallel), else `FusedLMHead` with ``backend``.

    Args:
        weight: ``[V, D]`` output projection (a plain tensor or a DTensor).
        bias: ``[V]`` or ``None``.
        backend: the head backend (with a sharded weight one of `SHARDED_BACKENDS`: the vocabulary-parallel
            head is the ``chunked`` algorithm over each rank's rows).
        **kwargs: the other `FusedLMHead` arguments (``chunk_size``, ``ignore_index``, ``check_finite``, …).

    Raises:
        ValueError: a sharded weight with another backend (which would need the full weight), or with a
            ``matmul_precision`` other than ``auto``.

    Example:
        >>> import torch
        >>> from lit_losses.heads.vocab_parallel import head_for
        >>> type(head_for(torch.zeros(8, 4))).__name__
        'FusedLMHead'
    """
    if not is_vocab_sharded(weight):
        return FusedLMHead(weight, bias, backend, **kwargs)
    if backend not in SHARDED_BACKENDS:
        raise ValueError(
            f"head backend {backend!r} cannot compute with an output projection sharded along the vocabulary "
            f"(tensor parallel, placements {tuple(weight.placements)}); use one of {SHARDED_BACKENDS}"
        )
    precision = kwargs.pop("matmul_precision", "auto")
    if precision != "auto":
        raise ValueError(
            f"matmul_precision={precision!r} is not applied by the vocabulary-parallel head (tensor "
            "parallel: its operands stay in each rank's rows' dtype); use 'auto'"
        )
    return VocabParallelHead(weight, bias, **kwargs)
