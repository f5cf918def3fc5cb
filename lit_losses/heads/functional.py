"""The functional output head: per-token log-probabilities and fused losses of ``z = h Wᵀ + b``, logits
never materialized (torch only, like `lit_losses.autograd`).

Three functions, one per kind of result, each choosing its backend with `select_backend` (the only
dispatcher) and running it in the head's compute dtype (`lit_losses.heads.precision`):

- `linear_logprobs`: per-token ``logprobs``, ``lse``, ``entropy`` (autograd through them);
- `linear_cross_entropy`: ``Σ_t w_t · (−log p_t[y_t])``, its gradients computed in forward;
- `linear_pointwise_loss`: any sum of per-token functions of ``(logprobs, lse, entropy)``, same.

Each builds a `HeadSettings` (the weight, the bias and the options, checked) and calls its method of the
same kind (`HeadSettings.logprobs`, `HeadSettings.cross_entropy`, `HeadSettings.pointwise_loss`): check
the inputs, keep the valid tokens, route, compute. `FusedLMHead` is the module over them: it holds the
weight, the bias and the options, and its ``__call__``, ``weighted_ce`` and ``pointwise_loss`` call these
methods of its `FusedLMHead.settings`. The layers below are the backends (`HEAD_BACKENDS`; the ``chunked``
one: `lit_losses.heads.chunked`), their autograd Functions (`lit_losses.heads.functions`) and the
per-chunk kernels with the maths (`lit_losses.heads.chunked_ops`).

The call path of `RegularizedLM`'s plain cross-entropy, four hops to the ``chunked`` backend:

    RegularizedLM.compute_loss → Objective.__call__ → FusedLMHead.weighted_ce → HeadSettings.cross_entropy
    → chunked_weighted_ce (``ChunkedWeightedCE.apply``)

and of its per-token outputs (``Objective``'s general path; ``pointwise_loss`` →
`HeadSettings.pointwise_loss` → ``chunked_pointwise`` for the fused one):

    RegularizedLM.compute_loss → Objective.__call__ → FusedLMHead.__call__ → HeadSettings.logprobs
    → chunked_per_token (``ChunkedLogProbs.apply``)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from numbers import Integral
from typing import Literal, get_args

import torch
from torch import Tensor

from lit_losses.choices import check_choice
from lit_losses.heads import blocked, cce, chunked, liger, liger_scaled, naive, torch_lce
from lit_losses.heads.backend import (
    HEAD_BACKENDS,
    BackendOutputs,
    ChunkLoss,
    HeadBackend,
    HeadConfig,
    compact_valid,
    select_backend,
    valid_tokens,
    weight_vector,
)
from lit_losses.heads.output import (
    HEAD_OUTPUTS,
    HeadOutput,
    check_finite_token_weights,
    check_head_inputs,
    normalize_outputs,
)
from lit_losses.heads.precision import MatmulPrecision, compute_dtype, in_compute_dtype

#: The head backends a configuration can name (``auto`` picks among the registered ones).
Backend = Literal["auto", "chunked", "blocked", "naive", "torch", "liger", "liger_scaled", "cce"]
"""A head backend by name (``auto``: `select_backend` chooses)."""
BACKENDS: tuple[str, ...] = get_args(Backend)
"""The names of `Backend`, in order."""
BACKEND_OUTPUTS = BackendOutputs()
"""Per-token outputs each registered backend can give (a live view of `HEAD_BACKENDS`)."""
#: How `linear_cross_entropy` reduces the weighted per-token losses.
Reduction = Literal["mean", "sum"]

_BUILTIN = (
    chunked.CHUNKED,
    blocked.BLOCKED,
    naive.NAIVE,
    torch_lce.TORCH,
    liger.LIGER,
    liger_scaled.LIGER_SCALED,
    cce.CCE,
)
if set(BACKENDS) != {"auto", *(b.name for b in _BUILTIN)}:  # pragma: no cover - a maintenance error
    raise RuntimeError(f"Backend lists {BACKENDS}; the built-in backends are {[b.name for b in _BUILTIN]}")


def check_head_options(
    backend: str,
    chunk_size: int | None,
    matmul_precision: str,
    temperature: float = 1.0,
    ignore_index: int = -100,
) -> None:
    """Raise a `ValueError` naming the value for an unknown ``backend`` or ``matmul_precision`` (a
    `ConfigError`), a ``chunk_size`` that is not an integer >= 1 (``"512"`` too), an ``ignore_index`` that
    is not an integer, or a ``temperature`` that is not a finite positive number.

    Example:
        >>> check_head_options("auto", "512", "auto")
        Traceback (most recent call last):
        ...
        TypeError: chunk_size must be an integer >= 1 (tokens per chunk) or None, got '512' (str)
    """
    check_choice(matmul_precision, MatmulPrecision, "matmul_precision")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, Integral)):
        raise TypeError(
            "chunk_size must be an integer >= 1 (tokens per chunk) or None, got "
            f"{chunk_size!r} ({type(chunk_size).__name__})"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, Integral):
        kind = type(ignore_index).__name__
        raise TypeError(f"ignore_index must be an integer target value, got {ignore_index!r} ({kind})")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")
    if backend not in BACKENDS and backend not in HEAD_BACKENDS:
        choices = BACKENDS + tuple(name for name in HEAD_BACKENDS if name not in BACKENDS)
        raise ValueError(f"unknown head backend {backend!r}; choose among {choices}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


@dataclass(frozen=True, eq=False)
class HeadSettings:
    """A head's weight, bias and options (what a backend reads: a `lit_losses.heads.backend.HeadConfig`),
    checked when built, and the three calls over them: `logprobs`, `cross_entropy`, `pointwise_loss` (the
    functional API and `FusedLMHead` call these). Each checks the inputs, keeps the valid tokens, routes
    the call (`select_backend`) and computes it in the compute dtype (`computing`); a subclass changes
    those steps (`lit_losses.heads.vocab_parallel.ShardedSettings`).

    Raises:
        ValueError: an unknown ``backend`` or ``matmul_precision``, ``chunk_size < 1``, or a temperature
            that is not finite and positive.
    """

    weight: Tensor
    bias: Tensor | None
    backend: str
    chunk_size: int | None
    ignore_index: int
    accum_dtype: torch.dtype
    check_finite: bool
    matmul_precision: MatmulPrecision
    temperature: float = 1.0

    def __post_init__(self) -> None:
        check_head_options(
            self.backend,
            self.chunk_size,
            self.matmul_precision,
            temperature=self.temperature,
            ignore_index=self.ignore_index,
        )

    @property
    def vocab_size(self) -> int:
        """``V``, the number of rows of the weight."""
        return self.weight.shape[0]

    def narrow_weight(self, hidden: Tensor) -> bool:
        """Whether the weight is stored in a narrower dtype than the call's compute dtype (a bf16 weight,
        fp32 compute): ``auto`` then takes the ``blocked`` backend (`select_backend`)."""
        dtype = compute_dtype(hidden, self.weight, self.bias, accum_dtype=self.accum_dtype)
        return torch.finfo(self.weight.dtype).bits < torch.finfo(dtype).bits

    def tempered(self, hidden: Tensor) -> tuple[HeadSettings, Tensor]:
        """``(settings, hidden)`` for logits ``z / T``: ``(h / T) Wᵀ + b / T``, the division done in
        ``promote(hidden, accum_dtype)`` (no rounding to bf16 on the way) and differentiated by autograd;
        the returned settings have temperature 1. Unchanged when ``T = 1``."""
        if self.temperature == 1:
            return self, hidden
        t = self.temperature
        bias = None if self.bias is None else self.bias / t
        h = hidden.to(torch.promote_types(hidden.dtype, self.accum_dtype)) / t
        return replace(self, bias=bias, temperature=1.0), h

    @contextmanager
    def computing(self, hidden: Tensor, backend: HeadBackend) -> Iterator[tuple[HeadConfig, Tensor]]:
        """``(settings, hidden)`` as ``backend`` takes them: `tempered`, then `in_compute_dtype` (the
        weight kept in its dtype for a backend that casts its blocks, `HeadBackend.casts_weight_blocks`)."""
        head, h = self.tempered(hidden)
        with in_compute_dtype(head, h, keep_weight=backend.casts_weight_blocks) as (cast, h_cast):
            yield cast, h_cast

    def check_inputs(self, hidden: Tensor, targets: Tensor, token_weights: Tensor | None = None) -> None:
        """`check_head_inputs` of one call's ``hidden``, ``targets`` (and ``token_weights``) against this
        weight and bias."""
        check_head_inputs(
            hidden,
            targets,
            self.weight,
            bias=self.bias,
            ignore_index=self.ignore_index,
            check_finite=self.check_finite,
            token_weights=token_weights,
        )

    def logprobs(self, hidden: Tensor, targets: Tensor, outputs: str | Sequence[str]) -> HeadOutput:
        """`linear_logprobs` with these settings: check the inputs, route, compute in the compute dtype."""
        outputs = normalize_outputs(outputs)
        self.check_inputs(hidden, targets)
        route = select_backend(
            self.backend,
            "per_token",
            outputs=outputs,
            on_cuda=hidden.is_cuda,
            narrow_weight=self.narrow_weight(hidden),
        )
        with self.computing(hidden, route.backend) as (head, h):
            return route.backend.per_token(head, h, targets, outputs)

    def cross_entropy(
        self, hidden: Tensor, targets: Tensor, token_weights: Tensor | float, reduction: Reduction
    ) -> Tensor:
        """`linear_cross_entropy` with these settings: check the inputs, keep the valid tokens, route, then
        the backend's fused path or its per-token ``logprobs``."""
        if reduction not in get_args(Reduction):
            raise ValueError(f"reduction {reduction!r} is not one of {get_args(Reduction)}")
        uniform = not isinstance(token_weights, Tensor)
        # a tensor's values are checked with the head's inputs, in their one read; then its shape
        self.check_inputs(hidden, targets, token_weights=None if uniform else token_weights)
        check_token_weights(token_weights, targets, check_finite=self.check_finite and uniform)
        valid = targets != self.ignore_index
        if uniform:
            h, y = compact_valid(valid, hidden, targets)
            w = token_weights
        else:
            h, y, w = compact_valid(valid, hidden, targets, token_weights)
        y = y.long()
        if reduction == "mean":
            w = w / max(int(h.shape[0]), 1)
        # CUDA-only kernels (Liger) compute in fp32 at best: float64 stays on the exact chunked path
        cuda_kernel = hidden.is_cuda and hidden.dtype != torch.float64
        route = select_backend(
            self.backend,
            "weighted_ce",
            uniform=uniform,
            on_cuda=cuda_kernel,
            narrow_weight=self.narrow_weight(h),
            low_logits=self.matmul_precision == "low_logits",
        )
        if route.fused:
            with self.computing(h, route.backend) as (head, h):
                return route.backend.fused_ce(head, h, y, w)
        w = weight_vector(w, h.shape[0], h.device)
        logprobs = self.logprobs(hidden, targets, ("logprobs",)).logprobs[valid]
        return -(w.to(logprobs.dtype) * logprobs).sum()

    def pointwise_loss(
        self,
        hidden: Tensor,
        targets: Tensor,
        chunk_loss: ChunkLoss,
        with_entropy: bool,
        needs: Sequence[str] | None,
    ) -> Tensor:
        """`linear_pointwise_loss` with these settings: check the inputs, keep the valid tokens, route, then
        the backend's fused path or ``chunk_loss`` once on its per-token outputs."""
        self.check_inputs(hidden, targets)
        valid, h, y = valid_tokens(hidden, targets, self.ignore_index)
        default = HEAD_OUTPUTS if with_entropy else ("logprobs", "lse")
        outputs = ("logprobs", *(o for o in normalize_outputs(needs or default) if o != "logprobs"))
        route = select_backend(
            self.backend,
            "pointwise",
            outputs=outputs,
            narrow_weight=self.narrow_weight(h),
            low_logits=self.matmul_precision == "low_logits",
        )
        if route.fused:
            with self.computing(h, route.backend) as (head, h):
                return route.backend.fused_pointwise(head, h, y, chunk_loss, with_entropy)
        out = self.logprobs(hidden, targets, outputs)
        lse = None if out.lse is None else out.lse[valid]
        entropy = out.entropy[valid] if with_entropy and out.entropy is not None else None
        return chunk_loss(0, int(h.shape[0]), out.logprobs[valid], lse, entropy)


