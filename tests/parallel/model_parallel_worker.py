"""Worker of ``tests/parallel/test_model_parallel.py``: `TinyLM` under Lightning's ``ModelParallelStrategy``
on 2 CPU processes (gloo), float64, packed variable-length micro-batches.

``python -m tests.parallel.model_parallel_worker PART OUT`` under `tests.parallel.launch`; rank 0 saves
``OUT/PART.pt``:

- ``fsdp``: FSDP2 over ``data_parallel_size=2`` with ``accumulate_grad_batches=2``, for both ``token-mean``
  and ``seq-mean-token-mean``, with and without regularizers: the first step's gradients, the parameters
  after it and the logged ``train/loss_total``; the same with FSDP2 mixed precision (bf16 parameters);
  then 2 epochs in one go, 1 epoch + a sharded checkpoint, and the second epoch resumed from it: the
  logged loss of every step.
- ``tp``: ``data_parallel_size=1, tensor_parallel_size=2`` (FSDP2 over the 1-device data-parallel
  dimension), the ``lm_head`` column-parallel (untied, also with gradient clipping) or the tied embedding
  row-parallel: the same first step on the same micro-batches (every rank of the group reads all of them).

`single_process_step` computes the reference: one process, one micro-batch holding the global batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from lit_losses import GlobalStatsLoader, TinyLM
from lit_losses.distributed import exit_distributed_process
from tests.aggregation.ddp_step import micro_batches, one_batch

VOCAB, SEQ_LEN, ACCUMULATE = 64, 16, 2
MODES = ("token-mean", "seq-mean-token-mean")
REGULARIZERS = [{"name": "z_loss", "weight": 0.1}, {"name": "entropy", "weight": 0.05}]


class ClipRecordingLM(TinyLM):
    """`TinyLM` that keeps its gradients after Lightning's clipping (``configure_gradient_clipping``)."""

    clipped: dict

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if gradient_clip_val and not getattr(self, "clipped", None):
            self.clipped = {n: full(p.grad) for n, p in self.named_parameters()}


def make_model(mode: str, regularizers: bool, tie: bool = True, dtype=torch.float64, parallel=None) -> TinyLM:
    """The same (float64) model on every rank and in the reference (seeded)."""
    L.seed_everything(0, verbose=False)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return ClipRecordingLM(
            vocab_size=VOCAB,
            d_model=32,
            n_layers=2,
            n_heads=2,
            loss_agg=mode,
            head_backend="chunked",
            regularizers=REGULARIZERS if regularizers else None,
            tie_embeddings=tie,
            parallel=parallel,
            optimizer={"lr": 0.01, "warmup_steps": 0, "schedule": "constant"},
        )
    finally:
        torch.set_default_dtype(default)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a DTensor's ``full_tensor()``: a collective, every rank calls it)."""
    tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return tensor.detach().clone().cpu()


class Capture(L.Callback):
    """Gradients before the first optimizer step, parameters after it, the logged loss of every step."""

    def __init__(self) -> None:
        self.grads, self.params, self.losses, self.stats = {}, {}, {}, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.stats:  # the first step's global counts and loss scale, as the loader attached them
            stats = batch["global_stats"]
            self.stats = {"loss_scale": stats.loss_scale, "num_tokens": stats.get().num_tokens}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 0:
            self.grads = {n: full(p.grad) for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step not in self.losses and "train/loss_total" in trainer.callback_metrics:
            self.losses[step] = float(trainer.callback_metrics["train/loss_total"])
        if step == 1 and not self.params:
            self.params = {n: full(p) for n, p in pl_module.named_parameters()}


def fit(model, data, strategy, devices, accumulate, callbacks, root, ckpt_path=None, **kwargs):
    kwargs.setdefault("accelerator", "cpu")
    trainer = L.Trainer(
        devices=devices,
        strategy=strategy,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
        callbacks=callbacks,
        **kwargs,
    )
    trainer.fit(model, GlobalStatsLoader(data, batch_size=None, shuffle=False), ckpt_path=ckpt_path)
    return trainer


def first_step(model, data, strategy, devices, accumulate, root, clip=None) -> dict:
    capture = Capture()
    fit(model, data, strategy, devices, accumulate, [capture], root, max_steps=1, gradient_clip_val=clip)
    result = {"grads": capture.grads, "params": capture.params, "loss": capture.losses[1], **capture.stats}
    return {**result, "clipped": getattr(model, "clipped", None)}


def single_process_step(mode, regularizers, tie=True, n=4, root=None, clip=None) -> dict:
    """The reference: one process, one micro-batch holding all ``n`` micro-batches (run in pytest)."""
    model = make_model(mode, regularizers, tie)
    return first_step(model, [one_batch(micro_batches(n))], "auto", 1, 1, root, clip)


def part_fsdp(out: Path) -> dict:
    result = {}
    for mode in MODES:
        for regs in (False, True):
            strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
            model = make_model(mode, regs)
            result[(mode, regs)] = first_step(model, micro_batches(4), strategy, 2, ACCUMULATE, out)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    model = make_model("token-mean", False, parallel={"param_dtype": "bfloat16", "reduce_dtype": "float32"})
    result["bf16_params"] = first_step(model, micro_batches(4), strategy, 2, ACCUMULATE, out)
    data = micro_batches(8, seed=1)  # 2 optimizer steps per epoch
    runs = {}
    for name, epochs in (("full", 2), ("first", 1), ("resumed", 2)):
        capture = Capture()
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        ckpt = str(out / "checkpoint") if name == "resumed" else None
        trainer = fit(
            make_model("seq-mean-token-mean", True),
            data,
            strategy,
            2,
            ACCUMULATE,
            [capture],
            out,
            ckpt_path=ckpt,
            max_epochs=epochs,
        )
        if name == "first":
            trainer.save_checkpoint(out / "checkpoint")
        runs[name] = capture.losses
    result["resume"] = runs
    result["checkpoint_is_sharded"] = (out / "checkpoint").is_dir()
    return result


#: Tensor-parallel cases: (tied embeddings, gradient clipping by norm).
TP_CASES = {
    "colwise_lm_head": (False, None),
    "rowwise_tied_embedding": (True, None),
    "clipped": (False, 0.05),
}


def part_tp(out: Path) -> dict:
    result = {}
    for case, (tie, clip) in TP_CASES.items():
        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
        model = make_model("seq-mean-token-mean", True, tie=tie)
        result[case] = first_step(model, micro_batches(4), strategy, 2, 4, out, clip)
        projection = model.body.embed.weight if tie else model.lm_head.weight
        result[case]["placements"] = str(projection.placements)
    return result


if __name__ == "__main__":
    part, out = sys.argv[1], Path(sys.argv[2])
    torch.exp(torch.ones(8, dtype=torch.float64))  # settle the first vectorized op (see tests/conftest.py)
    result = {"fsdp": part_fsdp, "tp": part_tp}[part](out)
    if torch.distributed.get_rank() == 0:
        torch.save(result, out / f"{part}.pt")
    exit_distributed_process(0)  # ends the group and the process (a gloo rank can abort in the teardown)
