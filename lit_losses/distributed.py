"""The package's process-group helpers: one all-reduce for its small bookkeeping tensors (token counts,
logged metrics), whatever the process group's backend, and the end of a run's process group
(`end_process_group`, and `exit_distributed_process`, which ``lit-losses`` ends a distributed run's processes
with).

NCCL reduces CUDA tensors only, while counts and metrics are built on the CPU: without this helper each
caller would move them to the GPU and back itself, and a caller that forgets fails under NCCL alone (gloo,
the CPU tests' backend, takes CPU tensors).
"""

from __future__ import annotations

import logging
import os
import sys
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


def end_process_group() -> bool:
    """Destroy the default process group of a distributed run at the end of the process, as torch asks:
    its background threads are then joined before the interpreter exits. Left to the interpreter's exit,
    a rank can abort there (``terminate called without an active exception``, exit status -6, seen with
    gloo) after a fit that went well. Not called when an error propagates (the other ranks may be
    waiting in a collective). Returns whether there was a process group to end."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        return True
    return False


def exit_distributed_process(code: object = 0) -> None:
    """End the process of a distributed run with ``code`` (``SystemExit``'s: ``None`` is 0) once its
    process group is ended, skipping the interpreter's teardown: even with the group destroyed, a gloo
    rank was seen to abort there (exit status -6) after its run had finished and written everything. A
    process that ran no process group returns and exits as usual."""
    if not end_process_group():
        return
    if isinstance(code, str):
        print(code, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    logging.shutdown()
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)
