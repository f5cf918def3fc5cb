"""One optimizer step of a preference loss in float64: on 2 gloo processes × 2 accumulated micro-batches
holding different numbers of pairs and tokens (``python -m tests.loss.preference_ddp_worker OUT``, started
by `tests.parallel.launch`), or on one process over one micro-batch holding every pair (`step`, in the
test's own process). Rank 0 saves, for each preset of `PRESETS`, the gradients before the optimizer step
and the logged values (``train/loss_total`` and TRL's metrics) to ``OUT/<name>.pt``; then the DPO and the
WPO step under FSDP2 (`fsdp_step`) to ``OUT/fsdp.pt`` and ``OUT/fsdp_wpo.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch

from lit_losses import GlobalStatsLoader, TinyLM
from lit_losses.data.preference_batches import RecordRows, collate_records
from lit_losses.distributed import exit_distributed_process

VOCAB, RANKS, ACCUMULATE = 61, 2, 2
PAIRS = (2, 1, 3, 1)  # pairs of each micro-batch: rank 0 gets micro-batches 0 and 2, rank 1 gets 1 and 3
PRESETS = {
    # the reference is a copy of the initial policy (computed on the fly); sft divides by the chosen
    # completions' tokens of the whole step, ipo by each completion's own length; TRL's token metrics
    "dpo": {
        "dpo": {"loss_type": ["sigmoid", "sft", "ipo"], "loss_weights": [1.0, 0.5, 0.1], "beta": 0.2},
        "token_metrics": True,
    },
    # SimPO's per-token means, and ORPO's NLL over the chosen sequences' prompt and completion tokens
    "simpo": {"cpo": {"loss_type": "simpo", "cpo_alpha": 0.0, "beta": 2.0, "simpo_gamma": 0.5}},
    "orpo": {"orpo": {"beta": 0.3}, "token_metrics": True},
    # WPO: each pair's loss times its weight from the policy's log Σ_v p_v² (no gradient), ipo's lengths
    "wpo": {
        "dpo": {
            "loss_type": ["sigmoid", "ipo"],
            "loss_weights": [1.0, 0.1],
            "beta": 0.2,
            "use_weighting": True,
        }
    },
}


def row(g: torch.Generator, prompt: list[int]) -> tuple[list[int], list[int]]:
    """A next-token row: ``prompt`` then a random completion of 1–6 tokens, labels on the completion."""
    completion = torch.randint(3, VOCAB, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
    ids = prompt + completion
    labels = [-100] * (len(prompt) - 1) + completion + [-100]
    return ids, labels


def pairs_of(n: int, g: torch.Generator) -> list[RecordRows]:
    out = []
    for i in range(n):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        out.append(RecordRows(f"pairs:{i}", row(g, prompt), row(g, prompt), ref={}))
    return out


def micro_batches(seed: int = 0) -> list[dict]:
    """The step's micro-batches (`PAIRS` pairs each), in the preference batch layout."""
    g = torch.Generator().manual_seed(seed)
    groups = [pairs_of(n, g) for n in PAIRS]
    return [collate_records(group, pad_id=0) for group in groups]


def whole_batch(seed: int = 0) -> dict:
    """Every pair of the step in one micro-batch."""
    g = torch.Generator().manual_seed(seed)
    return collate_records([p for n in PAIRS for p in pairs_of(n, g)], pad_id=0)


def model_of(name: str) -> TinyLM:
    L.seed_everything(0, verbose=False)
    return TinyLM(
        vocab_size=VOCAB,
        d_model=16,
        n_layers=1,
        n_heads=2,
        head_backend="chunked",
        optimizer={"warmup_steps": 0},
        **PRESETS[name],
    )


class Capture(L.Callback):
    def __init__(self) -> None:
        self.result: dict = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 0:
            grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()}
            logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
            self.result = {"grads": grads, "logged": logged}


def step(name: str, devices: int, batches: list[dict], root: str) -> dict:
    """The first step of preset ``name`` on ``devices`` processes (2: DDP, ``ACCUMULATE`` micro-batches)."""
    capture = Capture()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        precision="64-true",
        max_steps=1,
        accumulate_grad_batches=ACCUMULATE if devices > 1 else 1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[capture],
    )
    trainer.fit(model_of(name), GlobalStatsLoader(batches, batch_size=None, shuffle=False))
    return capture.result


def fsdp_model(name: str = "dpo") -> TinyLM:
    """The model of preset ``name`` in float64 by the default dtype (as FSDP2's tests build theirs)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return model_of(name)
    finally:
        torch.set_default_dtype(default)


def fsdp_step(devices: int, batches: list[dict], root: str, name: str = "dpo") -> dict:
    """The first step of preset ``name`` (DPO, or WPO: its head pass reads the output projection FSDP2
    gathered) under FSDP2 (``ModelParallelStrategy``, ``data_parallel_size=devices``; its frozen reference
    replicated), or on one process: the full gradients and the logged loss."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from tests.parallel import model_parallel_worker as parallel

    if devices == 1:
        return parallel.first_step(fsdp_model(name), batches, "auto", 1, 1, root)
    strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    return parallel.first_step(fsdp_model(name), batches, strategy, devices, ACCUMULATE, root)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    for preset in PRESETS:
        result = step(preset, RANKS, micro_batches(), root=str(out))
        if torch.distributed.get_rank() == 0:
            torch.save(result, out / f"{preset}.pt")
    for name, file in (("dpo", "fsdp.pt"), ("wpo", "fsdp_wpo.pt")):
        result = fsdp_step(RANKS, micro_batches(), root=str(out), name=name)
        if torch.distributed.get_rank() == 0:
            torch.save(result, out / file)
    exit_distributed_process(0)  # ends the group and the process (a gloo rank can abort in the teardown)
