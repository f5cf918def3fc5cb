"""A regularizer computed by non-differentiable external code that supplies its own gradient.

The "external code" is a NumPy function (think: a scorer, a simulator, a checker in another
language) that returns a penalty *and* its gradient with respect to the per-token log-probabilities.
`custom_vjp` turns it into a PyTorch primitive, `register_regularizer` makes it a loss term usable from
Python or YAML (``{name: sequence_floor_penalty, weight: 0.1, agg: seq-mean-token-sum}``), and
`check_regularizer` verifies the hand-written gradient against finite differences before training.

    python examples/custom_gradient_regularizer.py
"""

from __future__ import annotations

import lightning as L
import numpy as np
import torch

from lit_losses import GlobalStatsLoader, RegularizerSpec, TinyLM, register_regularizer
from lit_losses.autograd import custom_vjp
from lit_losses.regularizers.testing import check_regularizer


def external_sequence_penalty(
    logprobs: np.ndarray, mask: np.ndarray, floor: float
) -> tuple[float, np.ndarray]:
    """Mean over rows of ``softplus(floor − mean log p)``, and its gradient (NumPy, no autograd).

    With ``m_s`` the mean log-probability of row ``s`` over its ``n_s`` valid tokens and ``S`` the rows
    with a valid token: ``P = (1/S) Σ_s softplus(floor − m_s)``, ``∂P/∂log p_t = −σ(floor − m_s) / (S n_s)``.
    """
    counts = mask.sum(axis=1)
    rows = counts > 0
    means = np.where(rows, (logprobs * mask).sum(axis=1) / np.maximum(counts, 1), 0.0)
    gap = floor - means
    penalty = np.logaddexp(0.0, gap)  # stable softplus
    num_rows = max(int(rows.sum()), 1)
    value = float(penalty[rows].sum() / num_rows)
    sigmoid = 0.5 * (1.0 + np.tanh(0.5 * gap))
    grad = -(sigmoid / np.maximum(counts, 1) / num_rows)[:, None] * mask * rows[:, None]
    return value, grad


def _forward(logprobs: torch.Tensor, mask: torch.Tensor, floor: float):
    value, grad = external_sequence_penalty(
        logprobs.detach().cpu().double().numpy(), mask.cpu().numpy().astype(np.float64), floor
    )
    grad_t = torch.from_numpy(grad).to(device=logprobs.device, dtype=logprobs.dtype)
    return torch.tensor(value, dtype=logprobs.dtype, device=logprobs.device), grad_t


def _backward(grad_logprobs: torch.Tensor, grad_output: torch.Tensor):
    return grad_output * grad_logprobs, None, None  # no gradient for the mask and the floor


sequence_floor_op = custom_vjp(_forward, _backward, name="sequence_floor_penalty")


@register_regularizer("sequence_floor_penalty", needs=("logprobs",))
def sequence_floor_penalty(ctx, floor: float = -4.0):
    """Keep each row's mean log-probability above ``floor`` (a scalar: the mean over rows)."""
    return sequence_floor_op(ctx.logprobs, ctx.mask, floor), {"floor": floor}


def synthetic_micro_batches(n: int = 8, vocab: int = 128, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        rows, width = (
            int(torch.randint(2, 5, (1,), generator=g)),
            int(torch.randint(8, 24, (1,), generator=g)),
        )
        ids = torch.randint(0, vocab, (rows, width), generator=g)
        labels = torch.roll(ids, -1, dims=1)
        labels[:, -1] = -100
        batches.append({"input_ids": ids, "labels": labels})
    return batches


def main(steps: int = 4) -> dict:
    # 1. the hand-written gradient agrees with finite differences (float64)
    g = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(3, 6, generator=g, dtype=torch.float64) * 8
    mask = torch.rand(3, 6, generator=g) > 0.3
    report = check_regularizer(
        RegularizerSpec(name="sequence_floor_penalty", agg="seq-mean-token-sum"), logprobs, mask
    )
    print(report.message)

    # 2. train with it: sequences are rows here, so the scalar is a mean over sequences
    L.seed_everything(0, verbose=False)
    model = TinyLM(
        vocab_size=128,
        d_model=32,
        n_layers=1,
        n_heads=2,
        regularizers=[
            RegularizerSpec(
                name="sequence_floor_penalty", weight=0.5, agg="seq-mean-token-sum", args={"floor": -4.0}
            ),
            RegularizerSpec(name="z_loss", weight=1e-4),
        ],
    )
    trainer = L.Trainer(
        max_steps=steps,
        accumulate_grad_batches=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, GlobalStatsLoader(synthetic_micro_batches(), batch_size=None))
    print({k: round(v, 5) if isinstance(v, float) else v for k, v in model.telemetry.items()})
    return model.telemetry


if __name__ == "__main__":
    main()
