"""The vocabulary-parallel head on CUDA, in fp32 and bf16, against the naive float64 head over the whole
weight: 2 gloo ranks sharing the GPU (uneven rows of ``W`` and of the bias), 1 NCCL rank (the GPU
collectives over a group of one) and the single-shard path in this process; skipped without CUDA.

Per-token ``logprobs``/``lse``/``entropy`` under random upstream gradients, the plain-CE fast path
(per-token and uniform weights) and a fused pointwise loss, with ignored positions: values, losses and the
gradients of ``hidden``, of the rank's rows of ``W`` and of the bias (the worker:
`tests.parallel.vocab_parallel_device_worker`). The head computes in fp32 for bf16 leaves
(`lit_losses.heads.precision`), so the reference is taken at the bf16-rounded inputs: values and losses keep
fp32's accuracy, and the gradients, returned in bf16, are off by their rounding (at most ``2⁻⁸`` of the
largest one).
"""

from __future__ import annotations

import pytest
import torch

from lit_losses.heads import VocabShard
from tests.parallel import vocab_parallel_device_worker as worker
from tests.parallel.launch import launch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: Largest ``max |got − ref| / max |ref|``: values and losses, gradients (by the leaves' dtype).
VALUE_TOL = 2e-5
GRAD_TOL = {"fp32": 2e-5, "bf16": 2e-2}


def check(result: dict, dtype: str) -> None:
    """Every error of one `worker.compare` result within its tolerance, the outputs in fp32, the gradients
    in the leaves' dtype and exactly 0 at ignored positions."""
    assert len(result["errors"]) == 3 + 4 * len(worker.CASES)
    for name, error in result["errors"].items():
        is_grad = name.split("/")[-1] in ("hidden", "weight", "bias")
        tol = GRAD_TOL[dtype] if is_grad else VALUE_TOL
        assert error < tol, (dtype, name, error)
        expected = worker.DTYPES[dtype] if is_grad else torch.float32
        assert result["dtypes"][name] == expected, (dtype, name, result["dtypes"][name])
    assert result["ignored_hidden_grad"] == 0.0


@pytest.fixture
def highest_fp32_matmuls():
    """fp32 matmuls without TF32 for the in-process test (the workers set it themselves)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


@pytest.mark.parametrize("dtype", sorted(worker.DTYPES))
def test_single_shard_on_cuda_matches_the_float64_naive_head(dtype, highest_fp32_matmuls):
    check(worker.compare("cuda", worker.DTYPES[dtype], VocabShard.full(worker.V)), dtype)


def test_two_gloo_ranks_sharing_the_gpu_match_the_float64_naive_head(tmp_path):
    launch("tests.parallel.vocab_parallel_device_worker", 2, str(tmp_path), "cuda", "gloo", timeout=180)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for dtype in worker.DTYPES:
        for result in ranks:
            check(result[dtype], dtype)
        for name, value in ranks[0][dtype]["values"].items():  # outputs and ∂/∂hidden: equal on every rank
            assert torch.equal(value, ranks[1][dtype]["values"][name]), (dtype, name)


def test_one_nccl_rank_matches_the_float64_naive_head(tmp_path):
    launch("tests.parallel.vocab_parallel_device_worker", 1, str(tmp_path), "cuda", "nccl", timeout=180)
    result = torch.load(tmp_path / "rank0.pt")
    for dtype in worker.DTYPES:
        check(result[dtype], dtype)
