"""The package's process-group helpers: one all-reduce for its small bookkeeping tensors (token counts,
logged metrics), whatever the process group's backend, and the end of a run's process group
(`end_process_group`, called by ``lit-losses`` before it exits).

NCCL reduces CUDA tensors only, while counts and metrics are built on the CPU: without this helper each
caller would move them to the GPU and back itself, and a caller that forgets fails under NCCL alone (gloo,
the CPU tests' backend, takes CPU tensors).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def all_reduce(
    tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, group: Any = None
) -> torch.Tensor:
    """``tensor`` reduced with ``op`` over the ranks of ``group`` (``None``: the whole world), on
    ``tensor``'s device; ``tensor`` itself when no process group is initialized (one process).

    Under NCCL the reduction runs on a copy on the current CUDA device. Use the returned tensor: ``tensor``
    is reduced in place only when it already lies where the backend reduces.

    Example:
        >>> all_reduce(torch.tensor([5, 2]), op=dist.ReduceOp.MAX)  # one process: unchanged
        tensor([5, 2])
    """
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    device = tensor.device
    if dist.get_backend(group) == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=op, group=group)
    return tensor.to(device)


def end_process_group() -> None:
    """Destroy the default process group of a distributed run at the end of the process, as torch asks:
    its background threads are then joined before the interpreter exits. Left to the interpreter's exit,
    a rank can abort there (``terminate called without an active exception``, exit status -6, seen with
    gloo) after a fit that went well. Not called when an error propagates (the other ranks may be
    waiting in a collective)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
