"""`FusedLMHead`: one interface over the output-head backends, and the dispatch between them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from lit_losses.heads.chunked import (
    ChunkedLogProbs,
    ChunkedPointwiseLoss,
    ChunkedWeightedCE,
    ChunkLoss,
    default_chunk_size,
)
from lit_losses.heads.liger import liger_available, liger_uniform_ce_sum
from lit_losses.heads.naive import naive_head
from lit_losses.heads.output import HeadOutput, check_head_inputs, normalize_outputs
from lit_losses.heads.torch_lce import torch_lce_logprobs

Backend = Literal["auto", "chunked", "naive", "torch", "liger"]
BACKENDS: tuple[str, ...] = ("auto", "chunked", "naive", "torch", "liger")
#: Per-token outputs each backend can give.
BACKEND_OUTPUTS: dict[str, tuple[str, ...]] = {
    "chunked": ("logprobs", "lse", "entropy"),
    "naive": ("logprobs", "lse", "entropy"),
    "torch": ("logprobs",),
    "liger": (),  # plain cross-entropy with one weight for every token only (see heads/liger.py)
}


class FusedLMHead:
    """The output head ``z = h Wᵀ + b`` fused with what the loss needs, logits never materialized.

    ``head(hidden [..., D], targets [...], outputs)`` returns a `HeadOutput` whose requested fields
    (``logprobs``, ``lse``, ``entropy``) are shaped like ``targets``, with exact gradients with respect
    to ``hidden``, ``weight`` and ``bias``. Ignored positions (``targets == ignore_index``) are 0 and get
    no gradient; they are dropped before any matmul. ``head.weighted_ce(hidden, targets, w)`` is the
    plain cross-entropy fast path ``Σ_t w_t · (−log p_t[y_t])`` whose gradients are computed in forward.

    The head holds references, not copies: pass ``model.get_output_embeddings().weight`` (or a tied
    embedding matrix) and gradients accumulate into that parameter.

    Args:
        weight: output projection ``[V, D]``.
        bias: optional ``[V]`` bias.
        backend: ``chunked`` (pure PyTorch, CPU/CUDA, recompute in backward), ``naive`` (materializes
            logits; the reference), ``torch`` (`F.linear_cross_entropy`, logprobs only), ``liger``
            (CUDA, plain CE with uniform token weight only), or ``auto`` (chunked, and liger for the
            uniform plain-CE fast path when on CUDA with liger installed).
        chunk_size: tokens per chunk (default: about 64 MiB of fp32 logits per chunk; on CPU about
            128 MiB and at most 1024 tokens, see `default_chunk_size`).
        ignore_index: target value of positions without a label.
        accum_dtype: dtype in which logits and gradients accumulate (inputs of higher precision keep
            theirs).
        check_finite: raise when hidden states contain NaN/Inf (costs one reduction over ``hidden``).
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
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown head backend {backend!r}; choose among {BACKENDS}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.weight, self.bias = weight, bias
        self.backend, self.chunk_size = backend, chunk_size
        self.ignore_index, self.accum_dtype, self.check_finite = ignore_index, accum_dtype, check_finite

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> FusedLMHead:
        """A head over an ``nn.Linear`` such as ``model.get_output_embeddings()``."""
        return cls(linear.weight, linear.bias, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    def resolve_backend(self, outputs: Sequence[str]) -> str:
        """The backend that computes ``outputs`` (for ``auto``: chunked)."""
        backend = "chunked" if self.backend == "auto" else self.backend
        missing = [o for o in outputs if o not in BACKEND_OUTPUTS[backend]]
        if missing:
            able = [b for b, outs in BACKEND_OUTPUTS.items() if all(o in outs for o in outputs)]
            raise ValueError(
                f"head backend {backend!r} cannot give {missing}; use one of {able} (e.g. backend='chunked')"
            )
        return backend

    def _chunk(self, n_tokens: int) -> int:
        return self.chunk_size or default_chunk_size(n_tokens, self.vocab_size, device=self.weight.device)

    def __call__(
        self, hidden: Tensor, targets: Tensor, outputs: str | Sequence[str] = ("logprobs",)
    ) -> HeadOutput:
        outputs = normalize_outputs(outputs)
        check_head_inputs(hidden, targets, self.weight, self.bias, self.ignore_index, self.check_finite)
        backend = self.resolve_backend(outputs)
        if backend == "naive":
            return naive_head(
                hidden, self.weight, self.bias, targets, outputs, self.ignore_index, self.accum_dtype
            )
        valid = targets != self.ignore_index
        h = hidden[valid]
        y = targets[valid].long()
        if backend == "torch":
            results = {"logprobs": torch_lce_logprobs(h, self.weight, self.bias, y, self.chunk_size)}
        else:
            logprobs, lse, entropy = ChunkedLogProbs.apply(
                h, self.weight, self.bias, y, "entropy" in outputs, self._chunk(h.shape[0]), self.accum_dtype
            )
            results = {"logprobs": logprobs, "lse": lse, "entropy": entropy}
        out = HeadOutput()
        for name in outputs:
            value = results[name]
            setattr(out, name, value.new_zeros(targets.shape).masked_scatter(valid, value))
        return out

    def weighted_ce(self, hidden: Tensor, targets: Tensor, token_weights: Tensor | float) -> Tensor:
        """Plain-CE fast path: ``Σ_t w_t · (−log p_t[y_t])`` over valid positions, gradients fused.

        Args:
            hidden: ``[..., D]`` hidden states.
            targets: ``[...]`` token ids (``ignore_index`` where none).
            token_weights: per-position weights shaped like ``targets`` (values at ignored positions
                are unused), or one float for every token.
        """
        check_head_inputs(hidden, targets, self.weight, self.bias, self.ignore_index, self.check_finite)
        valid = targets != self.ignore_index
        h, y = hidden[valid], targets[valid].long()
        uniform = not isinstance(token_weights, Tensor)
        backend = self.backend
        if backend == "auto":
            backend = "liger" if uniform and hidden.is_cuda and liger_available() else "chunked"
        if backend == "liger":
            if not uniform:
                raise ValueError(
                    "backend 'liger' supports one weight for every token only; use backend='chunked' "
                    "for per-token weights"
                )
            return liger_uniform_ce_sum(h, self.weight, self.bias, y, float(token_weights))
        if uniform:
            w = torch.full((h.shape[0],), float(token_weights), dtype=torch.float64, device=h.device)
        else:
            w = token_weights[valid]
        if backend in ("naive", "torch"):
            logprobs = self(hidden, targets, "logprobs").logprobs[valid]
            return -(w.to(logprobs.dtype) * logprobs).sum()
        loss, _ = ChunkedWeightedCE.apply(
            h, self.weight, self.bias, y, w, self._chunk(h.shape[0]), self.accum_dtype
        )
        return loss

    def pointwise_loss(
        self, hidden: Tensor, targets: Tensor, chunk_loss: ChunkLoss, with_entropy: bool = False
    ) -> Tensor:
        """A loss that is a sum of per-token functions of ``(logprobs, lse, entropy)``, gradients fused.

        ``chunk_loss(start, end, logprobs, lse, entropy)`` returns the loss of the valid positions
        ``[start, end)`` (row-major order of ``targets != ignore_index``) from their 1-D values
        (``entropy`` is ``None`` unless ``with_entropy``). Each token's loss must depend on that token's
        values only. The ``chunked`` backend computes every gradient during forward (three matmuls, as
        the plain-CE fast path; also used for ``auto`` and ``liger``); ``naive`` and ``torch`` call
        ``chunk_loss`` once on all tokens.
        """
        check_head_inputs(hidden, targets, self.weight, self.bias, self.ignore_index, self.check_finite)
        valid = targets != self.ignore_index
        h, y = hidden[valid], targets[valid].long()
        if self.backend in ("naive", "torch"):
            outputs = ("logprobs", "lse", "entropy") if with_entropy else ("logprobs", "lse")
            out = self(hidden, targets, outputs)
            ent = out.entropy[valid] if with_entropy else None
            return chunk_loss(0, int(h.shape[0]), out.logprobs[valid], out.lse[valid], ent)
        return ChunkedPointwiseLoss.apply(
            h, self.weight, self.bias, y, chunk_loss, with_entropy, self._chunk(h.shape[0]), self.accum_dtype
        )

    def forward_logits(self, hidden: Tensor) -> Tensor:
        """Full logits ``h Wᵀ + b`` for inference (materializes ``[..., V]``)."""
        return torch.nn.functional.linear(hidden, self.weight, self.bias)
