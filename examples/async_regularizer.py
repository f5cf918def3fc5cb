"""An async regularizer that waits on an external service, with a timeout and an error policy.

The "service" (simulated with ``asyncio.sleep``) scores each micro-batch; while it is awaited, the
other terms and the rest of the step keep running (one persistent event loop serves every step).
The score arrives as per-token weights; the term is ``Σ_t s_t · (−log p_t)`` aggregated like the base
loss, so its gradient is exact. A slow or failing call is skipped (``on_error: skip``) and flagged in
the telemetry (``regularizers/<name>/error = 1``) instead of stopping training.

    python examples/async_regularizer.py
"""

from __future__ import annotations

import asyncio

import lightning as L
import torch

from lit_losses import GlobalStatsLoader, RegularizerSpec, TinyLM, register_regularizer


class FlakyScoringService:
    """Stands for a remote model or a judge: 20 ms per call, but call 3 is too slow and call 6 fails."""

    def __init__(self) -> None:
        self.calls = 0

    async def score(self, token_ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        await asyncio.sleep(0.5 if self.calls == 3 else 0.02)
        if self.calls == 6:
            raise ConnectionError("scoring service unavailable")
        return (token_ids % 7 == 0).float()  # 1 where the service wants the token discouraged


SERVICE = FlakyScoringService()


@register_regularizer("service_penalty", needs=("logprobs",))
async def service_penalty(ctx):
    """``r_t = s_t · (−log p_t)`` with scores ``s_t`` from the external service (awaited)."""
    scores = await SERVICE.score(ctx.batch["labels"].clamp_min(0))
    return -scores.to(ctx.logprobs.device) * ctx.logprobs, {"scored_tokens": float(scores[ctx.mask].sum())}


def synthetic_micro_batches(n: int = 8, vocab: int = 128, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (4, 16), generator=g)
        labels = torch.roll(ids, -1, dims=1)
        labels[:, -1] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


class Flags(L.Callback):
    def __init__(self) -> None:
        self.errors: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.errors.append(float(trainer.callback_metrics["regularizers/service/error"]))


def main(steps: int = 8) -> list[float]:
    L.seed_everything(0, verbose=False)
    model = TinyLM(
        vocab_size=128,
        d_model=32,
        n_layers=1,
        n_heads=2,
        regularizers=[
            RegularizerSpec(name="service", fn="service_penalty", weight=0.1, timeout_s=0.2, on_error="skip"),
            RegularizerSpec(name="z_loss", weight=1e-4),
        ],
    )
    flags = Flags()
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[flags],
    )
    trainer.fit(model, GlobalStatsLoader(synthetic_micro_batches(), batch_size=None))
    print(f"service calls: {SERVICE.calls}; steps with a skipped service term: {int(sum(flags.errors))}")
    print(model.telemetry["regularizers"]["service"])
    return flags.errors


if __name__ == "__main__":
    main()
