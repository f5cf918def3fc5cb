"""One optimizer step of the tiny LM over a fixed global batch of packed, variable-length micro-batches.

Run as a script (``python tests/aggregation/ddp_step.py MODE LOADER OUT [OBJECTIVE]``) so that Lightning's
DDP launcher can start the second process. ``LOADER``: ``full`` (one process, the global batch as one
micro-batch), ``global`` (2 DDP processes × 3 accumulated micro-batches, `GlobalStatsLoader`) or
``naive`` (the same split with a plain DataLoader: per-micro-batch normalization). Rank 0 saves the
parameter gradients seen in ``on_before_optimizer_step`` and the logged ``train/loss_total``.
``OBJECTIVE``: ``ce`` (cross-entropy, the default), ``ppo`` (`RL_OBJECTIVE`: ``ppo`` + ``kl_reference`` +
``entropy`` on micro-batches carrying the RL keys, `with_rl_inputs`) or ``rollout`` (one fit per rollout
correction of `ROLLOUT_CORRECTIONS` in the same processes, on micro-batches that also carry
``old_logprobs``, `with_old_logprobs`; fit ``i`` saves to ``OUT.i``); rank 0 then also saves the logged RL
telemetry ``train/base_loss/<name>``.
"""

from __future__ import annotations

import math
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader

from lit_losses import GlobalStatsLoader, TinyLM
from lit_losses.data.packing import Pieces, collate_rows, pack_rows
from lit_losses.distributed import exit_distributed_process

