"""`FusedLMHead`: one interface over the output-head backends; `select_backend` picks the backend."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import torch
from torch import Tensor, nn

from lit_losses.choices import check_choice
from lit_losses.heads import chunked, liger, naive, torch_lce
from lit_losses.heads.backend import (
    HEAD_BACKENDS,
    BackendOutputs,
    ChunkLoss,
    select_backend,
    valid_tokens,
    weight_vector,
)
from lit_losses.heads.chunked_ops import mm_in
from lit_losses.heads.output import HeadOutput, check_head_inputs, normalize_outputs
from lit_losses.heads.precision import MatmulPrecision, in_compute_dtype

#: The head backends a configuration can name (``auto`` picks among the registered ones).
Backend = Literal["auto", "chunked", "naive", "torch", "liger"]
BACKENDS: tuple[str, ...] = get_args(Backend)
#: Per-token outputs each registered backend can give (a live view of `HEAD_BACKENDS`).
BACKEND_OUTPUTS = BackendOutputs()

_BUILTIN = (chunked.CHUNKED, naive.NAIVE, torch_lce.TORCH, liger.LIGER)
if set(BACKENDS) != {"auto", *(b.name for b in _BUILTIN)}:  # pragma: no cover - a maintenance error
    raise RuntimeError(f"Backend lists {BACKENDS}; the built-in backends are {[b.name for b in _BUILTIN]}")


class FusedLMHead:
    """The output head ``z = h Wᵀ + b`` fused with what the loss needs, logits never materialized.

    ``head(hidden [..., D], targets [...], outputs)`` returns a `HeadOutput` whose requested fields
    (``logprobs = log p[y]``, ``lse = log Σ_v e^{z_v}``, ``entropy = −Σ_v p_v log p_v``, ``p = softmax(z)``)
    are shaped like ``targets``, with exact gradients with respect to ``hidden``, ``weight`` and ``bias``.
    Ignored positions (``targets == ignore_index``) are 0 and get no gradient; they are dropped before any
    matmul (except by the ``naive`` reference). ``head.weighted_ce(hidden, targets, w)`` is the plain
    cross-entropy fast path ``Σ_t w_t · (−log p_t[y_t])`` whose gradients are computed in forward, and
    ``head.pointwise_loss`` the same for sums of per-token functions of ``(logprobs, lse, entropy)``.
    Which backend computes a call is decided by `select_backend` from the registered `HeadBackend` s.

    The head holds references: gradients accumulate into ``model.get_output_embeddings().weight`` (or tied).

    Args:
        weight: output projection ``[V, D]``.
        bias: optional ``[V]`` bias.
        backend: ``chunked`` (pure PyTorch, CPU/CUDA), ``naive`` (materializes logits; the reference),
            ``torch`` (`F.linear_cross_entropy`, logprobs only), ``liger`` (CUDA, plain CE with one token
            weight), ``auto`` (chunked; liger for that plain CE on CUDA when installed), or a registered name.
        chunk_size: tokens per chunk (default: about 512 MiB of fp32 logits per chunk; on CPU about
            128 MiB and at most 1024 tokens, see `default_chunk_size`).
        ignore_index: target value of positions without a label.
        accum_dtype: the least precise dtype of logits, softmax statistics, gradient accumulation and
            outputs: ``promote(hidden, weight, bias, accum_dtype)``, autocast off (`heads.precision`).
        check_finite: raise when hidden states contain NaN/Inf (costs one reduction over ``hidden``).
        matmul_precision: matmul operands in the compute dtype (``full``), in bf16 when in play (``low``,
            tensor cores), or ``low`` on CUDA and ``full`` elsewhere (``auto``); see `operand_dtype`.

    Raises:
        ValueError: unknown ``backend`` or ``matmul_precision``, or ``chunk_size < 1``.

    Example:
        >>> import torch
        >>> from lit_losses.heads import FusedLMHead
        >>> g = torch.Generator().manual_seed(0)
        >>> weight = torch.randn(11, 4, generator=g, dtype=torch.float64, requires_grad=True)  # V=11, D=4
        >>> hidden = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
        >>> targets = torch.tensor([[1, 5, -100], [0, 10, 3]])
        >>> head = FusedLMHead(weight, chunk_size=2)
        >>> out = head(hidden, targets, ("logprobs", "entropy"))
        >>> out.logprobs.shape, out.lse is None, out.logprobs.detach()[0, 2].item()
        (torch.Size([2, 3]), True, 0.0)
        >>> logp = torch.log_softmax(hidden @ weight.T, -1)
        >>> ref = logp.gather(-1, targets.clamp_min(0)[..., None])[..., 0].masked_fill(targets < 0, 0)
        >>> torch.allclose(out.logprobs, ref)
        True
        >>> loss = head.weighted_ce(hidden, targets, 0.2)  # 0.2 · Σ_t −log p_t[y_t], gradients in forward
        >>> torch.allclose(loss, -0.2 * ref.sum())
        True
        >>> loss.backward()
        >>> hidden.grad.shape, bool(hidden.grad[0, 2].eq(0).all())
        (torch.Size([2, 3, 4]), True)
    """

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None = None,
        backend: Backend = "auto",
        chunk_size: int | None = None,
        ignore_index: int = -100,
        accum_dtype: torch.dtype = torch.float32,
        check_finite: bool = True,
        matmul_precision: MatmulPrecision = "auto",
    ) -> None:
        check_choice(matmul_precision, MatmulPrecision, "matmul_precision")
        if backend not in BACKENDS and backend not in HEAD_BACKENDS:
            choices = BACKENDS + tuple(name for name in HEAD_BACKENDS if name not in BACKENDS)
            raise ValueError(f"unknown head backend {backend!r}; choose among {choices}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.weight, self.bias = weight, bias
        self.backend, self.chunk_size = backend, chunk_size
        self.ignore_index, self.accum_dtype, self.check_finite = ignore_index, accum_dtype, check_finite
        self.matmul_precision = matmul_precision

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> FusedLMHead:
        """A head over ``linear``'s weight and bias (e.g. ``model.get_output_embeddings()``), ``kwargs``."""
        return cls(linear.weight, linear.bias, **kwargs)

    @property
    def vocab_size(self) -> int:
        """``V``, the number of rows of the weight."""
        return self.weight.shape[0]

    def resolve_backend(self, outputs: Sequence[str]) -> str:
        """The name of the backend that computes the per-token ``outputs`` (for ``auto``: chunked); a
        `ValueError` naming those that can when it cannot give them."""
        return select_backend(self.backend, "per_token", outputs=outputs).backend.name

    def __call__(
        self, hidden: Tensor, targets: Tensor, outputs: str | Sequence[str] = ("logprobs",)
    ) -> HeadOutput:
        """Per-token ``outputs`` of the output distribution at every position.

        Args:
            hidden: ``[..., D]`` hidden states.
            targets: ``[...]`` token ids (``ignore_index`` where none).
            outputs: one or more of ``"logprobs"``, ``"lse"``, ``"entropy"``.

        Returns:
            A `HeadOutput`: the requested fields shaped like ``targets`` (0 and no gradient at ignored
            positions), the others ``None``.

        Raises:
            ValueError: bad inputs (shapes, target range, non-finite hidden states), unknown outputs, or
                outputs the backend cannot give.
        """
        outputs = normalize_outputs(outputs)
        check_head_inputs(hidden, targets, self.weight, self.bias, self.ignore_index, self.check_finite)
        route = select_backend(self.backend, "per_token", outputs=outputs)
        with in_compute_dtype(self, hidden) as (head, h):
            return route.backend.per_token(head, h, targets, outputs)

    def weighted_ce(self, hidden: Tensor, targets: Tensor, token_weights: Tensor | float) -> Tensor:
        """Plain-CE fast path: ``Σ_t w_t · (−log p_t[y_t])`` over valid positions, gradients fused.

        Backends without a fused plain-CE path (``naive``, ``torch``) use their per-token ``logprobs``.

        Args:
            hidden: ``[..., D]`` hidden states.
            targets: ``[...]`` token ids (``ignore_index`` where none).
            token_weights: per-position weights shaped like ``targets`` (values at ignored positions
                are unused), or one float for every token.

        Returns:
            The scalar loss.

        Raises:
            ValueError: bad inputs, or per-token weights for a backend that takes one weight only
                (``liger``).
        """
        check_head_inputs(hidden, targets, self.weight, self.bias, self.ignore_index, self.check_finite)
        valid, h, y = valid_tokens(hidden, targets, self.ignore_index)
        uniform = not isinstance(token_weights, Tensor)
        # CUDA-only kernels (Liger) compute in fp32 at best: float64 stays on the exact chunked path
        cuda_kernel = hidden.is_cuda and hidden.dtype != torch.float64
        route = select_backend(self.backend, "weighted_ce", uniform=uniform, on_cuda=cuda_kernel)
        w = token_weights if uniform else token_weights[valid]
        if route.fused:
            with in_compute_dtype(self, h) as (head, h):
                return route.backend.fused_ce(head, h, y, w)
        w = weight_vector(w, h.shape[0], h.device)
        logprobs = self(hidden, targets, "logprobs").logprobs[valid]
        return -(w.to(logprobs.dtype) * logprobs).sum()

    def pointwise_loss(
        self,
        hidden: Tensor,
        targets: Tensor,
        chunk_loss: ChunkLoss,
        with_entropy: bool = False,
        needs: Sequence[str] | None = None,
    ) -> Tensor:
        """A loss that is a sum of per-token functions of ``(logprobs, lse, entropy)``, gradients fused.

        ``chunk_loss(start, end, logprobs, lse, entropy)`` returns the loss of the valid positions
        ``[start, end)`` (row-major order of ``targets != ignore_index``) from their 1-D values (``entropy``
        ``None`` unless ``with_entropy``); a token's loss depends on its own values only. ``chunked`` (also
        for ``auto`` and ``liger``) computes every gradient in forward (no double backward); ``naive`` and
        ``torch`` call ``chunk_loss`` once on all tokens from their per-token outputs.

        Args:
            hidden: ``[..., D]`` hidden states.
            targets: ``[...]`` token ids (``ignore_index`` where none).
            chunk_loss: the loss of a range of valid tokens from their per-token values.
            with_entropy: compute the entropy and pass it to ``chunk_loss``.
            needs: the values ``chunk_loss`` reads (default: ``logprobs``, ``lse`` and, with
                ``with_entropy``, ``entropy``); a backend without fused path computes only these, and
                passes ``None`` for the others (e.g. ``torch``, which gives ``logprobs`` only).

        Returns:
            The scalar loss ``Σ chunk_loss(…)``.

        Raises:
            ValueError: bad inputs, or a backend that cannot give the values.
        """
        check_head_inputs(hidden, targets, self.weight, self.bias, self.ignore_index, self.check_finite)
        valid, h, y = valid_tokens(hidden, targets, self.ignore_index)
        default = ("logprobs", "lse", "entropy") if with_entropy else ("logprobs", "lse")
        outputs = ("logprobs", *(o for o in normalize_outputs(needs or default) if o != "logprobs"))
        route = select_backend(self.backend, "pointwise", outputs=outputs)
        if route.fused:
            with in_compute_dtype(self, h) as (head, h):
                return route.backend.fused_pointwise(head, h, y, chunk_loss, with_entropy)
        out = self(hidden, targets, outputs)
        lse = None if out.lse is None else out.lse[valid]
        ent = out.entropy[valid] if with_entropy and out.entropy is not None else None
        return chunk_loss(0, int(h.shape[0]), out.logprobs[valid], lse, ent)

    def forward_logits(self, hidden: Tensor) -> Tensor:
        """Full logits ``h Wᵀ + b`` ``[..., V]`` of ``hidden [..., D]`` (materialized), compute dtype."""
        with in_compute_dtype(self, hidden) as (head, h):
            dtype = torch.promote_types(h.dtype, self.accum_dtype)
            logits = mm_in(h.reshape(-1, h.shape[-1]), head.weight.t(), dtype).reshape(*h.shape[:-1], -1)
            return logits if head.bias is None else logits + head.bias.to(dtype)
