"""The entropy's element-wise passes over one chunk of log-probabilities, fused by `torch.compile`.

With ``log p`` of a chunk (``[n, V]``, the in-place ``log_softmax`` of its logits) and per-token upstream
gradients ``(g_ℓ, g_lse, g_H)``, the entropy and its part of the logit gradient are

    H_t = −Σ_v e^{log p_tv} · log p_tv,
    ∂/∂z_tv = e^{log p_tv} · (a_t + b_t · log p_tv),   a = g_lse − g_ℓ − g_H · H,  b = −g_H

(the target's ``g_ℓ δ_vy`` is added apart; `lit_losses.heads.chunked_ops` has the derivation). Eager
PyTorch cannot form either without ``p = exp(log p)`` in a second ``[n, V]`` work tensor: an ``exp``
pass, a row dot reading ``p`` and ``log p``, then two passes forming ``∂/∂z``. The two kernels compiled
here read ``log p`` once for ``H`` (a reduction, nothing written) and once for ``∂/∂z`` (written over
``log p``): on the fused pointwise path 3 instead of 9 reads and writes of ``[n, V]`` per chunk (on the
per-token path, forward and backward together, 3 instead of 11), and one work tensor instead of two, so
the chunk keeps its full size. ``H`` is accumulated in float64 (Inductor's fp32 sum over a long row
would lose two digits against the eager blocked row dot); ``∂/∂z`` has no reduction.

They are used on CPU (Inductor's C++ kernels) and on CUDA (its Triton kernels, one source for both) for
chunks of at least `COMPILE_MIN_LOGITS` logits (below that the passes are cheap and a compile is not worth
its seconds) and of at least 2 rows, when the caller is not itself being
compiled and compiling is not switched off. Inductor builds them at their first use in each process, a
few seconds, and again for inputs it has not seen the like of (another dtype, inference tensors). Its on-
disk graph cache is not used for them: a cached kernel keeps the tuning of the sizes it was first built
for, and one built for a few rows runs on one thread (measured: 30 instead of 15 ms on a ``[1024,
32768]`` chunk on 2 cores). If compiling fails (no C++ compiler, say), one warning is given and the eager
passes are used from then on, on that device type (CPU and CUDA apart; running out of memory is raised as
it is, not taken for a failed compile); if ``torch.compile``'s recompile limit is reached, the eager passes
take the inputs it refused, and so do calls made under a ``TorchDispatchMode`` (e.g. a FLOP counter),
where ``torch.compile`` would compile nothing (and skip the kernel for the rest of the process).
``LIT_LOSSES_COMPILE_KERNELS=0`` (or ``false``/``no``/``off``) keeps the eager passes always.

The ``blocked`` backend's passes over an ``[n, V_b]`` block of logits (`lit_losses.heads.vocab_blocks`)
are compiled the same way, under the same switches: `block_softmax_stats` reads the block once for its row
maximum ``m`` and ``s = Σ e^{z − m}`` (and ``t = Σ e^{z − m} (z − m)`` for the entropy, both accumulated
in float64), and `block_logit_grad_` writes ``e^{z − lse} ⊙ (a + b ⊙ (z − lse)) + g_ℓ e_y`` over it — or,
for bf16 operands, `block_logit_grad_bf16_` writes it once in the operand dtype, so that the cast for the
gradient matmuls is no pass of its own. Every compiled call is recorded as ``lit_losses::<kernel>`` in
`torch.profiler` traces (how the passes are counted).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

# torch has no public module for this query; TorchDispatchMode itself lives in the same module
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

#: Smallest chunk, in logits (``rows · V``), whose entropy passes use the compiled kernels (64 MiB of
#: fp32: 512 tokens at V = 32768). Measured on 2 cores at ``[1024, 32768]``: the eager passes add
#: 38 ms to the 37 ms of the cross-entropy's, the compiled ones 11 ms.
COMPILE_MIN_LOGITS = 2**24

#: Environment variable that keeps the eager passes when set to ``0``, ``false``, ``no`` or ``off``.
ENV_SWITCH = "LIT_LOSSES_COMPILE_KERNELS"

_OFF = {"0", "false", "no", "off"}
# torch.compile's own environment switch (TORCHDYNAMO_DISABLE in torch < 2.6); turning it off from code
# (``torch.compiler.set_stance("force_eager")``) is not seen here: the kernels then run uncompiled
_DYNAMO_OFF = ("TORCH_COMPILE_DISABLE", "TORCHDYNAMO_DISABLE")
# the error of a failed compile by device type ("cpu": C++, "cuda": Triton): eager passes there from then on
_failed: dict[str, str] = {}
_warned: set[str] = set()


def _entropy_kernel(log_p: Tensor) -> Tensor:
    """``−Σ_v e^{log p_v} log p_v`` per row, accumulated in float64."""
    return -(log_p.exp() * log_p).sum(1, dtype=torch.float64).to(log_p.dtype)


def _entropy_grad_kernel_(log_p: Tensor, a: Tensor, b: Tensor) -> None:
    """``log_p ← e^{log p} ⊙ (a + b ⊙ log p)``, ``a`` and ``b`` per row."""
    log_p.copy_(log_p.exp() * (a[:, None] + b[:, None] * log_p))


def _widened(z: Tensor) -> Tensor:
    """``z`` in float32 when it is bf16/fp16 (read as such inside a kernel: no pass of its own)."""
    return z.float() if z.dtype in (torch.bfloat16, torch.float16) else z


def _block_lse_kernel(z: Tensor) -> tuple[Tensor, Tensor]:
    """``(m, Σ_v e^{z_v − m})`` per row, ``m`` the row maximum, the sum accumulated in float64."""
    z = _widened(z)
    m = z.amax(1)
    return m, (z - m[:, None]).exp().sum(1, dtype=torch.float64).to(z.dtype)


def _block_entropy_stats_kernel(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(m, Σ_v e^{z_v − m}, Σ_v e^{z_v − m} (z_v − m))`` per row, sums accumulated in float64."""
    z = _widened(z)
    m = z.amax(1)
    x = z - m[:, None]
    e = x.exp()
    return m, e.sum(1, dtype=torch.float64).to(z.dtype), (e * x).sum(1, dtype=torch.float64).to(z.dtype)


