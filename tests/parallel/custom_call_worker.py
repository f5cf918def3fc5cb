"""Worker of ``tests/parallel/test_custom_call.py``: `forward_backward_custom` in a Lightning fit with manual
optimization, under DDP and then FSDP2 (``ModelParallelStrategy``), on 2 CPU processes (gloo), float64.

``python -m tests.parallel.custom_call_worker OUT`` under `tests.parallel.launch`: rank ``r`` trains on
micro-batch ``r`` of `batches` (different counts of tokens and sequences); rank 0 saves, per strategy, the
metrics of the call and the whole gradients it left in ``OUT``.
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader

from lit_losses import TinyLM
from lit_losses.distributed import exit_distributed_process
from tests.aggregation.ddp_step import micro_batches
from tests.parallel.model_parallel_worker import full

VOCAB = 64


def token_mean_nll(data, logprobs_list):
    """A scalar loss in the design's form: the mean ``−log p`` over the call's targets."""
    return -torch.cat(logprobs_list).mean(), {}


def sequence_mean_nll(data, logprobs_list):
    """The mean over the call's sequences (with a target) of their mean ``−log p``."""
    return -torch.stack([lp.mean() for lp in logprobs_list if len(lp)]).mean(), {}


#: A scalar term enters a step as its share of the mode's units (`lit_losses.regularizers.scalar`): exact
#: when it is the mean over those units.
LOSS_FNS = {"token-mean": token_mean_nll, "seq-mean-token-mean": sequence_mean_nll}


def token_nll(ctx):
    """A per-token term (the ``fn(ctx)`` form), aggregated with the model's ``loss_agg``."""
    return -ctx.logprobs


TERMS = [{"fn": token_nll, "weight": 0.5, "name": "tok"}]


def batches() -> list[dict]:
    return micro_batches(2, seed=3)


class ManualLM(TinyLM):
    """Manual optimization: one `forward_backward_custom` call per micro-batch; keeps what it returned."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.recorded: dict = {}

    def training_step(self, batch, batch_idx):
        loss_fn = LOSS_FNS[self.loss_agg]
        metrics = self.forward_backward_custom(batch, loss_fn=loss_fn, regularizers=TERMS)
        grads = {name: full(p.grad) for name, p in self.named_parameters()}
        self.recorded = {"metrics": metrics, "grads": grads}
        self.optimizers().step()  # ends the fit (max_steps=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def make_model(mode: str) -> ManualLM:
    """The same float64 model in every process and in the reference."""
    L.seed_everything(0, verbose=False)
    torch.set_default_dtype(torch.float64)
    try:
        return ManualLM(
            vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, loss_agg=mode, head_backend="chunked"
        )
    finally:
        torch.set_default_dtype(torch.float32)


def run(strategy, rank: int, mode: str) -> dict:
    model = make_model(mode)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model, DataLoader([batches()[rank]], batch_size=None))
    return model.recorded


def main(out: str) -> None:
    rank = int(os.environ["RANK"])  # Lightning joins the processes that the launcher started
    results = {}
    for mode in ("token-mean", "seq-mean-token-mean"):
        results[("ddp", mode)] = run("ddp", rank, mode)
        fsdp = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        results[("fsdp2", mode)] = run(fsdp, rank, mode)
    if rank == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_distributed_process(0)  # ends the group and the process (a gloo rank can abort in the teardown)
