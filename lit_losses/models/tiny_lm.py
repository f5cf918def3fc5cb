"""A small causal transformer that reads top to bottom (nanoGPT style), and its `RegularizedLM`.

`TinyTransformer` is a plain `nn.Module` body: token embedding → ``n_layers`` pre-norm blocks
(RMSNorm, rotary attention through SDPA, SwiGLU MLP) → final RMSNorm. It returns hidden states; the
output projection is the (tied) embedding matrix, which `TinyLM` hands to the fused head.

Packing: when ``segment_ids`` are given, a token attends only to earlier tokens of its own segment
(block-diagonal causal mask), and ``position_ids`` (restarting at 0 per segment) drive the rotary
embedding, so a packed document computes exactly what it would compute alone.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_losses.module import RegularizedLM
from lit_losses.parallel import ParallelConfig
from lit_losses.validation import check_token_batch, check_transformer_shape


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x²) + eps) · g``."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(position_ids: Tensor, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``[B, 1, T, head_dim/2]`` for the given (per-token) positions."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim)
    angles = position_ids.float()[..., None] * inv_freq  # [B, T, head_dim/2]
    return angles.cos()[:, None], angles.sin()[:, None]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the pairs (x[..., :d/2], x[..., d/2:]) by the position angles."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)


def attention_mask(segment_ids: Tensor) -> Tensor:
    """Boolean ``[B, 1, T, T]`` mask: True where query ``i`` may attend key ``j`` (j ≤ i, same segment)."""
    T = segment_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segment_ids.device).tril()
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (causal & same_segment)[:, None]


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, rope_base: float) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.rope_base = rope_base
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, rope_base: float) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, rope_base)
        self.mlp_norm = RMSNorm(d_model)
        self.mlp = SwiGLU(d_model, d_ff)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class TinyTransformer(nn.Module):
    """Decoder-only transformer body returning hidden states ``[B, T, d_model]``.

    Args:
        vocab_size: number of token embeddings (also the output projection's rows, tied).
        d_model: width of the residual stream.
        n_layers: number of transformer blocks.
        n_heads: attention heads (``d_model`` must be divisible by it).
        d_ff: hidden width of the SwiGLU MLP; default ``8/3 · d_model`` rounded up to a multiple of 64.
        rope_base: rotary embedding base.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        d_ff: int | None = None,
        rope_base: float = 10000.0,
    ) -> None:
        super().__init__()
        check_transformer_shape(
            vocab_size, d_model, n_layers, n_heads=n_heads, d_ff=d_ff, rope_base=rope_base
        )
        d_ff = d_ff or 64 * math.ceil(8 * d_model / 3 / 64)
        self.head_dim = d_model // n_heads
        self.rope_base = rope_base
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, d_ff, rope_base=rope_base) for _ in range(n_layers)
        )
        self.norm = RMSNorm(d_model)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2 style scaled init of the residual projections
            if name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(
        self, input_ids: Tensor, segment_ids: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        cos, sin = rotary_tables(position_ids, self.head_dim, self.rope_base)
        mask = None if segment_ids is None else attention_mask(segment_ids)
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return self.norm(x)


class TinyLM(RegularizedLM):
    """The built-in causal LM as a `RegularizedLM`: a `TinyTransformer` and an output projection.

    The output projection is by default the (tied) input embedding, else an ``lm_head`` of its own.

    Under ``ModelParallelStrategy`` (`lit_losses.parallel.ParallelConfig`) FSDP2 shards each transformer
    block (`fsdp_modules`) and the root (embedding, final norm, ``lm_head``); tensor parallelism splits the
    ``lm_head`` along the vocabulary (`tensor_parallel_plan`: ``ColwiseParallel``, read by the
    vocabulary-parallel head) or, tied, the embedding (``RowwiseParallel`` over its rows); the blocks are
    replicated over the tensor-parallel group.

    Args:
        vocab_size: vocabulary size (linked to ``data.vocab_size`` by the CLI).
        d_model: width of the residual stream.
        n_layers: number of transformer blocks.
        n_heads: attention heads.
        d_ff: SwiGLU hidden width (default ``8/3 · d_model`` rounded up to 64).
        rope_base: rotary embedding base.
        tie_embeddings: the output projection is the input embedding (else an ``lm_head`` without bias).
        parallel: how ``configure_model`` shards the model under ``ModelParallelStrategy``.
        **kwargs: the `RegularizedLM` options (head, loss aggregation, optimizer, regularizers).

    Example:
        >>> import torch
        >>> model = TinyLM(vocab_size=100, d_model=32, n_layers=1, n_heads=2)
        >>> batch = {"input_ids": torch.randint(0, 100, (2, 10)), "labels": torch.randint(0, 100, (2, 10))}
        >>> model.forward_hidden(batch).shape, model.forward_logits(batch).shape
        (torch.Size([2, 10, 32]), torch.Size([2, 10, 100]))
        >>> untied = TinyLM(vocab_size=100, d_model=32, n_layers=1, n_heads=2, tie_embeddings=False)
        >>> untied.tensor_parallel_plan, untied.output_projection()[0] is untied.lm_head.weight
        ({'lm_head': 'colwise'}, True)
    """

    #: The FSDP2 units besides the root (`ParallelConfig.fsdp_modules`).
    fsdp_modules = ("body.blocks.*",)
    #: How the model is sharded is no part of its architecture: a resumed run may change it.
    resume_changeable_options = ("parallel",)

    def __init__(
        self,
        vocab_size: int = 32768,
        d_model: int = 256,
        n_layers: int = 4,
        n_heads: int = 4,
        d_ff: int | None = None,
        rope_base: float = 10000.0,
        tie_embeddings: bool = True,
        parallel: ParallelConfig | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()
        self.body = TinyTransformer(
            vocab_size, d_model, n_layers, n_heads=n_heads, d_ff=d_ff, rope_base=rope_base
        )
        self.lm_head = None if tie_embeddings else nn.Linear(d_model, vocab_size, bias=False)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, std=0.02)
        self.parallel_config = ParallelConfig.coerce(parallel)

    @property
    def tensor_parallel_plan(self) -> dict[str, str]:
        """The default tensor-parallel plan (`ParallelConfig.tensor_parallel_plan`): the output projection
        sharded along the vocabulary."""
        return {"body.embed": "embedding"} if self.lm_head is None else {"lm_head": "colwise"}

    def forward_hidden(self, batch: dict[str, Tensor]) -> Tensor:
        check_token_batch(batch, self.body.embed.num_embeddings)
        return self.body(batch["input_ids"], batch.get("segment_ids"), batch.get("position_ids"))

    def output_projection(self) -> tuple[Tensor, Tensor | None]:
        if self.lm_head is None:
            return self.body.embed.weight, None
        return self.lm_head.weight, None
