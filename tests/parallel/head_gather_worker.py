"""Worker of ``tests/parallel/test_head_gather.py``: how often FSDP2 gathers the output projection that the
fused head reads, per micro-batch, on 2 CPU processes (gloo) under Lightning's ``ModelParallelStrategy``.

``python -m tests.parallel.head_gather_worker OUT`` under `tests.parallel.launch`; rank 0 saves
``OUT/gathers.pt``: for each case of `CASES` (a model, a head backend and loss, chunks or vocabulary blocks
far smaller than a micro-batch), the all-gathers of every micro-batch of 2 optimizer steps
(``accumulate_grad_batches=2``):

- by FSDP unit: each unit's parameter group gets a counting all-gather (`CountingAllGather`, installed with
  the public ``FSDPModule.set_custom_all_gather``), so a gather is attributed to the unit whose parameters
  it gathers — the root's group holds the output projection;
- in all: every all-gather the process issues that is large enough to hold the projection
  (`AllGatherCount`, a ``TorchDispatchMode`` that sees the c10d collectives FSDP calls and the functional
  ones a DTensor's ``full_tensor()`` calls; the small gathers of the logged metrics are left out).

The head's chunk and block counts of each case come along, so the test can tell "once per micro-batch"
from "once per chunk". `dtensor_probe` checks the dispatch-mode count itself: it sees the gathers of
``full_tensor()`` on the sharded projection between steps.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils._python_dispatch import TorchDispatchMode

from lit_losses import GlobalStatsLoader, HFCausalLM, TinyLM
from lit_losses.distributed import exit_distributed_process

VOCAB, D_MODEL, SEQ_LEN, ROWS, ACCUMULATE, STEPS, CHUNK = 2048, 32, 16, 2, 2, 2, 4
#: The all-gather operators of torch's dispatcher: c10d's (FSDP2's ``all_gather_single``, gloo) and the
#: functional collectives' (a DTensor's redistribution).
ALL_GATHER_OPS = ("c10d._allgather_base_", "c10d.allgather_", "_c10d_functional.all_gather_into_tensor")

REGULARIZERS = [{"name": "z_loss", "weight": 0.1}, {"name": "entropy", "weight": 0.05}]
LLAMA = dict(
    model_type="llama",
    vocab_size=VOCAB,
    hidden_size=D_MODEL,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
TINY = dict(vocab_size=VOCAB, d_model=D_MODEL, n_layers=2, n_heads=2)
#: name -> (model class, its options): the plain CE, the regularized (pointwise) path, the blocked
#: backend's per-token path over many vocabulary blocks, and a Hugging Face Llama with its regularizers.
CASES: dict[str, tuple[type, dict[str, Any]]] = {
    "tiny_chunked_ce": (TinyLM, {"head_backend": "chunked"}),
    "tiny_chunked_regularized": (TinyLM, {"head_backend": "chunked", "regularizers": REGULARIZERS}),
    "tiny_blocked_regularized": (TinyLM, {"head_backend": "blocked", "regularizers": REGULARIZERS}),
    "hf_llama_auto_regularized": (HFCausalLM, {"config": LLAMA, "regularizers": REGULARIZERS}),
}


class CountingAllGather:
    """FSDP2's all-gather of one parameter group (``dist.all_gather_into_tensor``), counted."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in nested lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    return []


class AllGatherCount(TorchDispatchMode):
    """The all-gather operators dispatched while active whose largest tensor (the gathered output) has at
    least ``min_numel`` elements."""

    def __init__(self, min_numel: int) -> None:
        super().__init__()
        self.min_numel = min_numel
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(name in str(func) for name in ALL_GATHER_OPS):
            largest = max(t.numel() for t in tensors_in((args, kwargs, out)))
            self.calls += largest >= self.min_numel
        return out


class GatherCounter(L.Callback):
    """The all-gathers of every micro-batch: by FSDP unit (the root: ``""``) and in all."""

    def __init__(self) -> None:
        self.units: dict[str, CountingAllGather] = {}
        self.per_batch: list[dict[str, int]] = []
        self.mode: AllGatherCount | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        from torch.distributed.fsdp import FSDPModule

        for name, module in pl_module.named_modules():
            if isinstance(module, FSDPModule):
                self.units[name] = CountingAllGather()
                module.set_custom_all_gather(self.units[name])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        for comm in self.units.values():
            comm.calls = 0
        self.mode = AllGatherCount(min_numel=pl_module.output_projection()[0].numel())
        self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.mode.__exit__(None, None, None)
        counts = {name: comm.calls for name, comm in self.units.items()}
        self.per_batch.append({"root": counts.pop(""), "units": counts, "all": self.mode.calls})


def micro_batches(n: int, seed: int = 0) -> list[dict]:
    """``n`` micro-batches of ``ROWS × SEQ_LEN`` random tokens with next-token labels."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ_LEN + 1), generator=g)
        out.append({"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()})
    return out


def run_case(name: str, root: Path) -> dict:
    cls, options = CASES[name]
    L.seed_everything(0, verbose=False)
    dims = {} if cls is HFCausalLM else TINY
    model = cls(**dims, **options, head_chunk_size=CHUNK, optimizer={"lr": 0.01, "warmup_steps": 0})
    counter = GatherCounter()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        accumulate_grad_batches=ACCUMULATE,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[counter],
    )
    data = micro_batches(2 * ACCUMULATE * STEPS)
    trainer.fit(model, GlobalStatsLoader(data, batch_size=None, shuffle=False))
    return {"per_batch": counter.per_batch, "tokens": ROWS * SEQ_LEN, "units": sorted(counter.units)}


def dtensor_probe() -> dict:
    """The dispatch-mode count of 3 ``full_tensor()`` calls on an FSDP2-sharded projection (3 gathers)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    linear = torch.nn.Linear(8, VOCAB, bias=False)
    fully_shard(linear, mesh=init_device_mesh("cpu", (2,)))
    with AllGatherCount(min_numel=linear.weight.numel()) as mode:
        for _ in range(3):
            linear.weight.full_tensor()
    return {"full_tensor_calls": 3, "counted": mode.calls}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    torch.exp(torch.ones(8, dtype=torch.float64))  # settle the first vectorized op (see tests/conftest.py)
    result = {name: run_case(name, out) for name in CASES}
    result["dtensor_probe"] = dtensor_probe()
    if dist.get_rank() == 0:
        torch.save(result, out / "gathers.pt")
    exit_distributed_process(0)  # ends the group and the process (a gloo rank can abort in the teardown)
