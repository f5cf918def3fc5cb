"""The design's ``fn(data, logprobs_list)``: one datum per sequence, aligned log-probabilities, no flag."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch

from lit_losses.regularizers import Datum, RegularizerSpec
from tests.helpers import EmbeddingLM

TOL = dict(rtol=1e-12, atol=1e-12)


def model_with(*specs, **kwargs) -> EmbeddingLM:
    torch.manual_seed(0)
    return EmbeddingLM(regularizers=list(specs), head_backend="chunked", **kwargs).double()


def packed_batch() -> dict:
    """Row 0: segments 1, 2 (no target at all) and 3, then padding (0); row 1: segments 1, 2; row 2 has
    no target at all. A per-row field (``reward``) and a per-token one (``ref``)."""
    g = torch.Generator().manual_seed(4)
    segment_ids = torch.tensor([[1, 1, 1, 2, 2, 3, 3, 0, 0], [1, 1, 1, 1, 2, 2, 2, 2, 2], [1] * 9])
    labels = torch.randint(0, 11, (3, 9), generator=g)
    labels[segment_ids == 0] = -100
    labels[0, 3:5] = -100  # segment 2 of row 0: no target
    labels[1, 2] = -100
    labels[2] = -100
    return {
        "input_ids": torch.randint(0, 11, (3, 9), generator=g),
        "labels": labels,
        "segment_ids": segment_ids,
        "ref": torch.randn(3, 9, generator=g, dtype=torch.float64),
        "reward": torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64),
    }


def expected_sequences(model, batch) -> list[dict]:
    """Each (row, segment) in order of appearance, padding (segment 0 without target) left out."""
    logp, _, _, mask = model.reference_head(batch)
    out = []
    for row in range(batch["labels"].shape[0]):
        segments = batch["segment_ids"][row]
        for seg in dict.fromkeys(segments.tolist()):  # order of first appearance
            (pos,) = torch.nonzero(segments == seg, as_tuple=True)
            if seg == 0 and not mask[row, pos].any():
                continue
            valid = mask[row, pos]
            out.append(
                {
                    "row": row,
                    "segment": seg,
                    "input_ids": batch["input_ids"][row, pos],
                    "targets": batch["labels"][row, pos][valid],
                    "logprobs": logp[row, pos][valid],
                    "ref": batch["ref"][row, pos][valid],
                    "reward": batch["reward"][row],
                }
            )
    return out


def test_one_datum_per_sequence_aligned_and_empty_where_no_target():
    seen = {}

    def record(data, logprobs_list):  # the design's signature: no flag needed
        seen["data"], seen["logprobs"] = data, logprobs_list
        return torch.stack([lp.sum() for lp in logprobs_list]).sum(), {}

    model, batch = model_with(RegularizerSpec(name="record", fn=record)), packed_batch()
    model.compute_loss(batch)
    expected = expected_sequences(model, batch)
    data, logprobs_list = seen["data"], seen["logprobs"]
    assert len(data) == len(logprobs_list) == len(expected) == 6  # 3 + 2 + 1 (row 2: no target)
    for datum, lp, ref in zip(data, logprobs_list, expected, strict=True):
        assert isinstance(datum, Datum) and (datum.row, datum.segment) == (ref["row"], ref["segment"])
        assert torch.equal(datum.model_input, ref["input_ids"]) and torch.equal(
            datum["input_ids"], ref["input_ids"]
        )
        targets = datum.loss_fn_inputs["target_tokens"]
        assert torch.equal(targets, ref["targets"]) and lp.shape == targets.shape
        assert torch.equal(datum.loss_fn_inputs["weights"], torch.ones(len(targets)))
        torch.testing.assert_close(lp, ref["logprobs"], **TOL)
        torch.testing.assert_close(datum["ref"][datum.target_mask], ref["ref"])  # per-token field, sliced
        assert datum["reward"] == ref["reward"]  # per-row field
    assert [len(lp) for lp in logprobs_list] == [len(e["targets"]) for e in expected]
    assert len(logprobs_list[1]) == 0 and len(logprobs_list[5]) == 0


def test_zip_of_data_and_logprobs_gives_the_exact_per_sequence_loss_and_gradient():
    def weighted(data, logprobs_list):  # Σ_i reward_i · Σ_t ref_it · log p_it, by zipping
        terms = [d["reward"] * (d["ref"][d.target_mask] * lp).sum() for d, lp in zip(data, logprobs_list)]
        return torch.stack(terms).sum(), {"sequences": len(data)}

    model, batch = model_with(RegularizerSpec(name="w", fn=weighted, weight=0.3)), packed_batch()
    out = model.compute_loss(batch)
    expected_seqs = expected_sequences(model, batch)
    value = sum(e["reward"] * (e["ref"] * e["logprobs"]).sum() for e in expected_seqs)
    logp, _, _, mask = model.reference_head(batch)
    expected = -logp[mask].mean() + 0.3 * value
    torch.testing.assert_close(out.total, expected, **TOL)
    for g, r in zip(
        torch.autograd.grad(out.total, list(model.parameters())),
        torch.autograd.grad(expected, list(model.parameters())),
        strict=True,
    ):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    assert out.terms["w"]["custom"] == {"sequences": 6.0}


def test_rows_without_segments_are_the_sequences():
    labels = torch.tensor([[2, 3, -100], [-100, -100, -100], [8, -100, 10]])
    batch = {"input_ids": torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]]), "labels": labels}
    seen = []
    model = model_with(
        {"name": "n", "fn": lambda data, lps: (sum(lp.sum() for lp in lps), seen.append(lps) or {})}
    )
    model.compute_loss(batch)
    assert [lp.shape[0] for lp in seen[0]] == [2, 0, 2]  # 3 rows give 3 tensors, aligned


class SequenceCount:
    """A callable object in the design's form, with a constructor argument."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, data, logprobs_list):
        return self.scale * torch.cat(logprobs_list).square().mean(), {"n": len(data)}