VOCAB, SEQ_LEN, RANKS, ACCUMULATE = 64, 16, 2, 3
RL_KEYS = ("sampling_logprobs", "advantages", "sample_weights", "ref_logprobs", "old_logprobs")
RL_OBJECTIVE = dict(
    base_loss="ppo",
    base_loss_args={"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    loss_agg_norm=float(SEQ_LEN),
    regularizers=[
        {"name": "kl_reference", "weight": 0.05},
        {"name": "entropy", "weight": 0.01, "args": {"mode": "bonus"}},
    ],
)


VLLM = {"vllm_importance_sampling_correction": True}
ROLLOUT_CORRECTIONS = [  # (base_loss_args beside PPO's bounds, whether the data has old_logprobs)
    (
        {**VLLM, "vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 1.1},
        True,
    ),
    ({"rollout_correction_preset": "icepop", "vllm_importance_sampling_clip_min": 0.9}, True),
    (
        {
            **VLLM,
            "vllm_importance_sampling_mode": "sequence_truncate",
            "vllm_importance_sampling_clip_max": 1.5,
        },
        True,
    ),
    (
        {**VLLM, "vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_max": 1.5},
        True,
    ),
    ({"rollout_is": "sequence", "rollout_is_threshold": 1.5, "off_policy_mask_threshold": 0.01}, True),
    ({"rollout_is": "token", "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.004}, True),
    ({"rollout_rs": "token_k1,seq_max_k2", "rollout_rs_threshold": "0.9_1.1,0.02"}, True),
    (
        {**VLLM, "vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_max": 1.5},
        False,
    ),
]
"""The corrections the DDP test checks, with and without ``old_logprobs`` in the data (thresholds that
truncate, mask or reject some of `with_old_logprobs`' tokens and sequences, not all)."""


def micro_batches(n: int = RANKS * ACCUMULATE, seed: int = 0) -> list[dict]:
    """``n`` packed micro-batches with different numbers of rows, documents and valid tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        n_docs = int(torch.randint(1, 7, (1,), generator=g))
        docs = [
            torch.randint(0, VOCAB, (int(torch.randint(2, 24, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n_docs)
        ]
        pieces = Pieces.from_documents(docs, SEQ_LEN)
        out.append(collate_rows(pieces, pack_rows(pieces.lengths.tolist(), SEQ_LEN, packing=True), pad_id=0))
    return out


def with_rl_inputs(batches: list[dict], seed: int = 1) -> list[dict]:
    """``batches`` with the RL keys: sampling log-probabilities near the untrained model's (about
    ``−log VOCAB``, so that PPO clips some tokens and not others), a per-sequence advantage and sample
    weight broadcast over each (row, segment), reference log-probabilities; 0.0 where there is no label."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in batches:
        valid = b["labels"] != -100
        shape = valid.shape
        seq = b["segment_ids"] + (SEQ_LEN + 1) * torch.arange(shape[0])[:, None]
        n_seq = int(seq.max()) + 1
        values = {
            "sampling_logprobs": -math.log(VOCAB) + 0.2 * torch.randn(shape, generator=g),
            "advantages": torch.randn(n_seq, generator=g)[seq],
            "sample_weights": (0.5 + torch.rand(n_seq, generator=g))[seq],
            "ref_logprobs": -math.log(VOCAB) + 0.2 * torch.randn(shape, generator=g),
        }
        out.append({**b, **{k: torch.where(valid, v, 0.0) for k, v in values.items()}})
    return out


def with_old_logprobs(batches: list[dict], seed: int = 2) -> list[dict]:
    """``batches`` with π_old: the engine's ``sampling_logprobs`` plus noise (0.1 per token and one offset
    per sequence), 0.0 where there is no label."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in batches:
        valid = b["labels"] != -100
        seq = b["segment_ids"] + (SEQ_LEN + 1) * torch.arange(valid.shape[0])[:, None]
        offset = 0.08 * torch.randn(int(seq.max()) + 1, generator=g)[seq]
        old = b["sampling_logprobs"] + offset + 0.1 * torch.randn(valid.shape, generator=g)
        out.append({**b, "old_logprobs": torch.where(valid, old, 0.0)})
    return out


def one_batch(batches: list[dict]) -> dict:
    """All rows of ``batches`` in one micro-batch, padded to the longest row."""
    width = max(b["labels"].shape[1] for b in batches)
    fill = {"input_ids": 0, "labels": -100, "segment_ids": 0, "position_ids": 0}
    fill |= {key: 0.0 for key in RL_KEYS if key in batches[0]}
    return {
        key: torch.cat(
            [torch.nn.functional.pad(b[key], (0, width - b[key].shape[1]), value=v) for b in batches]
        )
        for key, v in fill.items()
    }


class CaptureFirstStep(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 0 and trainer.is_global_zero:
            grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()}
            metrics = trainer.callback_metrics
            telemetry = {k: float(v) for k, v in metrics.items() if k.startswith("train/base_loss/")}
            torch.save(
                {"grads": grads, "loss": float(metrics["train/loss_total"]), "telemetry": telemetry},
                self.path,
            )


def run(mode: str, loader: str, path: str, objective: str = "ce") -> None:
    if objective == "rollout":
        batches = with_old_logprobs(with_rl_inputs(micro_batches()))
        for i, (args, old) in enumerate(ROLLOUT_CORRECTIONS):
            data = batches if old else [{k: v for k, v in b.items() if k != "old_logprobs"} for b in batches]
            options = {**RL_OBJECTIVE, "regularizers": RL_OBJECTIVE["regularizers"][:1]}
            options["base_loss_args"] = {**RL_OBJECTIVE["base_loss_args"], **args}
            fit_once(mode, loader, f"{path}.{i}", data, options)
        return
    batches = micro_batches() if objective == "ce" else with_rl_inputs(micro_batches())
    fit_once(mode, loader, path, batches, RL_OBJECTIVE if objective == "ppo" else {})


def fit_once(mode: str, loader: str, path: str, batches: list[dict], options: dict) -> None:
    """One optimizer step of a fresh model with ``options`` on ``batches`` (see the module docstring)."""
    full = loader == "full"
    data = [one_batch(batches)] if full else batches
    if loader == "naive":
        train = DataLoader(data, batch_size=None, shuffle=False)
    else:
        train = GlobalStatsLoader(data, batch_size=None, shuffle=False)
    L.seed_everything(0, verbose=False)
    model = TinyLM(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, loss_agg=mode, head_backend="chunked", **options
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1 if full else RANKS,
        strategy="auto" if full else "ddp",
        max_steps=1,
        accumulate_grad_batches=1 if full else ACCUMULATE,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[CaptureFirstStep(path)],
    )
    trainer.fit(model, train_dataloaders=train)


if __name__ == "__main__":
    run(*sys.argv[1:5])
    exit_distributed_process(0)  # ends the group and the process (a gloo rank can abort in the teardown)
