"""Worker of ``tests/parallel/test_pipeline.py``: the 2-stage pipeline of ``examples/pipeline_parallel.py``
(``ScheduleGPipe``, 4 micro-batches with different token counts) in float64, one step per case.

``python -m tests.parallel.pipeline_worker OUT`` under `tests.parallel.launch`; rank ``r`` saves
``OUT/rank{r}.pt``: ``{case: largest relative gradient error of its stage against the unsplit model}``.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.parallel.launch import REPO, init_from_env

EXAMPLE = runpy.run_path(str(REPO / "examples" / "pipeline_parallel.py"), run_name="pipeline_example")
CASES = {  # (loss_agg, packed sequences in the target, static shapes)
    "token-mean": ("token-mean", False, True),
    "seq-mean-token-mean/packed": ("seq-mean-token-mean", True, True),
    "token-mean/shape-inference": ("token-mean", False, False),
}

if __name__ == "__main__":
    rank, _ = init_from_env()
    torch.exp(torch.ones(8, dtype=torch.float64))  # settle the first vectorized op (see tests/conftest.py)
    errors = {case: EXAMPLE["pipeline_step"](rank, torch.float64, *args) for case, args in CASES.items()}
    torch.save(errors, Path(sys.argv[1]) / f"rank{rank}.pt")
    dist.destroy_process_group()
