"""The FSDP2 path on one CUDA device in ``bf16-mixed`` (``ModelParallelStrategy`` with one process) against
Lightning's single-device strategy on the same data; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.launch import launch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_fsdp2_on_one_cuda_device_in_bf16_mixed_trains_as_the_single_device_strategy(tmp_path):
    launch("tests.parallel.cuda_worker", 1, str(tmp_path), timeout=300)
    runs = torch.load(tmp_path / "cuda.pt")
    single, fsdp = runs["single_device"], runs["fsdp2"]
    assert sorted(fsdp["losses"]) == [1, 2, 3]
    for step, loss in fsdp["losses"].items():
        assert loss == pytest.approx(single["losses"][step], rel=1e-3), step
    for name, grad in single["grads"].items():
        error = (fsdp["grads"][name].float() - grad.float()).abs().max() / grad.float().abs().max()
        assert error < 1e-2, (name, float(error))