def _block_grad(z: Tensor, lse: Tensor, a: Tensor, b: Tensor, cols: Tensor, g_target: Tensor) -> Tensor:
    """``e^{z − lse} ⊙ (a + b ⊙ (z − lse)) + g_target ⊙ e_cols`` (traced inside the two kernels below)."""
    log_p = z - lse[:, None]
    hit = torch.arange(z.shape[1], device=z.device)[None, :] == cols
    return log_p.exp() * (a[:, None] + b[:, None] * log_p) + torch.where(hit, g_target[:, None], 0.0)


def _block_grad_kernel_(z: Tensor, lse: Tensor, a: Tensor, b: Tensor, cols: Tensor, g_target: Tensor) -> None:
    """``z ← e^{z − lse} ⊙ (a + b ⊙ (z − lse)) + g_target ⊙ e_cols``; ``lse``, ``a``, ``b``, ``g_target``
    per row, ``cols [n, 1]`` the target's column."""
    z.copy_(_block_grad(z, lse, a, b=b, cols=cols, g_target=g_target))


def _block_grad_bf16_kernel_(
    out: Tensor, z: Tensor, lse: Tensor, a: Tensor, b: Tensor, cols: Tensor, g_target: Tensor
) -> None:
    """``out ← `_block_grad_kernel_`'s gradient`` in bf16 (the matmul operand), ``z`` untouched."""
    out.copy_(_block_grad(z, lse, a, b=b, cols=cols, g_target=g_target))


