"""`HeadBackend`: what one output-head backend can do, the registry of backends, and the one function that
picks a backend for a head call (`select_backend`).

A backend offers up to three entry points, all on inputs already validated by `check_head_inputs`:

* ``per_token(head, hidden, targets, outputs) -> HeadOutput``: the per-token outputs it declares
  (``logprobs``, ``lse``, ``entropy``), shaped like ``targets``, 0 at ignored positions.
* ``fused_ce(head, h, y, w) -> loss``: the plain cross-entropy ``Σ_t w_t · (−log p_t[y_t])`` over the
  valid tokens ``h [n, D]``, ``y [n]`` with weights ``w`` (a float for every token, or ``[n]``), its
  gradients computed together with the value; ``fused_ce_weights`` says whether per-token weights are
  accepted (``"any"``) or only one float (``"uniform"``).
* ``fused_pointwise(head, h, y, chunk_loss, with_entropy) -> loss``: a sum of per-token functions of
  ``(logprobs, lse, entropy)`` over the valid tokens, gradients fused (see `FusedLMHead.pointwise_loss`).

``head`` is the calling `FusedLMHead` (its ``weight``, ``bias``, ``chunk_size``, ``ignore_index`` and
``accum_dtype``; see `HeadConfig`). A loss a backend has no fused path for is computed from its per-token
outputs by `FusedLMHead`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from lit_losses.errors import ConfigError
from lit_losses.heads.output import HEAD_OUTPUTS, HeadOutput
from lit_losses.registry import Registry, qualified_name


class HeadConfig(Protocol):
    """What a backend reads from its head (`FusedLMHead` satisfies it)."""

    weight: Tensor
    bias: Tensor | None
    chunk_size: int | None
    ignore_index: int
    accum_dtype: torch.dtype

    @property
    def vocab_size(self) -> int: ...


#: ``chunk_loss(start, end, logprobs, lse, entropy) -> loss`` of the valid tokens ``[start, end)``.
ChunkLoss = Callable[[int, int, Tensor, Tensor, "Tensor | None"], Tensor]
PerTokenFn = Callable[[HeadConfig, Tensor, Tensor, tuple[str, ...]], HeadOutput]
FusedCEFn = Callable[[HeadConfig, Tensor, Tensor, "Tensor | float"], Tensor]
FusedPointwiseFn = Callable[[HeadConfig, Tensor, Tensor, ChunkLoss, bool], Tensor]

#: What a head call asks of its backend.
Task = Literal["per_token", "weighted_ce", "pointwise"]

#: The backend of ``backend="auto"`` (and of the losses a backend without per-token outputs delegates).
DEFAULT_BACKEND = "chunked"

#: The backend of ``backend="auto"`` for a weight narrower than the compute dtype, and for per-token outputs
#: (`select_backend`).
LEAN_BACKEND = "blocked"


def _always_available() -> bool:
    return True


@dataclass(frozen=True)
class HeadBackend:
    """One output-head backend: what it computes and how.

    Args:
        name: the name a head's ``backend`` argument gives.
        outputs: the per-token outputs ``per_token`` gives (a subset of `HEAD_OUTPUTS`; empty when the
            backend has no per-token mode).
        per_token: ``(head, hidden [..., D], targets [...], outputs) -> HeadOutput``, the requested fields
            shaped like ``targets`` and 0 (no gradient) at ignored positions.
        fused_ce: ``(head, h [n, D], y [n], w) -> Σ_t w_t · (−log p_t[y_t])`` on valid tokens only, with
            ``w`` one float or ``[n]`` weights; ``None`` when the backend has no fused plain-CE path (the
            loss is then taken from ``per_token``'s ``logprobs``).
        fused_ce_weights: ``"any"`` (per-token or uniform weights) or ``"uniform"`` (one float only).
        fused_pointwise: ``(head, h [n, D], y [n], chunk_loss, with_entropy) -> loss`` on valid tokens, or
            ``None`` (the loss is then computed from ``per_token``'s outputs).
        cuda_only: the backend runs on CUDA tensors only.
        casts_weight_blocks: the backend is given the weight and bias in their own dtypes (not cast to the
            operand dtype as a whole) and casts each block it uses to the hidden states' dtype; it returns
            their gradients in their own dtypes.
        auto_ce: ``backend="auto"`` takes this backend's fused plain-CE path where it applies (weights
            accepted, CUDA input if ``cuda_only``, ``available()``).
        available: whether the backend can run in this environment (optional packages, torch version,
            CUDA).
        description: one line for listings.

    Raises:
        ValueError: for an inconsistent description (unknown outputs, outputs without ``per_token``, …).

    Example:
        >>> from lit_losses.heads.backend import HEAD_BACKENDS
        >>> HEAD_BACKENDS["chunked"].outputs
        ('logprobs', 'lse', 'entropy')
        >>> HEAD_BACKENDS["liger"].fused_ce_weights, HEAD_BACKENDS["liger"].cuda_only
        ('uniform', True)
    """

    name: str
    outputs: tuple[str, ...] = ()
    per_token: PerTokenFn | None = None
    fused_ce: FusedCEFn | None = None
    fused_ce_weights: Literal["any", "uniform"] = "any"
    fused_pointwise: FusedPointwiseFn | None = None
    cuda_only: bool = False
    casts_weight_blocks: bool = False
    auto_ce: bool = False
    available: Callable[[], bool] = _always_available
    description: str = ""

    def __post_init__(self) -> None:
        unknown = [o for o in self.outputs if o not in HEAD_OUTPUTS]
        if unknown:
            raise ValueError(
                f"head backend {self.name!r}: unknown outputs {unknown}; choose among {HEAD_OUTPUTS}"
            )
        if bool(self.outputs) != (self.per_token is not None):
            raise ValueError(f"head backend {self.name!r}: give per_token exactly when outputs are declared")
        if self.fused_ce_weights not in ("any", "uniform"):
            raise ValueError(f"head backend {self.name!r}: fused_ce_weights must be 'any' or 'uniform'")
        if self.auto_ce and self.fused_ce is None:
            raise ValueError(f"head backend {self.name!r}: auto_ce needs a fused_ce path")
        if self.per_token is None and self.fused_ce is None and self.fused_pointwise is None:
            raise ValueError(f"head backend {self.name!r} computes nothing")

    def gives(self, outputs: Sequence[str]) -> bool:
        """Whether ``per_token`` gives every one of ``outputs``."""
        return all(o in self.outputs for o in outputs)

    def takes_weights(self, uniform: bool) -> bool:
        """Whether ``fused_ce`` exists and accepts uniform (one float) or per-token weights."""
        return self.fused_ce is not None and (uniform or self.fused_ce_weights == "any")


def _adapt(name: str, obj: Any) -> HeadBackend:
    if not isinstance(obj, HeadBackend):
        raise TypeError(f"a head backend must be a HeadBackend, got {type(obj).__name__}")
    if obj.name != name:
        raise ValueError(f"head backend {obj.name!r} registered under another name {name!r}")
    return obj


def _identity(backend: HeadBackend) -> str:
    fns = (backend.per_token, backend.fused_ce, backend.fused_pointwise)
    return " ".join(qualified_name(f) for f in fns if f is not None)


#: Every backend a head can use, by name (``auto`` is a choice among them, not an entry).
HEAD_BACKENDS: Registry[HeadBackend] = Registry("head backend", adapt=_adapt, identity=_identity)
"""The head backends by name (`register_backend` adds one; `select_backend` chooses among them)."""


def register_backend(backend: HeadBackend) -> HeadBackend:
    """Register ``backend`` under its own name (`HEAD_BACKENDS`); returns it.

    Example:
        >>> from lit_losses.heads import HEAD_BACKENDS, HeadBackend, register_backend
        >>> from lit_losses.heads.naive import naive_per_token
        >>> with HEAD_BACKENDS.scoped():
        ...     mine = HeadBackend(name="my_naive", outputs=("logprobs",), per_token=naive_per_token)
        ...     _ = register_backend(mine)
        ...     "my_naive" in HEAD_BACKENDS
        True
    """
    return HEAD_BACKENDS.register(backend.name, backend)


class BackendOutputs(Mapping[str, tuple[str, ...]]):
    """Live view ``{backend name: per-token outputs it gives}`` of `HEAD_BACKENDS`.

    Example:
        >>> from lit_losses.heads import BACKEND_OUTPUTS
        >>> BACKEND_OUTPUTS["torch"], BACKEND_OUTPUTS["liger"]
        (('logprobs',), ())
    """

    def __getitem__(self, name: str) -> tuple[str, ...]:
        if name not in HEAD_BACKENDS:
            raise KeyError(name)
        return HEAD_BACKENDS[name].outputs

    def __iter__(self) -> Iterator[str]:
        return iter(HEAD_BACKENDS)

    def __len__(self) -> int:
        return len(HEAD_BACKENDS)

    def __repr__(self) -> str:
        return repr(dict(self))


@dataclass(frozen=True)
class Route:
    """How a head call is computed.

    Attributes:
        backend: the backend that computes it.
        fused: ``True``: with the backend's fused path for the task (``fused_ce``/``fused_pointwise``);
            ``False``: from its ``per_token`` outputs.
    """

    backend: HeadBackend
    fused: bool


def registered_backends() -> list[HeadBackend]:
    """Every registered `HeadBackend`, in name order."""
    return HEAD_BACKENDS.values()


def _backend(name: str, narrow_weight: bool = False) -> HeadBackend:
    if name != "auto":
        return HEAD_BACKENDS[name]
    return HEAD_BACKENDS[LEAN_BACKEND if narrow_weight else DEFAULT_BACKEND]


def _per_token_backend(name: str) -> HeadBackend:
    """``auto``'s backend for per-token outputs: `LEAN_BACKEND`, whatever the weight and the device."""
    return _backend(name, narrow_weight=True)


def _auto_ce_backend(uniform: bool, on_cuda: bool, narrow_weight: bool) -> HeadBackend:
    """``auto``'s backend for the plain CE: `LEAN_BACKEND` for a narrow weight; else the first ``auto_ce``
    backend whose fused path applies, else `DEFAULT_BACKEND`."""
    if narrow_weight:
        return HEAD_BACKENDS[LEAN_BACKEND]
    for b in registered_backends():
        if b.auto_ce and b.takes_weights(uniform) and (on_cuda or not b.cuda_only) and b.available():
            return b
    return _backend("auto", narrow_weight)


def _check_outputs(backend: HeadBackend, outputs: Sequence[str]) -> None:
    missing = [o for o in outputs if o not in backend.outputs]
    if missing:
        able = [b.name for b in registered_backends() if b.gives(outputs)]
        raise ValueError(
            f"head backend {backend.name!r} cannot give {missing}; use one of {able} "
            f"(e.g. backend={DEFAULT_BACKEND!r})"
        )


def select_backend(
    requested: str,
    task: Task,
    outputs: Sequence[str] = (),
    uniform: bool = True,
    on_cuda: bool = False,
    narrow_weight: bool = False,
    low_logits: bool = False,
) -> Route:
    """The backend (and path) that computes one head call — the only place a backend is chosen.

    ``auto`` means `DEFAULT_BACKEND` (``chunked``: token chunks, the plain cross-entropy's and the pointwise
    losses' gradients in forward with three matmuls, a ``V × D`` gradient accumulator in the compute dtype)
    unless the weight is narrower than the compute dtype (``narrow_weight``: a bf16/fp16 weight, fp32
    compute), where it means `LEAN_BACKEND` (``blocked``: vocabulary blocks, no ``V × D`` temporary, one
    more matmul for the plain cross-entropy). The accumulator of ``chunked`` is the weight's gradient itself
    when the weight is in the compute dtype, so its speed costs no memory there; beside a bf16 weight it is
    an fp32 copy twice the gradient's size, plus an fp32 copy of the weight on CPU (measured,
    `benchmarks/head_memory.py`). On CUDA the plain cross-entropy of a weight in the compute dtype goes to
    Liger's kernel first (where it is installed): for a bf16 weight ``blocked`` is both faster and leaner
    than Liger with the fp32 weight-gradient accumulation the head's precision asks for (one H200,
    8192 × 4096 × 128256: 55 ms and 1.7 GiB, where Liger accumulating in bf16 takes 54 ms and 1.1 GiB, and
    in fp32 about 1.5× that time and 3 GiB; one H100: 56 ms and 1.6 GiB, Liger 64 ms and 1.1 GiB;
    `benchmarks/RESULTS.md`).

    Per-token outputs (``per_token``) take four ``N·D·V`` matmuls on either backend, and ``auto`` takes
    ``blocked`` for them whatever the weight's dtype and the device: it writes each block of the weight's
    gradient once where ``chunked`` adds every token chunk into the whole ``V × D`` gradient. Measured for
    an fp32 weight, time / the three bare matmuls and memory: on CPU (2026-11-27, 2 x86_64 cores, torch
    2.13), at 2048 × 512 × 128256 on one thread, ``blocked`` 1.32 (``chunked`` 1.37) for ``logprobs``,
    1.27 (1.40) with the entropy, and at 1024 × 1024 × 65536, chunk 256, memory above the inputs /
    (weight gradient + two fp32 chunks) 0.80 (0.85) for ``logprobs`` + entropy; on one H100 (2026-11-27,
    torch 2.11, 8192 × 4096 × 128256) 1.39 (1.45) at a peak of 2626 MiB (3348) for ``logprobs``, 1.39
    (1.44) at 2577 MiB (3860) with the entropy (`benchmarks/fused_head.py`, `benchmarks/head_memory.py`).

    * ``per_token``: the requested backend (``auto``: as above), which must give ``outputs``.
    * ``weighted_ce``: for ``auto``, ``blocked`` for a narrow weight; otherwise the first registered
      backend marked ``auto_ce`` whose fused plain-CE path applies (weights, CUDA input if ``cuda_only``,
      ``available()``), else ``chunked``. The
      backend's ``fused_ce`` if it has one (a ``"uniform"``-only path refuses per-token weights), else
      its per-token ``logprobs``.
    * ``pointwise``: the backend's ``fused_pointwise`` if it has one; else its per-token ``outputs``
      (``logprobs``, ``lse``, and ``entropy`` if asked), which it must give; a backend without per-token
      outputs (``liger``) delegates to `DEFAULT_BACKEND`'s fused path. ``auto``: ``chunked``'s fused path
      (three matmuls) unless the weight is narrow.

    Args:
        requested: the head's ``backend`` (``auto`` or a registered name).
        task: ``"per_token"``, ``"weighted_ce"`` or ``"pointwise"``.
        outputs: the per-token outputs the call needs (``per_token``, ``pointwise``).
        uniform: ``weighted_ce``: one float weight for every token (not a tensor of weights).
        on_cuda: the hidden states are on a CUDA device (``weighted_ce``).
        narrow_weight: the weight's dtype is narrower than the compute dtype (``weighted_ce``,
            ``pointwise``; see above).
        low_logits: the head's ``matmul_precision`` is ``low_logits``: ``auto`` takes ``blocked``, the
            backend that writes bf16 logits, for every task (as for a narrow weight).

    Returns:
        The `Route`.

    Raises:
        ValueError: the backend cannot give ``outputs``, or takes uniform weights only and got a tensor.

    Example:
        >>> from lit_losses.heads.backend import select_backend
        >>> route = select_backend("auto", "weighted_ce", uniform=True, on_cuda=False)
        >>> route.backend.name, route.fused
        ('chunked', True)
        >>> select_backend("naive", "weighted_ce", uniform=False).fused
        False
        >>> select_backend("auto", "per_token", outputs=("logprobs",), narrow_weight=True).backend.name
        'blocked'
        >>> select_backend("auto", "per_token", outputs=("logprobs",), on_cuda=True).backend.name
        'blocked'
    """
    if task == "per_token":
        backend = _per_token_backend(requested)
        _check_outputs(backend, outputs)
        return Route(backend, fused=False)
    lean = narrow_weight or low_logits
    if task == "weighted_ce":
        backend = _auto_ce_backend(uniform, on_cuda, lean) if requested == "auto" else _backend(requested)
        if backend.fused_ce is None:
            return Route(backend, fused=False)
        if not backend.takes_weights(uniform):
            raise ValueError(
                f"backend {backend.name!r} supports one weight for every token only; use "
                f"backend={DEFAULT_BACKEND!r} for per-token weights"
            )
        return Route(backend, fused=True)
    if task == "pointwise":
        backend = _backend(requested, lean)
        if backend.fused_pointwise is not None:
            return Route(backend, fused=True)
        if backend.outputs:
            _check_outputs(backend, outputs)
            return Route(backend, fused=False)
        return Route(_backend(DEFAULT_BACKEND), fused=True)
    raise ValueError(f"unknown head task {task!r}")


def check_backend_runs(requested: str, device: torch.device | str, where: str = "head_backend") -> None:
    """Refuse, before any head call, a requested backend that cannot run on ``device`` (a CUDA-only one on
    CPU) or in this environment (``available()`` false: its optional package is missing, or this torch
    lacks it). ``auto`` always runs (it picks among the backends that can).

    Raises:
        ConfigError: naming ``where``, the backend and the device.

    Example:
        >>> check_backend_runs("chunked", "cpu")
        >>> check_backend_runs("liger", "cpu", "model.init_args.head_backend")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.init_args.head_backend='liger' runs on CUDA only and this ...
    """
    if requested == "auto":
        return
    backend = HEAD_BACKENDS[requested]
    device_type = torch.device(device).type
    instead = f"use 'auto' (it picks among the backends that run here) or {DEFAULT_BACKEND!r}"
    if backend.cuda_only and device_type != "cuda":
        raise ConfigError(
            f"{where}={requested!r} runs on CUDA only and this run's device is {device_type}; {instead}"
        )
    if not backend.available():
        raise ConfigError(
            f"{where}={requested!r} cannot run in this environment ({backend.description}); {instead}"
        )


def valid_tokens(hidden: Tensor, targets: Tensor, ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(valid, h, y)``: the mask ``targets != ignore_index`` and the valid rows ``h [n, D]``, ``y [n]``
    (int64), compacted in row-major order (`compact_valid`)."""
    valid = targets != ignore_index
    h, y = compact_valid(valid, hidden, targets)
    return valid, h, y.long()


def compact_valid(valid: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
    """Each tensor's entries at the ``valid`` positions (``[*valid.shape, ...]`` → ``[n, ...]``), in row-major
    order: gathered by one index shared by all where each tensor's positions are one view (one host
    synchronization on CUDA, and a backward that scatters without another); by the mask otherwise (a slice
    of a longer sequence, whose positions no view lines up)."""
    index = None
    compacted = []
    for tensor in tensors:
        try:
            flat = tensor.view(valid.numel(), *tensor.shape[valid.dim() :])
        except RuntimeError:
            compacted.append(tensor[valid])
            continue
        if index is None:
            index = valid.flatten().nonzero().squeeze(1)
        compacted.append(flat.index_select(0, index))
    return tuple(compacted)


def scatter_valid(values: Mapping[str, Tensor], outputs: Sequence[str], valid: Tensor) -> HeadOutput:
    """A `HeadOutput` with fields ``outputs`` shaped like ``valid``: ``values[name] [n]`` at the valid
    positions, 0 (no gradient) elsewhere."""
    out = HeadOutput()
    for name in outputs:
        value = values[name]
        setattr(out, name, value.new_zeros(valid.shape).masked_scatter(valid, value))
    return out


def weight_vector(token_weights: Tensor | float, n: int, device: torch.device) -> Tensor:
    """``token_weights`` as ``[n]`` per-token weights: a float becomes a float64 vector, a tensor (already
    the valid tokens' weights) is returned as is."""
    if isinstance(token_weights, Tensor):
        return token_weights
    return torch.full((n,), float(token_weights), dtype=torch.float64, device=device)
