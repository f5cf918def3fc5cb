"""Worker of ``tests/parallel/test_cuda.py``: `TinyLM` on one CUDA device in ``bf16-mixed``, through the
FSDP2 path (``ModelParallelStrategy`` with one process) and through Lightning's single-device strategy,
on the same packed micro-batches (``accumulate_grad_batches=2``, 3 optimizer steps).

``python -m tests.parallel.cuda_worker OUT`` under `tests.parallel.launch` (one process); saves
``OUT/cuda.pt``: ``{strategy: {"grads": first step's gradients, "losses": logged loss per step}}``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from tests.parallel.model_parallel_worker import Capture, fit, make_model, micro_batches

if __name__ == "__main__":
    out = Path(sys.argv[1])
    results = {}
    for name in ("single_device", "fsdp2"):
        strategy = ModelParallelStrategy(1, 1) if name == "fsdp2" else "auto"
        model, capture = make_model("seq-mean-token-mean", True, dtype=torch.float32), Capture()
        # the same order for both: Lightning shuffles a train loader when it injects a distributed sampler
        fit(
            model,
            micro_batches(6),
            strategy,
            1,
            2,
            [capture],
            out,
            accelerator="cuda",
            precision="bf16-mixed",
            max_steps=3,
            use_distributed_sampler=False,
        )
        results[name] = {"grads": capture.grads, "losses": capture.losses}
    torch.save(results, out / "cuda.pt")