@functools.cache
def _compiled(kernel: Callable) -> Callable:
    # dynamic: one build for every chunk height; no FX graph cache: see the module docstring
    return torch.compile(kernel, dynamic=True, fullgraph=True, options={"fx_graph_cache": False})


def use_compiled_entropy_kernels(device: torch.device, rows: int, vocab_size: int) -> bool:
    """Whether the entropy passes of chunks of ``rows`` tokens take the compiled kernels.

    Args:
        device: where the logits are (CPU: C++ kernels; CUDA: Triton kernels; elsewhere eager).
        rows: tokens per chunk.
        vocab_size: ``V``.

    Returns:
        True when ``rows · V ≥ COMPILE_MIN_LOGITS`` on CPU or CUDA, the caller is not being compiled
        itself, the kernels have not failed to compile, and neither ``LIT_LOSSES_COMPILE_KERNELS`` nor torch's
        ``TORCH_COMPILE_DISABLE`` switches them off. The chunk size is chosen from this before a first
        compile is tried: on a machine where it fails, that first call runs the eager passes on a
        full-size chunk (two work tensors of its size), later calls on half-size ones.
    """
    return (
        not torch.compiler.is_compiling()
        and device.type in ("cpu", "cuda")
        and rows * vocab_size >= COMPILE_MIN_LOGITS
        and os.environ.get(ENV_SWITCH, "1").strip().lower() not in _OFF
        and not any(os.environ.get(name) == "1" for name in _DYNAMO_OFF)
        and device.type not in _failed
    )


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(f"lit_losses: {message}", RuntimeWarning, stacklevel=1)  # callers nest at any depth


def _at_recompile_limit(err: Exception) -> bool:
    """Whether ``err`` is dynamo refusing a new build at its recompile limit (``FailOnRecompileLimitHit``;
    an ``Unsupported`` naming ``cache_size_limit`` in torch < 2.6), which has no public exception type."""
    text = f"{type(err).__name__} {err}"
    return any(key in text for key in ("RecompileLimit", "recompile_limit", "cache_size_limit"))


def _run(kernel: Callable, *args: Tensor) -> Tensor | None:
    """``compiled(kernel)(*args)`` (an in-place kernel gives its first argument back), or ``None`` when
    the eager passes must do it: a chunk of one row (``torch.compile`` would specialize a second time on
    it), a call under a user's ``TorchDispatchMode``, a refusal at the recompile limit (for those inputs;
    dynamo logs each refusal), or a failed compile (warned once, eager from then on on that device type).
    Running out of memory is not a failed compile: it is raised as it is."""
    device = args[0].device.type
    if device in _failed or args[0].shape[0] < 2 or is_in_torch_dispatch_mode(include_infra_modes=False):
        return None  # under a user's dispatch mode dynamo would skip the kernel, for the whole process
    try:
        with torch.profiler.record_function(f"lit_losses::{kernel.__name__}"):
            out = _compiled(kernel)(*args)
    except (torch.cuda.OutOfMemoryError, MemoryError):
        raise  # the eager passes would need the same memory, or more
    except Exception as err:  # a failed compile: the eager passes compute the same maths
        error = f"{type(err).__name__}: {err}".splitlines()[0]
        if _at_recompile_limit(err):
            _warn_once(
                f"the entropy kernel {kernel.__name__} reached torch.compile's recompile limit; the eager "
                "passes take the inputs it refuses (same maths, slower)."
            )
            return None
        _failed[device] = error
        _warn_once(
            f"could not compile or run the entropy kernels on {device} ({error}); using the eager passes "
            f"there (same maths, slower). Set {ENV_SWITCH}=0 to skip the attempt."
        )
        return None
    return args[0] if out is None else out


def entropy(log_p: Tensor) -> Tensor | None:
    """The entropy of each row of a chunk of log-probabilities, in one read.

    Args:
        log_p: ``[n, V]`` log-probabilities (rows of a ``log_softmax``).

    Returns:
        ``H = −Σ_v e^{log p_v} log p_v`` per row (``[n]``, ``log_p``'s dtype), or ``None`` when the
        eager passes must compute it (`_run`).
    """
    return _run(_entropy_kernel, log_p)