def ctx_square(ctx, scale: float = 1.0):
    return scale * ctx.logprobs.square()


def seq_square(data, logprobs_list, scale: float = 1.0):
    return scale * torch.cat(logprobs_list).square().mean(), {}


async def async_seq_square(data, logprobs_list):
    await asyncio.sleep(0.01)
    return torch.cat(logprobs_list).square().mean(), {"awaited": 1}


@pytest.mark.parametrize(
    ("fn", "spec", "form"),
    [
        (ctx_square, {}, "context"),
        (seq_square, {}, "sequences"),
        (seq_square, {"args": {"scale": 1.0}}, "sequences"),
        (functools.partial(seq_square, scale=1.0), {}, "sequences"),
        (async_seq_square, {}, "sequences"),
        (SequenceCount(1.0), {}, "sequences"),
        (lambda ctx: ctx.logprobs.square(), {}, "context"),
        (lambda *args: args[0].logprobs.square(), {"legacy": False}, "context"),
        (lambda *args: (torch.cat(args[1]).square().mean(), {}), {"legacy": True}, "sequences"),
    ],
    ids=[
        "ctx",
        "design",
        "design+args",
        "partial",
        "async",
        "object",
        "lambda",
        "forced-ctx",
        "forced-design",
    ],
)
def test_the_form_is_told_by_the_signature_and_every_form_gives_the_same_value(fn, spec, form):
    model, batch = model_with({"name": "sq", "fn": fn, **spec}), packed_batch()
    assert model.regularizer_set.term("sq").form == form
    out = model.compute_loss(batch)
    logp, _, _, mask = model.reference_head(batch)
    torch.testing.assert_close(out.terms["sq"]["value"], logp[mask].square().mean(), **TOL)
    if fn is async_seq_square:
        assert out.terms["sq"]["custom"] == {"awaited": 1.0}  # the coroutine was awaited


def test_a_design_function_returning_a_matrix_is_named():
    from lit_losses.regularizers import RegularizerError

    model = model_with(
        {"name": "matrix", "fn": lambda data, lps: (torch.stack([lp.sum() for lp in lps]), {})}
    )
    with pytest.raises(RegularizerError, match=r"'matrix' returned shape \(6,\); a \(data, logprobs_list\)"):
        model.compute_loss(packed_batch())


def test_only_a_trailing_segment_0_without_target_is_padding():
    """Segment ids from ``position_ids`` start at 0: a leading document without target is a sequence."""
    seen = []

    def record(data, logprobs_list):
        seen.append([(d.row, d.segment, len(lp)) for d, lp in zip(data, logprobs_list)])
        return torch.cat(logprobs_list).sum(), {}

    batch = {
        "input_ids": torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]]),
        "labels": torch.tensor([[-100, -100, 4, 5, -100, -100], [2, 3, -100, 5, 6, -100]]),
        "segment_ids": torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1]]),
    }
    model_with(RegularizerSpec(name="record", fn=record)).compute_loss(batch)
    assert seen[0] == [(0, 0, 0), (0, 1, 2), (1, 0, 2), (1, 1, 2)]


def test_a_model_with_design_terms_pickles_and_gives_the_same_loss():
    import pickle

    model = model_with({"name": "sq", "fn": seq_square}, {"name": "a", "fn": async_seq_square})
    copy = pickle.loads(pickle.dumps(model))  # e.g. a spawned DDP process
    batch = packed_batch()
    assert torch.equal(copy.compute_loss(batch).total, model.compute_loss(batch).total)


def test_loss_fn_inputs_carry_the_rl_batch_fields_at_the_targets():
    """A batch of the RL format: ``loss_weights``, ``sampling_logprobs``, ``advantages`` appear in the
    design's ``loss_fn_inputs`` (as Tinker names them) at each sequence's targets."""
    seen = {}

    def record(data, logprobs_list):
        seen["data"] = data
        return torch.stack([lp.sum() for lp in logprobs_list]).sum(), {}

    model, batch = model_with(RegularizerSpec(name="record", fn=record)), packed_batch()
    g = torch.Generator().manual_seed(3)
    fields = {"loss_weights": "weights", "sampling_logprobs": "logprobs", "advantages": "advantages"}
    for key in fields:
        batch[key] = torch.rand(batch["labels"].shape, generator=g)
    model.compute_loss(batch)
    for datum in seen["data"]:
        mask = batch["labels"][datum.row, datum.positions] != -100
        for key, name in fields.items():
            assert torch.equal(datum.loss_fn_inputs[name], batch[key][datum.row, datum.positions][mask])
