"""`lit_losses.distributed`: `all_reduce` under NCCL (one CUDA process) takes the CPU tensors that counts and
metrics are built as, and gives them back on the CPU; gloo's path is tested through its callers on 2
processes (tests/parallel/test_custom_call.py, tests/aggregation/test_ddp_equivalence.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lit_losses.distributed import all_reduce, end_process_group


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nccl_reduces_cpu_tensors_and_gives_them_back_on_the_cpu(tmp_path):
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        counts = torch.tensor([[5, 2], [3, 1]])
        flags = torch.tensor([0.0, 1.0], dtype=torch.float64)
        summed = all_reduce(counts)
        worst = all_reduce(flags, op=dist.ReduceOp.MAX)
        on_gpu = all_reduce(counts.cuda())
    finally:
        dist.destroy_process_group()
    assert summed.device.type == "cpu" and torch.equal(summed, counts)  # one rank: the sum is the tensor
    assert worst.device.type == "cpu" and torch.equal(worst, flags)
    assert on_gpu.device.type == "cuda" and torch.equal(on_gpu.cpu(), counts)


def test_end_process_group_destroys_the_group_a_run_made_and_is_a_no_op_without_one(tmp_path):
    """`lit-losses` ends the process group of a distributed run before the interpreter exits."""
    end_process_group()  # nothing initialized: nothing to do
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    assert dist.is_initialized()
    end_process_group()
    assert not dist.is_initialized()


def test_a_distributed_process_exits_with_its_code_and_its_output_flushed(tmp_path):
    """`exit_distributed_process` ends the group and the process with the run's code, its output written;
    without a process group it returns (the process exits as usual)."""
    import subprocess
    import sys

    code = (
        "import torch.distributed as dist\n"
        "from lit_losses.distributed import exit_distributed_process\n"
        "exit_distributed_process(5)\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'store'}', rank=0, world_size=1)\n"
        "print('fit ended', end='')\n"
        "exit_distributed_process(3)\n"
        "print('never')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (3, "fit ended"), proc.stderr