def entropy_logit_grad_(log_p: Tensor, a: Tensor, b: Tensor) -> Tensor | None:
    """The entropy passes' logit gradient ``e^{log p} ⊙ (a + b ⊙ log p)``, in one read-write of ``log_p``.

    Args:
        log_p: ``[n, V]`` log-probabilities, overwritten by the result.
        a: ``[n]``, ``g_lse − g_ℓ − g_H · H`` per row.
        b: ``[n]``, ``−g_H`` per row.

    Returns:
        ``log_p``, or ``None`` (``log_p`` untouched) when the eager passes must compute it (`_run`).
    """
    return _run(_entropy_grad_kernel_, log_p, a, b)


def block_softmax_stats(z: Tensor, with_entropy: bool) -> tuple[Tensor, ...] | None:
    """One block's row statistics, in one read of ``z``.

    Args:
        z: ``[n, V_b]`` logits of a vocabulary block (not modified).
        with_entropy: also ``t = Σ_v e^{z_v − m} (z_v − m)``.

    Returns:
        ``(m, s)`` or ``(m, s, t)`` per row (``m`` the row maximum, ``s = Σ_v e^{z_v − m}``), in ``z``'s
        dtype or float32 for bf16/fp16 logits, or ``None`` when the eager passes must compute them
        (`_run`).
    """
    return _run(_block_entropy_stats_kernel if with_entropy else _block_lse_kernel, z)


def block_logit_grad_(
    z: Tensor, lse: Tensor, a: Tensor, b: Tensor, cols: Tensor, g_target: Tensor
) -> Tensor | None:
    """A block's logit gradient ``p ⊙ (a + b ⊙ log p) + g_target ⊙ e_cols`` with ``log p = z − lse``, in
    one read-write of ``z``.

    Args:
        z: ``[n, V_b]`` logits, overwritten by the result (computed in ``lse``'s dtype: bf16 logits take
            their gradient rounded to bf16).
        lse: ``[n]`` log-sum-exp of each row's full vocabulary.
        a: ``[n]``, ``g_lse − g_ℓ − g_H · H``.
        b: ``[n]``, ``−g_H`` (zeros without the entropy).
        cols: ``[n, 1]`` int64, each token's target column in the block (any column where it is not in it).
        g_target: ``[n]``, ``g_ℓ`` where the target is in the block, 0 elsewhere.

    Returns:
        ``z``, or ``None`` (``z`` untouched) when the eager passes must compute it (`_run`).
    """
    return _run(_block_grad_kernel_, z, lse, a, b, cols, g_target)


def block_logit_grad_bf16_(
    out: Tensor, z: Tensor, lse: Tensor, a: Tensor, b: Tensor, cols: Tensor, g_target: Tensor
) -> Tensor:
    """`block_logit_grad_`'s gradient written into ``out``, a bf16 tensor (the matmuls' operand dtype under
    bf16 operands), in one read of ``z`` and one narrower write: the cast to the operand dtype costs no pass
    of its own, and ``out`` may be rows of a larger gradient whose logits are made a few rows at a time.
    Where the compiled kernel does not run (`_run`), the same maths runs eagerly. (fp16 operands take the
    eager passes: the head never multiplies in fp16, whose range the ~1/N-scaled gradients underflow.)

    Args:
        out: ``[n, V_b]`` bf16, overwritten.
        z: ``[n, V_b]`` logits (not modified); the other arguments as in `block_logit_grad_`.

    Returns:
        ``out``.
    """
    if _run(_block_grad_bf16_kernel_, out, z, lse, a, b, cols, g_target) is None:
        _block_grad_bf16_kernel_(out, z, lse, a=a, b=b, cols=cols, g_target=g_target)
    return out