#: The names of the keyword options of the functional calls, ``backend`` to ``temperature`` (the fields of
#: `HeadSettings` but ``weight`` and ``bias``; `FusedLMHead` holds them as attributes).
HEAD_OPTIONS: tuple[str, ...] = tuple(
    f.name for f in fields(HeadSettings) if f.name not in ("weight", "bias")
)


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    *,
    outputs: str | Sequence[str] = ("logprobs",),
    backend: Backend | str = "auto",
    chunk_size: int | None = None,
    ignore_index: int = -100,
    accum_dtype: torch.dtype = torch.float32,
    check_finite: bool = True,
    matmul_precision: MatmulPrecision = "auto",
    temperature: float = 1.0,
) -> HeadOutput:
    """Per-token outputs of the softmax of ``z = h Wᵀ + b`` at every position, logits never materialized.

    For each position ``t`` with ``y_t != ignore_index``: ``logprobs = log p_t[y_t] = z_{t,y} − lse_t``,
    ``lse = log Σ_v e^{z_{t,v}}``, ``entropy = −Σ_v p_{t,v} log p_{t,v}``; 0 (and no gradient) at ignored
    positions, which no matmul sees (except the ``naive`` reference's). Gradients with respect to
    ``hidden``, ``weight`` and ``bias`` are exact (the ``chunked`` backend recomputes the logits chunk by
    chunk in backward).

    Args:
        hidden: ``[..., D]`` hidden states.
        weight: ``[V, D]`` output projection.
        targets: ``[...]`` token ids (``ignore_index`` where none).
        bias: ``[V]`` or ``None``.
        outputs: one or more of ``"logprobs"``, ``"lse"``, ``"entropy"``.
        backend: ``auto`` (``blocked``, see `select_backend`), ``chunked``, ``blocked``, ``naive``, ``torch``
            (``logprobs`` only), or a registered name (`HEAD_BACKENDS`).
        chunk_size: tokens per chunk (default: from a memory budget, `default_chunk_size`).
        ignore_index: target value of positions without a label.
        accum_dtype: the least precise dtype of logits, statistics and gradients (`heads.precision`).
        check_finite: raise when ``weight`` or ``hidden`` holds NaN/Inf (one reduction each).
        matmul_precision: matmul operands in the compute dtype (``full``), in bf16 when in play (``low``;
            ``low_logits``: the ``blocked`` backend's logits in bf16 too, `lit_losses.heads.precision`),
            or ``low`` on CUDA and ``full`` elsewhere (``auto``).
        temperature: ``T``: every output is that of the logits ``z / T`` (gradients included, also with
            respect to nothing else: ``T`` is a constant), for sampling-temperature-aware RL objectives.

    Returns:
        A `HeadOutput`: the requested fields shaped like ``targets``, the others ``None``.

    Raises:
        ValueError: bad inputs (shapes, target range, non-finite values), unknown options or outputs, or
            outputs the backend cannot give.

    Example:
        >>> import torch
        >>> from lit_losses.heads import linear_logprobs
        >>> g = torch.Generator().manual_seed(0)
        >>> hidden = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
        >>> weight = torch.randn(11, 4, generator=g, dtype=torch.float64)  # V=11, D=4
        >>> targets = torch.tensor([[1, 5, -100], [0, 10, 3]])
        >>> out = linear_logprobs(hidden, weight, targets, outputs=("logprobs", "entropy"), chunk_size=2)
        >>> logp = torch.log_softmax(hidden @ weight.T, -1)
        >>> ref = logp.gather(-1, targets.clamp_min(0)[..., None])[..., 0].masked_fill(targets < 0, 0)
        >>> torch.allclose(out.logprobs, ref), out.lse is None, out.entropy.shape
        (True, True, torch.Size([2, 3]))
    """
    head = HeadSettings(
        weight=weight,
        bias=bias,
        backend=backend,
        chunk_size=chunk_size,
        ignore_index=ignore_index,
        accum_dtype=accum_dtype,
        check_finite=check_finite,
        matmul_precision=matmul_precision,
        temperature=temperature,
    )
    return head.logprobs(hidden, targets, outputs)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    *,
    token_weights: Tensor | float = 1.0,
    reduction: Reduction = "mean",
    backend: Backend | str = "auto",
    chunk_size: int | None = None,
    ignore_index: int = -100,
    accum_dtype: torch.dtype = torch.float32,
    check_finite: bool = True,
    matmul_precision: MatmulPrecision = "auto",
    temperature: float = 1.0,
) -> Tensor:
    """The cross-entropy of ``z = h Wᵀ + b``, ``Σ_t w_t · (−log p_t[y_t])`` over the valid positions
    (``y_t != ignore_index``), divided by their number ``n`` for ``reduction="mean"`` (0 when ``n = 0``).

    Every gradient is computed in forward (three ``N·D·V`` matmuls on the ``chunked`` backend; backward
    only rescales them). Backends without a fused path (``naive``, ``torch``) take their per-token
    ``logprobs``; ``liger`` takes one float weight only. ``auto`` is ``blocked`` for a weight narrower than
    the compute dtype (bf16-true: no ``V × D`` temporary, four matmuls); otherwise ``liger`` for one float
    weight on CUDA when Liger-Kernel is installed, else ``chunked`` (`select_backend`).

    Args:
        hidden: ``[..., D]`` hidden states.
        weight: ``[V, D]`` output projection.
        targets: ``[...]`` token ids (``ignore_index`` where none).
        bias: ``[V]`` or ``None``.
        token_weights: ``w``: one float for every token, or per-position weights shaped like ``targets``
            (values at ignored positions are unused; no gradient).
        reduction: ``"mean"`` (``÷ n``) or ``"sum"``.
        backend: see `linear_logprobs`.
        chunk_size: tokens per chunk (default: from a memory budget).
        ignore_index: target value of positions without a label.
        accum_dtype: the least precise dtype of logits, statistics and gradients.
        check_finite: raise when ``weight`` or ``hidden`` holds NaN/Inf.
        matmul_precision: see `linear_logprobs`.
        temperature: see `linear_logprobs`.

    Returns:
        The scalar loss.

    Raises:
        ValueError: bad inputs or options, or per-token weights for a backend that takes one float only.

    Example:
        >>> import torch
        >>> from lit_losses.heads import linear_cross_entropy
        >>> g = torch.Generator().manual_seed(0)
        >>> hidden = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
        >>> weight = torch.randn(11, 4, generator=g, dtype=torch.float64, requires_grad=True)
        >>> targets = torch.tensor([1, 5, -100, 0, 10])
        >>> loss = linear_cross_entropy(hidden, weight, targets)
        >>> ref = torch.nn.functional.cross_entropy(hidden @ weight.T, targets)  # mean over 4 valid tokens
        >>> torch.allclose(loss, ref)
        True
        >>> loss.backward()
        >>> bool(hidden.grad[2].eq(0).all())
        True
    """
    head = HeadSettings(
        weight=weight,
        bias=bias,
        backend=backend,
        chunk_size=chunk_size,
        ignore_index=ignore_index,
        accum_dtype=accum_dtype,
        check_finite=check_finite,
        matmul_precision=matmul_precision,
        temperature=temperature,
    )
    return head.cross_entropy(hidden, targets, token_weights, reduction=reduction)


