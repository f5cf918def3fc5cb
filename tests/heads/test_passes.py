"""How many full passes over each block of logits the head makes outside its matmuls, counted in a
`torch.profiler` trace of one forward + backward.

A pass is one ATen operation that reads a whole ``[chunk, V]`` block (``chunked``) or ``[n, V_b]`` block
(``blocked``), or one call of a compiled element-wise kernel (traced as ``lit_losses::<kernel>``). Not
passes: the matmuls, views, and the gathers and scatters at the targets (``O(rows)`` elements). Counted on
CPU with the compiled kernels on every block (the default for blocks of at least
``entropy_kernels.COMPILE_MIN_LOGITS`` logits; the eager passes, used below that and on CUDA, make more:
`benchmarks/RESULTS.md`).
"""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lit_losses.heads import FusedLMHead, entropy_kernels
from lit_losses.heads.vocab_blocks import vocab_block_size

MATMULS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "matmul", "linear", "mv", "addmv", "addmv_", "dot"}
NOT_PASSES = MATMULS | {
    "slice",
    "t",
    "view",
    "as_strided",
    "select",
    "expand",
    "transpose",
    "unsqueeze",
    "squeeze",
    "alias",
    "detach",
    "empty",
    "empty_like",
    "empty_strided",
    "resize_",
    "reshape",
    "_reshape_alias",
    "index",
    "index_put_",
    "_index_put_impl_",
    "gather",
    "scatter_",
}
N, D, V, CHUNK = 64, 2, 4096, 16  # D small: the weight (V x D) is smaller than a block of logits


def _counted(event, counted: set[int]) -> bool:
    """Whether ``event`` is a pass: a kernel call, or an ATen op on a block, neither inside another pass
    nor inside a matmul."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.id in counted or parent.name.removeprefix("aten::") in MATMULS:
            return False
        parent = parent.cpu_parent
    if event.name.startswith("lit_losses::"):
        return True
    return event.name.startswith("aten::") and event.name.removeprefix("aten::") not in NOT_PASSES


def passes_per_block(step, block_elements: int, blocks: int) -> tuple[float, list[str]]:
    """Passes of one ``step()`` over blocks of ``block_elements`` logits, per block, and their names."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    counted: dict[int, str] = {}
    for event in prof.events():
        big = any(
            isinstance(shape, list) and torch.Size(shape).numel() >= block_elements
            for shape in event.input_shapes
        )
        if (big or event.name.startswith("lit_losses::")) and _counted(event, set(counted)):
            counted[event.id] = event.name
    return len(counted) / blocks, list(counted.values())


@pytest.mark.parametrize("backend", ["chunked", "blocked"])
@pytest.mark.parametrize(("path", "most"), [("ce", 3), ("per_token_entropy", 4)])
def test_passes_over_each_block_of_logits(backend, path, most, compiled_kernels, monkeypatch):
    """At most 3 passes per block for the plain cross-entropy and 4 for per-token log-probabilities +
    entropy, forward and backward together."""
    monkeypatch.setattr(entropy_kernels, "COMPILE_MIN_LOGITS", 1)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, D, generator=g).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.1).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    head = FusedLMHead(weight, backend=backend, chunk_size=CHUNK)

    def step():
        if path == "ce":
            head.weighted_ce(hidden, targets, 1 / N).backward()
        else:
            out = head(hidden, targets, ("logprobs", "entropy"))
            (out.logprobs + out.entropy).sum().backward()

    step()  # builds the kernels
    if backend == "chunked":
        block_elements, blocks = CHUNK * V, N // CHUNK
    else:
        width = vocab_block_size(N, V, D, CHUNK, "cpu")
        block_elements, blocks = N * width, -(-V // width)
    assert block_elements > V * D
    per_block, names = passes_per_block(step, block_elements, blocks)
    assert per_block <= most, names
    assert any(name.startswith("lit_losses::") for name in names) or path == "ce", names
