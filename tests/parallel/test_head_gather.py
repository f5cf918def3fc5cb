"""FSDP2 gathers the output projection that the fused head reads at most once per micro-batch, however many
token chunks or vocabulary blocks the head takes: 2 CPU processes (gloo) under Lightning's
``ModelParallelStrategy``, the all-gathers counted per FSDP unit and in all (`head_gather_worker`).
"""

from __future__ import annotations

import math

import pytest
import torch

from lit_losses.heads.vocab_blocks import vocab_block_size
from tests.parallel import head_gather_worker as worker
from tests.parallel.launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.ddp]

MICRO_BATCHES = worker.ACCUMULATE * worker.STEPS


@pytest.fixture(scope="module")
def gathers(tmp_path_factory):
    out = tmp_path_factory.mktemp("gathers")
    launch("tests.parallel.head_gather_worker", 2, str(out), timeout=300)
    return torch.load(out / "gathers.pt")


def test_the_head_takes_many_chunks_and_blocks_per_micro_batch():
    """What the counts below are measured against: each micro-batch is 8 token chunks for ``chunked`` and
    25 vocabulary blocks for ``blocked``."""
    tokens = worker.ROWS * worker.SEQ_LEN
    assert math.ceil(tokens / worker.CHUNK) == 8
    rows = vocab_block_size(tokens, worker.VOCAB, worker.D_MODEL, chunk_size=worker.CHUNK, device="cpu")
    assert math.ceil(worker.VOCAB / rows) == 25


@pytest.mark.parametrize("case", sorted(worker.CASES))
def test_the_projection_is_gathered_at_most_once_per_micro_batch(gathers, case):
    per_batch = gathers[case]["per_batch"]
    assert len(per_batch) == MICRO_BATCHES
    for counts in per_batch:
        # the root unit holds the projection: one gather, and no other gather of its size (no DTensor
        # full_tensor() per chunk outside FSDP's forward)
        assert counts["root"] <= 1 and counts["all"] == counts["root"], counts
        # the decoder blocks: gathered in forward and again in backward (reshard_after_forward), so the
        # per-unit counter does see every gather of its unit
        assert set(counts["units"].values()) == {2}, counts
    roots = [counts["root"] for counts in per_batch]
    if case.startswith("hf_"):
        # HFCausalLM's packing probe at train start runs in the root's forward (the root is not resharded
        # after forward), so the first micro-batch finds the projection gathered already
        assert roots == [0] + [1] * (MICRO_BATCHES - 1)
    else:
        assert roots == [1] * MICRO_BATCHES


def test_the_count_sees_a_dtensor_gather_of_the_projection(gathers):
    """The dispatch-mode count is not blind: 3 ``full_tensor()`` calls on the sharded projection are 3."""
    probe = gathers["dtensor_probe"]
    assert probe["counted"] == probe["full_tensor_calls"] == 3
