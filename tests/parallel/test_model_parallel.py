"""`TinyLM` under Lightning's ``ModelParallelStrategy`` on 2 CPU processes (gloo, float64): FSDP2 with
gradient accumulation and packed variable-length micro-batches, sharded checkpoints, and tensor
parallelism through the vocabulary-parallel head, each against one process over the same global batch.

One launch of `tests.parallel.model_parallel_worker` per part (several fits in the same 2 processes).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.parallel import model_parallel_worker as worker
from tests.parallel.launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.ddp]


def run_part(part: str, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp(part)
    launch("tests.parallel.model_parallel_worker", 2, part, str(out), timeout=300)
    return torch.load(out / f"{part}.pt")


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    return run_part("fsdp", tmp_path_factory)


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    return run_part("tp", tmp_path_factory)


def max_relative_error(got: dict, reference: dict) -> float:
    assert set(got) == set(reference)
    return max(float((got[n] - r).abs().max() / r.abs().max()) for n, r in reference.items())


def naive_global_loss(mode: str, n: int) -> float:
    """The base loss of the initial model over the whole batch: materialized logits, plain PyTorch."""
    model, batch = worker.make_model(mode, False), worker.one_batch(worker.micro_batches(n))
    with torch.no_grad():
        logits = F.linear(model.forward_hidden(batch), model.output_projection()[0])
    token_loss = F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
    valid = batch["labels"] != -100
    if mode == "token-mean":
        return float(token_loss[valid].mean())
    rows = torch.arange(valid.shape[0])[:, None].expand_as(valid)
    keys = torch.unique(
        torch.stack([rows[valid], batch["segment_ids"][valid]], 1), dim=0, return_inverse=True
    )
    seq = keys[1]
    per_seq = torch.zeros(int(seq.max()) + 1, dtype=token_loss.dtype).index_add_(0, seq, token_loss[valid])
    return float((per_seq / torch.bincount(seq)).mean())


def test_the_micro_batches_hold_different_token_counts():
    counts = [int((b["labels"] != -100).sum()) for b in worker.micro_batches(4)]
    assert len(set(counts)) == len(counts), counts  # a per-micro-batch mean would be biased


@pytest.mark.parametrize("regularizers", [False, True], ids=["base", "regularized"])
@pytest.mark.parametrize("mode", worker.MODES)
def test_fsdp2_first_step_equals_one_process_over_the_global_batch(fsdp, mode, regularizers, tmp_path):
    got = fsdp[(mode, regularizers)]
    reference = worker.single_process_step(mode, regularizers, root=tmp_path)
    assert max_relative_error(got["grads"], reference["grads"]) < 1e-10
    assert max_relative_error(got["params"], reference["params"]) < 1e-10
    # the loader summed the counts of both ranks' windows; loss_scale = A × D cancels Lightning and FSDP
    assert got["num_tokens"] == reference["num_tokens"]
    assert got["loss_scale"] == worker.ACCUMULATE * 2
    # the logged train/loss_total (fp32) is the global loss
    assert got["loss"] == pytest.approx(reference["loss"], rel=1e-6)
    if not regularizers:
        assert got["loss"] == pytest.approx(naive_global_loss(mode, 4), rel=1e-6)


def test_fsdp2_sharded_checkpoint_resumes_with_the_same_losses(fsdp):
    runs = fsdp["resume"]
    assert fsdp["checkpoint_is_sharded"]  # a distributed checkpoint: one folder, a shard per rank
    assert sorted(runs["full"]) == [1, 2, 3, 4]
    assert runs["first"] == {s: runs["full"][s] for s in (1, 2)}
    assert sorted(runs["resumed"]) == [3, 4]
    for step, loss in runs["resumed"].items():
        assert loss == pytest.approx(runs["full"][step], rel=1e-7), step
    assert runs["full"][4] != pytest.approx(runs["full"][2], rel=1e-3)  # the steps differ at all


@pytest.mark.parametrize("case", sorted(worker.TP_CASES))
def test_tensor_parallel_first_step_equals_one_process(tp, case, tmp_path):
    """``data_parallel_size=1, tensor_parallel_size=2``: the output projection is a DTensor sharded along
    the vocabulary (``Shard(0)`` on the tensor-parallel dimension), read by the vocabulary-parallel head;
    clipped by norm across the meshes of its parameters as torch clips one process's."""
    tie, clip = worker.TP_CASES[case]
    got = tp[case]
    assert "Shard(dim=0)" in got["placements"]
    reference = worker.single_process_step("seq-mean-token-mean", True, tie=tie, root=tmp_path, clip=clip)
    assert max_relative_error(got["grads"], reference["grads"]) < 1e-10
    assert max_relative_error(got["params"], reference["params"]) < 1e-10
    if clip:
        assert max_relative_error(got["clipped"], reference["clipped"]) < 1e-10
        ratio = got["clipped"]["lm_head.weight"].norm() / got["grads"]["lm_head.weight"].norm()
        assert ratio < 0.5  # the clipping did scale the gradients
    # counts are summed over the data-parallel dimension only: both ranks read the same micro-batches
    assert got["num_tokens"] == reference["num_tokens"] and got["loss_scale"] == 4
    assert got["loss"] == pytest.approx(reference["loss"], rel=1e-6)


def test_fsdp2_mixed_precision_computes_in_bf16_close_to_the_float64_step(fsdp, tmp_path):
    """``param_dtype: bfloat16`` (``reduce_dtype: float32``): the body runs in bf16 (gradients off by bf16's
    ~0.4 % rounding, not by 1e-15), the head in fp32, gradients reduced and kept in the parameters' dtype."""
    got = fsdp["bf16_params"]
    reference = worker.single_process_step("token-mean", False, root=tmp_path)
    error = max_relative_error(got["grads"], reference["grads"])
    assert 1e-4 < error < 3e-2, error
    assert all(g.dtype == torch.float64 for g in got["grads"].values())
    assert got["loss"] == pytest.approx(reference["loss"], rel=1e-3)
