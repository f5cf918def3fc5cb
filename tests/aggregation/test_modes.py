"""Property test: micro-batch losses combined as Lightning and DDP combine them equal the full-batch loss."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_losses.aggregation import (
    AGG_MODES,
    GlobalStats,
    MaskStats,
    aggregate,
    count_masks,
    reweight_mean,
    sequence_ids,
    sum_counts,
)
from lit_losses.heads import FusedLMHead
from lit_losses.loss.objective import Objective
from lit_losses.regularizers import RegularizerSet

V, F = 5, 3
NORM = 6.0  # the constant C of seq-mean-token-sum-norm


@st.composite
def micro_batch(draw, packing: bool) -> dict:
    """Rows of variable length; with packing, several segments per row; random masks."""
    B, T = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    seg = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        width = draw(st.integers(0, T))  # the rest of the row is padding (segment 0)
        n_seg = draw(st.integers(1, 3)) if packing else 1
        cuts = sorted(draw(st.lists(st.integers(1, max(width - 1, 1)), max_size=n_seg - 1)))
        seg[b, :width] = 1 + torch.bucketize(
            torch.arange(width), torch.tensor(cuts, dtype=torch.long), right=True
        )
    p_valid = draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
    valid = (torch.rand(B, T, generator=g) < p_valid) & (seg > 0)
    labels = torch.randint(0, V, (B, T), generator=g)
    return {
        "x": torch.randn(B, T, F, generator=g, dtype=torch.float64),
        "labels": torch.where(valid, labels, torch.full_like(labels, -100)),
        "segment_ids": seg if packing else None,
        "aux": torch.randn(B, T, generator=g, dtype=torch.float64),
    }


def pad_to(t: torch.Tensor, width: int, value) -> torch.Tensor:
    """``t`` ``[B, T]`` or ``[B, T, F]`` padded with ``value`` to ``width`` positions."""
    return torch.nn.functional.pad(
        t, (0, 0, 0, width - t.shape[1]) if t.dim() == 3 else (0, width - t.shape[1]), value=value
    )


def concat(batches: list[dict]) -> dict:
    """The global batch in one micro-batch: rows stacked, padded to the longest."""
    T = max(b["labels"].shape[1] for b in batches)

    def pad(t, value):
        return pad_to(t, T, value)

    out = {
        "x": torch.cat([pad(b["x"], 0.0) for b in batches]),
        "labels": torch.cat([pad(b["labels"], -100) for b in batches]),
        "aux": torch.cat([pad(b["aux"], 0.0) for b in batches]),
        "segment_ids": None,
    }
    if batches[0]["segment_ids"] is not None:
        out["segment_ids"] = torch.cat([pad(b["segment_ids"], 0) for b in batches])
    return out


def micro_loss(batch: dict, weight: torch.Tensor, mode: str, stats: GlobalStats) -> torch.Tensor:
    """Cross-entropy of a linear model, aggregated in ``mode``, plus a scalar term per the contract."""
    mask = batch["labels"] != -100
    logp = torch.log_softmax(batch["x"] @ weight, dim=-1)
    nll = -logp.gather(-1, batch["labels"].clamp_min(0)[..., None])[..., 0]
    loss = aggregate(nll, mask, mode, stats.get("labels"), batch["segment_ids"], norm=NORM)
    # a scalar term: the mean over this micro-batch's valid units, re-weighted by their global share
    local = stats.get_local("labels")
    units = local.num_tokens if mode.startswith("token") else local.num_sequences
    if units:
        per_token = batch["aux"] * nll
        if mode.startswith("token"):
            scalar = per_token[mask].sum() / units
        else:
            scalar = aggregate(
                per_token,
                mask,
                "seq-mean-token-mean" if mode.endswith("mean") else "seq-mean-token-sum",
                local,
                batch["segment_ids"],
            )
        loss = loss + 0.3 * reweight_mean(scalar, mode, local, stats.get("labels"))
    return loss


def split_step_loss(grid, accumulate, loss_of):
    """The step's loss as it is trained when ``grid[d][a]`` is micro-batch ``a`` of rank ``d``: counted as
    `GlobalStatsLoader` does (every micro-batch, summed over the window, all-reduced over ranks), each
    ``loss_of(batch, stats)`` × ``loss_scale``, ÷ A (Lightning's accumulation), ÷ D (DDP's average)."""
    ranks, window = len(grid), len(grid[0])
    local = [[count_masks(b) for b in row] for row in grid]
    totals = sum_counts(c for row in local for c in row)
    combined = 0.0
    for d, row in enumerate(grid):
        for a, batch in enumerate(row):
            stats = GlobalStats(
                totals, loss_scale=accumulate * ranks, local=local[d][a], position=a, window=window
            )
            combined = combined + loss_of(batch, stats) * stats.loss_scale / accumulate / ranks
    return combined


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), ranks=st.integers(1, 3), accumulate=st.integers(1, 3), packing=st.booleans())
@pytest.mark.parametrize("mode", AGG_MODES)
def test_split_into_ranks_and_micro_batches_equals_the_full_batch(data, ranks, accumulate, packing, mode):
    # the trailing window of an epoch may hold fewer micro-batches; Lightning still divides by A
    window = data.draw(st.integers(1, accumulate), label="window")
    grid = [[data.draw(micro_batch(packing)) for _ in range(window)] for _ in range(ranks)]
    weight = torch.randn(
        F, V, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True
    )

    combined = split_step_loss(grid, accumulate, lambda batch, stats: micro_loss(batch, weight, mode, stats))
    (grad,) = torch.autograd.grad(combined, weight)

    full = concat([b for row in grid for b in row])
    full_stats = GlobalStats(count_masks(full), local=count_masks(full))
    reference = micro_loss(full, weight, mode, full_stats)
    (ref_grad,) = torch.autograd.grad(reference, weight)

    assert torch.isfinite(reference)
    torch.testing.assert_close(combined, reference, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10)


def test_per_micro_batch_normalization_is_biased():
    """The naive approach (each micro-batch divides by its own count) differs when counts differ."""
    g = torch.Generator().manual_seed(1)
    a = {"labels": torch.tensor([[1, 2, 3, 4]]), "segment_ids": None}
    b = {"labels": torch.tensor([[1, -100, -100, -100]]), "segment_ids": None}
    losses = [torch.rand(1, 4, generator=g, dtype=torch.float64) for _ in range(2)]
    naive = (
        sum(
            aggregate(loss, m["labels"] != -100, "token-mean", count_masks(m)["labels"])
            for loss, m in zip(losses, (a, b))
        )
        / 2
    )
    total = sum_counts([count_masks(a), count_masks(b)])["labels"]
    exact = sum(aggregate(loss, m["labels"] != -100, "token-mean", total) for loss, m in zip(losses, (a, b)))
    reference = (losses[0].sum() + losses[1][0, 0]) / 5
    torch.testing.assert_close(exact, reference)
    assert abs(float(naive - reference)) > 1e-3


def test_bad_inputs_name_the_mode_the_key_and_the_shapes():
    mask = torch.ones(2, 3, dtype=torch.bool)
    stats = count_masks({"labels": torch.ones(2, 3, dtype=torch.long)})["labels"]
    with pytest.raises(ValueError, match="token-median"):
        aggregate(torch.zeros(2, 3), mask, "token-median", stats)
    with pytest.raises(ValueError, match=r"\(2, 4\).*\(2, 3\)"):
        aggregate(torch.zeros(2, 4), mask, "token-mean", stats)
    with pytest.raises(KeyError, match="loss_mask"):
        count_masks({"labels": torch.ones(2, 3, dtype=torch.long)}, ("labels", "loss_mask"))
    with pytest.raises(KeyError, match="ref_mask"):
        GlobalStats(count_masks({"labels": torch.ones(2, 3, dtype=torch.long)})).get("ref_mask")


# ---------------------------------------------------------------------------------------------------
# Every base loss (lit_losses.objectives) with kl_reference + entropy, every mode, per-sequence weights:
# the real `Objective` on D ranks × A micro-batches equals one call on the global batch.
# ---------------------------------------------------------------------------------------------------
BASE_LOSS_ARGS = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5},
    "dro": {"beta": 0.3},
    "sapo": {"temperature_pos": 0.8, "temperature_neg": 1.2},
}
RL_FLOAT_KEYS = ("sampling_logprobs", "advantages", "loss_weights", "sample_weights", "ref_logprobs")


@st.composite
def rl_micro_batch(draw, packing: bool, weighted: bool) -> dict:
    """`micro_batch` plus the RL contract's per-token keys (0.0 at ignored positions); the sample weights
    are one value per sequence (a (row, segment) pair), stored per token."""
    batch = draw(micro_batch(packing))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    mask = batch["labels"] != -100
    shape = mask.shape

    def per_token(values: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, values, torch.zeros_like(values))

    batch["sampling_logprobs"] = per_token(-torch.rand(shape, generator=g, dtype=torch.float64) * 3 - 0.05)
    batch["advantages"] = per_token(torch.randn(shape, generator=g, dtype=torch.float64))
    batch["ref_logprobs"] = per_token(-torch.rand(shape, generator=g, dtype=torch.float64) * 3 - 0.05)
    if weighted:
        batch["loss_weights"] = per_token(torch.rand(shape, generator=g, dtype=torch.float64) + 0.5)
        ids = sequence_ids(mask, batch["segment_ids"])
        per_sequence = torch.rand(int(ids.max()) + 1, generator=g, dtype=torch.float64) * 2
        batch["sample_weights"] = per_token(per_sequence[ids])
    return batch


def concat_rl(batches: list[dict]) -> dict:
    out = concat(batches)
    width = out["labels"].shape[1]
    for key in RL_FLOAT_KEYS:
        if key in batches[0]:
            rows = [torch.nn.functional.pad(b[key], (0, width - b[key].shape[1])) for b in batches]
            out[key] = torch.cat(rows)
    return out


def objective_loss(batch: dict, weight: torch.Tensor, objective: Objective, stats: GlobalStats):
    head = FusedLMHead(weight.T, backend="chunked", chunk_size=4)  # several chunks per micro-batch
    return objective(head, batch["x"], batch, stats, step=0, stage="train").total


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), ranks=st.integers(1, 3), accumulate=st.integers(1, 3), packing=st.booleans())
@pytest.mark.parametrize("base_loss", sorted(BASE_LOSS_ARGS))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_every_base_loss_split_into_ranks_and_micro_batches_equals_the_full_batch(
    data, ranks, accumulate, packing, mode, base_loss
):
    weighted = data.draw(st.booleans(), label="sample and loss weights")
    window = data.draw(st.integers(1, accumulate), label="window")
    grid = [[data.draw(rl_micro_batch(packing, weighted)) for _ in range(window)] for _ in range(ranks)]
    terms = [
        {"name": "kl_reference", "weight": 0.1},
        {"name": "entropy", "weight": 0.01, "args": {"mode": "bonus"}},
    ]
    objective = Objective(
        RegularizerSet(terms, default_agg=mode),
        mode,
        base_loss=base_loss,
        base_loss_args=BASE_LOSS_ARGS[base_loss],
        loss_agg_norm=NORM,
    )
    assert objective.path("train", objective.head_outputs_needed()) == "fused"
    weight = torch.randn(
        F, V, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True
    )

    combined = split_step_loss(grid, accumulate, lambda b, stats: objective_loss(b, weight, objective, stats))
    (grad,) = torch.autograd.grad(combined, weight)

    full = concat_rl([b for row in grid for b in row])
    reference = objective_loss(full, weight, objective, GlobalStats.local_only(full))
    (ref_grad,) = torch.autograd.grad(reference, weight)

    assert torch.isfinite(reference)
    torch.testing.assert_close(combined, reference, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------------
# TRL's loss types (`model.grpo` presets), sequence-level ratios (GSPO) and the bias-corrected KL
# included: D ranks × A micro-batches × packed rows give the global batch's value, gradients and exact
# telemetry (the base loss's metrics summed over the step's micro-batches).
# ---------------------------------------------------------------------------------------------------
GRPO_PRESETS = {
    "grpo": {"loss_type": "grpo", "epsilon_high": 0.28, "beta": 0.1},
    "gspo": {
        "loss_type": "grpo",
        "importance_sampling_level": "sequence",
        "beta": 0.1,
        "use_bias_correction_kl": True,
    },
    "bnpo": {"loss_type": "bnpo", "delta": 1.5},
    "dr_grpo": {"loss_type": "dr_grpo", "max_completion_length": NORM, "beta": 0.1},
    "dapo": {"loss_type": "dapo", "beta": 0.1, "use_bias_correction_kl": True},
    "cispo": {"loss_type": "cispo", "epsilon_high": 1.5, "importance_sampling_level": "sequence"},
    "sapo": {"loss_type": "sapo", "beta": 0.1},
    "luspo": {"loss_type": "luspo", "importance_sampling_level": "sequence", "beta": 0.1},
    "vespo": {"loss_type": "vespo", "beta": 0.1, "use_bias_correction_kl": True},
}


def split_step_metrics(grid, objective, weight) -> dict[str, float]:
    """The base loss's telemetry summed over the step's micro-batches, counted as `split_step_loss` does."""
    local = [[count_masks(b) for b in row] for row in grid]
    totals = sum_counts(c for row in local for c in row)
    summed: dict[str, float] = {}
    for d, row in enumerate(grid):
        for a, batch in enumerate(row):
            stats = GlobalStats(totals, local=local[d][a], position=a, window=len(row))
            head = FusedLMHead(weight.T, backend="chunked", chunk_size=4)
            out = objective(head, batch["x"], batch, stats, step=0, stage="train")
            for key, value in out.base_metrics.items():
                summed[key] = summed.get(key, 0.0) + float(value)
    return summed


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), ranks=st.integers(1, 3), accumulate=st.integers(1, 3), packing=st.booleans())
@pytest.mark.parametrize("preset", sorted(GRPO_PRESETS))
def test_every_grpo_preset_split_into_ranks_and_micro_batches_equals_the_full_batch(
    data, ranks, accumulate, packing, preset
):
    window = data.draw(st.integers(1, accumulate), label="window")
    grid = [[data.draw(rl_micro_batch(packing, weighted=False)) for _ in range(window)] for _ in range(ranks)]
    objective = Objective.from_options(grpo=GRPO_PRESETS[preset])
    weight = torch.randn(
        F, V, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True
    )

    combined = split_step_loss(grid, accumulate, lambda b, stats: objective_loss(b, weight, objective, stats))
    (grad,) = torch.autograd.grad(combined, weight)

    full = concat_rl([b for row in grid for b in row])
    full_stats = GlobalStats.local_only(full)
    head = FusedLMHead(weight.T, backend="chunked", chunk_size=4)
    out = objective(head, full["x"], full, full_stats, step=0, stage="train")
    (ref_grad,) = torch.autograd.grad(out.total, weight)

    assert torch.isfinite(out.total)
    torch.testing.assert_close(combined, out.total, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10)
    expected = {key: float(value) for key, value in out.base_metrics.items()}
    assert split_step_metrics(grid, objective, weight) == pytest.approx(expected, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_per_row_sample_weights_are_each_rows_weight_at_every_position(mode):
    """ROLL's ``weights`` shape ``[B]`` (one sequence per row) equals the same weights per position."""
    torch.manual_seed(0)
    loss = torch.randn(3, 5, dtype=torch.float64)
    mask = torch.rand(3, 5) > 0.3
    weights = torch.tensor([0.5, 2.0, 1.5], dtype=torch.float64)
    stats = MaskStats(int(mask.sum()), 3)
    per_position = weights[:, None] * torch.ones(3, 5, dtype=torch.float64)
    expected = aggregate(loss, mask, mode, stats, sample_weights=per_position)
    assert torch.equal(aggregate(loss, mask, mode, stats, sample_weights=weights), expected)


def test_per_row_sample_weights_are_refused_for_packed_rows():
    mask = torch.ones(2, 4, dtype=torch.bool)
    segments = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0]])
    with pytest.raises(
        ValueError, match=r"sample_weights of shape \[2\] give one weight per row, but the rows"
    ):
        aggregate(
            torch.ones(2, 4),
            mask,
            "token-mean",
            MaskStats(8, 3),
            segment_ids=segments,
            sample_weights=torch.ones(2),
        )
    with pytest.raises(ValueError, match=r"sample_weights shape \(3,\) differs from the mask shape \(2, 4\)"):
        aggregate(torch.ones(2, 4), mask, "token-mean", MaskStats(8, 2), sample_weights=torch.ones(3))
