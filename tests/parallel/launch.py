"""Start ``N`` CPU processes of one worker module the way ``torchrun`` would, each under a timeout.

Every process gets ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``NODE_RANK``:
plain workers call ``init_process_group("gloo")`` from them, and Lightning sees processes created
externally (it launches nothing itself, so one worker process may run several ``Trainer.fit`` calls).
Output goes to files (no pipe can fill up and block a process); a process that fails or outlives the
timeout fails the test with the tail of every rank's output, and the others are killed: nothing hangs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


RUN_WORKER = (
    "import logging, os, runpy, sys\n"
    "from lit_losses.distributed import end_process_group\n"
    "sys.argv.pop(0)\n"
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
    "end_process_group()\n"
    "sys.stdout.flush(); sys.stderr.flush(); logging.shutdown()\n"
    "os._exit(0)\n"
)
"""``python -m module`` whose process, when the module's run ended normally, ends its process group (if
the worker has not) and exits without the interpreter's teardown: a gloo rank was seen to abort there (-6)
after its run had written everything. An error or ``sys.exit`` exits as usual. ``atexit`` handlers of a
worker that returned do not run (a subprocess coverage plugin would miss its data)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(module: str, world_size: int, *args: str, timeout: float = 240.0, nodes: int = 1) -> None:
    """Run ``python -m module *args`` as ranks ``0..world_size-1`` of one gloo job, ``world_size // nodes``
    per simulated node (``NODE_RANK``, ``LOCAL_RANK`` as ``torchrun`` on each node sets them); raise on
    failure."""
    port = str(free_port())
    per_node = world_size // nodes
    with tempfile.TemporaryDirectory() as logs:
        procs, files = [], []
        for rank in range(world_size):
            env = dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                RANK=str(rank),
                LOCAL_RANK=str(rank % per_node),
                NODE_RANK=str(rank // per_node),
                WORLD_SIZE=str(world_size),
                OMP_NUM_THREADS="1",
                PYTHONWARNINGS="ignore",
            )
            out = open(Path(logs) / f"rank{rank}.log", "w+")  # noqa: SIM115 (closed below)
            files.append(out)
            cmd = [sys.executable, "-c", RUN_WORKER, module, *args]
            procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        failed = None
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                failed = f"timed out after {timeout:.0f} s"
                break
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(2.0)  # let the other ranks report their own error first
                failed = "a rank failed"
                break
            time.sleep(0.05)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        codes = [p.returncode for p in procs]
        if failed is None and any(codes):
            failed = "a rank failed"
        tails = []
        for rank, out in enumerate(files):
            out.seek(0)
            tails.append(f"--- rank {rank} (exit {codes[rank]}) ---\n{out.read()[-4000:]}")
            out.close()
        if failed:
            raise AssertionError(f"{module} {' '.join(args)}: {failed}\n" + "\n".join(tails))


def init_from_env() -> tuple[int, int]:
    """``init_process_group("gloo")`` from the launcher's environment; ``(rank, world_size)``."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()