def check_token_weights(token_weights: Tensor | float, targets: Tensor, check_finite: bool = True) -> None:
    """Refuse per-token weights of another shape than ``targets`` and (with ``check_finite``) NaN/Inf ones.

    Example:
        >>> check_token_weights(torch.tensor([1.0, float("nan")]), torch.tensor([3, 4]))
        Traceback (most recent call last):
        ...
        ValueError: token_weights hold 1 non-finite value(s) (NaN/Inf), e.g. at position (1,)
    """
    if not isinstance(token_weights, Tensor):
        if check_finite and not math.isfinite(float(token_weights)):
            raise ValueError(f"token_weights={token_weights!r} must be a finite number")
        return
    if token_weights.shape != targets.shape:
        raise ValueError(
            f"token_weights shape {tuple(token_weights.shape)} differs from the targets' shape "
            f"{tuple(targets.shape)} (one weight per position, or one float for all)"
        )
    if check_finite:
        check_finite_token_weights(token_weights)


def linear_pointwise_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    chunk_loss: ChunkLoss,
    bias: Tensor | None = None,
    *,
    with_entropy: bool = False,
    needs: Sequence[str] | None = None,
    backend: Backend | str = "auto",
    chunk_size: int | None = None,
    ignore_index: int = -100,
    accum_dtype: torch.dtype = torch.float32,
    check_finite: bool = True,
    matmul_precision: MatmulPrecision = "auto",
    temperature: float = 1.0,
) -> Tensor:
    """``Σ_chunks chunk_loss(s, e, ℓ[s:e], lse[s:e], H[s:e])``: a loss that is a sum of per-token functions
    of ``(logprobs, lse, entropy)`` of ``z = h Wᵀ + b``, its gradients computed in forward.

    ``chunk_loss(start, end, logprobs, lse, entropy)`` returns the loss of the valid positions
    ``[start, end)`` (row-major order of ``targets != ignore_index``) from their 1-D values (``entropy``
    ``None`` unless ``with_entropy``); a token's loss depends on its own values only. On ``chunked`` (also
    for ``auto`` and ``liger``) each chunk's upstream gradients come from autograd on its ``O(chunk)``
    values and are folded into ``∂/∂z`` (no double backward); ``blocked`` (``auto``'s for a weight
    narrower than the compute dtype), ``naive`` and ``torch`` call ``chunk_loss`` once on all tokens from
    their per-token outputs.

    Args:
        hidden: ``[..., D]`` hidden states.
        weight: ``[V, D]`` output projection.
        targets: ``[...]`` token ids (``ignore_index`` where none).
        chunk_loss: the loss of a range of valid tokens from their per-token values.
        bias: ``[V]`` or ``None``.
        with_entropy: compute the entropy and pass it to ``chunk_loss``.
        needs: the values ``chunk_loss`` reads (default: ``logprobs``, ``lse`` and, with ``with_entropy``,
            ``entropy``); a backend without fused path computes only these and passes ``None`` for others.
        backend: see `linear_logprobs`.
        chunk_size: tokens per chunk (default: from a memory budget).
        ignore_index: target value of positions without a label.
        accum_dtype: the least precise dtype of logits, statistics and gradients.
        check_finite: raise when ``weight`` or ``hidden`` holds NaN/Inf.
        matmul_precision: see `linear_logprobs`.
        temperature: see `linear_logprobs`.

    Returns:
        The scalar loss.

    Raises:
        ValueError: bad inputs or options, or a backend that cannot give the values.

    Example:
        >>> import torch
        >>> from lit_losses.heads import linear_pointwise_loss
        >>> g = torch.Generator().manual_seed(0)
        >>> hidden = torch.randn(5, 4, generator=g, dtype=torch.float64)
        >>> weight = torch.randn(11, 4, generator=g, dtype=torch.float64)
        >>> targets = torch.tensor([1, 5, -100, 0, 10])
        >>> def z_loss(start, end, logprobs, lse, entropy):  # Σ_t lse_t²
        ...     return (lse**2).sum()
        >>> loss = linear_pointwise_loss(hidden, weight, targets, z_loss, chunk_size=2)
        >>> lse = torch.logsumexp(hidden @ weight.T, -1)[targets != -100]
        >>> torch.allclose(loss, (lse**2).sum())
        True
    """
    head = HeadSettings(
        weight=weight,
        bias=bias,
        backend=backend,
        chunk_size=chunk_size,
        ignore_index=ignore_index,
        accum_dtype=accum_dtype,
        check_finite=check_finite,
        matmul_precision=matmul_precision,
        temperature=temperature,
    )
    return head.pointwise_loss(hidden, targets, chunk_loss, with_entropy=with_entropy, needs=needs)


__all__ = [
    "BACKENDS",
    "BACKEND_OUTPUTS",
    "HEAD_OPTIONS",
    "Backend",
    "HeadSettings",
    "Reduction",
    "check_head_options",
    "linear_cross_entropy",
    "linear_logprobs",
    "linear_pointwise_loss",
]
