"""Pipeline parallelism: a `TinyLM` cut into 2 stages of ``torch.distributed.pipelining`` (``ScheduleGPipe``),
the fused-head loss at the last stage (`lit_losses.parallel.PipelineLoss`).

    python examples/pipeline_parallel.py                      # starts 2 CPU processes (gloo) itself
    torchrun --nproc-per-node 2 examples/pipeline_parallel.py

Stage 0 holds the token embedding and the first block, stage 1 the second block, the final norm and the
``lm_head``, which the loss reads: the logits are never materialized, on any stage. The schedule splits
the batch of 8 rows into 4 micro-batches holding different numbers of valid tokens; each micro-batch's
loss is normalized by the counts of the *whole* batch (``loss_fn.target`` counts it before the step), so
the step's gradients are those of the unsplit model on the whole batch. The script checks it against
plain PyTorch: materialized logits, ``cross_entropy``, one backward.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from lit_losses import TinyLM
from lit_losses.models.tiny_lm import rotary_tables
from lit_losses.parallel import PipelineLoss

VOCAB, ROWS, SEQ, MICROBATCHES = 64, 8, 12, 4


class Stage(nn.Module):
    """Blocks ``blocks`` of ``model``'s body, with the embedding first (stage 0), or the final norm and the
    ``lm_head`` last (the loss reads it: it must be the last stage's parameter, so that the schedule scales
    its gradient like the others')."""

    def __init__(self, model: TinyLM, blocks: slice, first: bool, last: bool) -> None:
        super().__init__()
        body = model.body
        self.embed = body.embed if first else None
        self.blocks = body.blocks[blocks]
        self.norm = body.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.head_dim, self.rope_base = body.head_dim, body.rope_base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) if self.embed is not None else x
        positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        cos, sin = rotary_tables(positions, self.head_dim, self.rope_base)
        for block in self.blocks:
            x = block(x, cos, sin, None)
        return self.norm(x) if self.norm is not None else x


def make_model(dtype: torch.dtype) -> TinyLM:
    torch.manual_seed(0)  # the same weights on both stages
    return TinyLM(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, tie_embeddings=False).to(dtype)


def make_batch() -> dict[str, torch.Tensor]:
    """8 rows, each with its own number of valid labels and 2 packed documents (segment ids 1, 2)."""
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    for row, valid in enumerate([12, 3, 9, 1, 7, 12, 2, 5]):
        labels[row, valid:] = -100
    segment_ids = (torch.arange(SEQ) >= torch.tensor([6, 2, 4, 1, 3, 8, 1, 2])[:, None]).long() + 1
    return {"input_ids": input_ids, "labels": labels, "segment_ids": segment_ids}


def pipeline_step(rank: int, dtype: torch.dtype, loss_agg: str, packed: bool, static: bool = True) -> float:
    """One step of the 2-stage pipeline on this rank; the largest relative gradient error of its stage's
    parameters against the unsplit model (plain PyTorch, whole batch). ``static``: give the stages their
    shapes (else the schedule infers them, calling the loss once on uninitialized activations)."""
    model, batch = make_model(dtype), make_batch()
    stage_module = (
        Stage(model, slice(0, 1), first=True, last=False)
        if rank == 0
        else Stage(model, slice(1, 2), first=False, last=True)
    )
    shapes = {}
    if static:  # one micro-batch's input and output (a received activation requires grad)
        hidden = torch.zeros(ROWS // MICROBATCHES, SEQ, 32, dtype=dtype, requires_grad=True)
        example_in = batch["input_ids"][: ROWS // MICROBATCHES] if rank == 0 else hidden
        shapes = {"input_args": example_in, "output_args": hidden}
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"), **shapes)
    loss_fn = PipelineLoss(lambda: (stage_module.lm_head.weight, None), MICROBATCHES, loss_agg=loss_agg)
    schedule = ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    if rank == 0:
        schedule.step(batch["input_ids"])
    else:
        losses: list[torch.Tensor] = []
        schedule.step(
            target=loss_fn.target(batch["labels"], batch["segment_ids"] if packed else None), losses=losses
        )
        print(f"step loss {float(loss_fn.step_loss(losses)):.6f}")

    # the reference: the unsplit model on the whole batch, logits materialized
    reference = make_model(dtype)
    logits = reference.lm_head(Stage(reference, slice(0, 2), first=True, last=True)(batch["input_ids"]))
    token_loss = F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
    valid = batch["labels"] != -100
    if loss_agg == "token-mean":
        loss = token_loss[valid].sum() / valid.sum()
    else:  # seq-mean-token-mean: a sequence is a row, or a (row, segment) pair when packed
        seq = torch.arange(ROWS)[:, None] * 3 + (batch["segment_ids"] if packed else 0)
        ids, seq = torch.unique(seq[valid], return_inverse=True)
        per_seq = torch.zeros(len(ids), dtype=dtype).index_add_(0, seq, token_loss[valid])
        loss = (per_seq / torch.bincount(seq).to(dtype)).mean()
    loss.backward()
    ref_stage = Stage(reference, slice(0, 1) if rank == 0 else slice(1, 2), rank == 0, rank == 1)
    ref_params = dict(ref_stage.named_parameters())
    errors = [
        (p.grad - ref_params[n].grad).abs().max() / ref_params[n].grad.abs().max()
        for n, p in stage_module.named_parameters()
    ]
    return float(max(errors))


def worker(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    error = pipeline_step(rank, torch.float32, "seq-mean-token-mean", packed=True)
    print(f"stage {rank}: largest relative gradient error vs the unsplit model {error:.1e}")
    assert error < 1e-4, error
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
        error = pipeline_step(dist.get_rank(), torch.float32, "seq-mean-token-mean", packed=True)
        print(f"stage {dist.get_rank()}: largest relative gradient error {error:.1e}")
        dist.destroy_process_group()
    else:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free_port = s.getsockname()[1]
        torch.multiprocessing.spawn(worker, args=(2, free_port), nprocs=2)
