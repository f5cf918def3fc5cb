"""`FusedLMHead`: the output head as an object over the functional API (`lit_losses.heads.functional`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lit_losses.heads.backend import ChunkLoss, select_backend
from lit_losses.heads.chunked_ops import mm_in
from lit_losses.heads.functional import (
    BACKEND_OUTPUTS,
    BACKENDS,
    HEAD_OPTIONS,
    Backend,
    HeadSettings,
    check_head_options,
)
from lit_losses.heads.output import HeadOutput
from lit_losses.heads.precision import MatmulPrecision, in_compute_dtype

__all__ = ["BACKENDS", "BACKEND_OUTPUTS", "Backend", "FusedLMHead"]


class FusedLMHead:
    """The output head ``z = h Wᵀ + b`` fused with what the loss needs, logits never materialized.

    ``head(hidden [..., D], targets [...], outputs)`` returns a `HeadOutput` whose requested fields
    (``logprobs = log p[y]``, ``lse = log Σ_v e^{z_v}``, ``entropy = −Σ_v p_v log p_v``, ``p = softmax(z)``)
    are shaped like ``targets``, with exact gradients with respect to ``hidden``, ``weight`` and ``bias``.
    Ignored positions (``targets == ignore_index``) are 0 and get no gradient; they are dropped before any
    matmul (except by the ``naive`` reference). ``head.weighted_ce(hidden, targets, w)`` is the plain
    cross-entropy fast path ``Σ_t w_t · (−log p_t[y_t])`` whose gradients are computed in forward, and
    ``head.pointwise_loss`` the same for sums of per-token functions of ``(logprobs, lse, entropy)``.
    Which backend computes a call is decided by `select_backend` from the registered `HeadBackend` s. The
    head holds the weight, the bias and the options; each method is the call of the functional API
    (`linear_logprobs`, `linear_cross_entropy` with ``reduction="sum"``, `linear_pointwise_loss`) with
    them: a method of its `settings`.

    The head holds references: gradients accumulate into ``model.get_output_embeddings().weight`` (or tied).

    Args:
        weight: output projection ``[V, D]``.
        bias: optional ``[V]`` bias.
        backend: ``chunked`` (pure PyTorch, CPU/CUDA, token chunks), ``blocked`` (pure PyTorch, vocabulary
            blocks: no ``V × D`` temporary), ``naive`` (materializes logits; the reference), ``torch``
            (`F.linear_cross_entropy`, logprobs only), ``liger`` (CUDA, plain CE with one token weight),
            ``liger_scaled`` (CUDA, Liger's logprobs + entropy, no bias), ``cce`` (CUDA, cut-cross-entropy's
            logprobs and plain CE, bf16/fp16, no bias; ``auto`` never picks these two), ``auto`` (blocked
            for per-token outputs and for a weight narrower than the compute dtype, else chunked;
            liger for the plain CE with one token weight, on CUDA, of a weight in the compute dtype, when
            installed; `select_backend` gives the reasons), or a registered name.
        chunk_size: tokens per chunk (default: about 512 MiB of fp32 logits per chunk; on CPU about
            128 MiB and at most 1024 tokens, see `default_chunk_size`).
        ignore_index: target value of positions without a label.
        accum_dtype: the least precise dtype of logits, softmax statistics, gradient accumulation and
            outputs: ``promote(hidden, weight, bias, accum_dtype)``, autocast off (`heads.precision`).
        check_finite: raise when hidden states contain NaN/Inf (costs one reduction over ``hidden``).
        matmul_precision: matmul operands in the compute dtype (``full``), in bf16 when in play (``low``,
            tensor cores; ``low_logits``: the ``blocked`` backend's logits in bf16 too, half the bytes per
            logit), or ``low`` on CUDA and ``full`` elsewhere (``auto``); see `lit_losses.heads.precision`.
        temperature: ``T > 0``: every output and loss is that of the logits ``z / T`` (e.g. the sampling
            temperature of an RL rollout), with exact gradients (`linear_logprobs`).

    Raises:
        TypeError: a ``chunk_size`` or ``ignore_index`` that is not an integer (``"512"``).
        ValueError: unknown ``backend`` or ``matmul_precision``, ``chunk_size < 1``, or a temperature that
            is not finite and positive.

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
        temperature: float = 1.0,
    ) -> None:
        check_head_options(
            backend, chunk_size, matmul_precision, temperature=temperature, ignore_index=ignore_index
        )
        self.weight = weight
        self.bias = bias
        self.backend = backend
        self.chunk_size = chunk_size
        self.ignore_index = ignore_index
        self.accum_dtype = accum_dtype
        self.check_finite = check_finite
        self.matmul_precision = matmul_precision
        self.temperature = temperature

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> FusedLMHead:
        """A head over ``linear``'s weight and bias (e.g. ``model.get_output_embeddings()``), ``kwargs``."""
        return cls(linear.weight, linear.bias, **kwargs)

    @property
    def vocab_size(self) -> int:
        """``V``, the number of rows of the weight."""
        return self.weight.shape[0]

    def options(self) -> dict[str, Any]:
        """The keyword options of the functional calls: ``backend``, ``chunk_size``, ``ignore_index``,
        ``accum_dtype``, ``check_finite``, ``matmul_precision``, ``temperature``."""
        return {name: getattr(self, name) for name in HEAD_OPTIONS}

    def settings(self) -> HeadSettings:
        """The weight, the bias and the options as one call takes them (checked)."""
        return HeadSettings(weight=self.weight, bias=self.bias, **self.options())

    def resolve_backend(self, outputs: Sequence[str]) -> str:
        """The name of the backend that computes the per-token ``outputs`` (for ``auto``: ``blocked``,
        whatever the weight and the device); a `ValueError` naming those that can when it cannot give them."""
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
        return self.settings().logprobs(hidden, targets, outputs)

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
        return self.settings().cross_entropy(hidden, targets, token_weights, reduction="sum")

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
        for ``auto`` and ``liger``) computes every gradient in forward (no double backward); ``blocked``
        (``auto``'s for a weight narrower than the compute dtype), ``naive`` and ``torch`` call
        ``chunk_loss`` once on all tokens from their per-token outputs.

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
        return self.settings().pointwise_loss(
            hidden, targets, chunk_loss, with_entropy=with_entropy, needs=needs
        )

    def forward_logits(self, hidden: Tensor) -> Tensor:
        """Full logits ``h Wᵀ + b`` ``[..., V]`` of ``hidden [..., D]`` (materialized), compute dtype; the raw
        logits: ``temperature`` is not applied."""
        with in_compute_dtype(self, hidden) as (head, h):
            dtype = torch.promote_types(h.dtype, self.accum_dtype)
            logits = mm_in(h.reshape(-1, h.shape[-1]), head.weight.t(), dtype).reshape(*h.shape[:-1], -1)
            return logits if head.bias is None else logits + head.bias.to(dtype)
