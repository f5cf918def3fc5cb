"""``matmul_precision="low_logits"``: the ``blocked`` backend writes each block of logits in bf16, rounded as
a bf16 ``nn.Linear`` writes them, and computes the softmax statistics and gradients of those rounded
logits in fp32 (against a float64 computation from the same rounded logits); ``auto`` takes ``blocked``.
On CPU ``low`` rounds a bf16 product too (without a bias: the same values), so the dtype test is what
tells the two apart here; tests/heads/test_cuda.py checks the values on CUDA."""

import pytest
import torch

from lit_losses.heads import FusedLMHead, entropy_kernels, vocab_blocks

IGNORE = -100


def problem(weight_dtype=torch.bfloat16, bias=False, n=96, d=32, v=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, d, generator=g) * 2).bfloat16().requires_grad_()
    weight = (torch.randn(v, d, generator=g) * 0.6).to(weight_dtype).requires_grad_()
    b = torch.randn(v, generator=g).to(weight_dtype).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::7] = IGNORE
    return hidden, weight, b, targets


def float64_of_rounded_logits(hidden, weight, bias, targets, task):
    """The loss and gradients, in float64, of the logits rounded to bf16 as a bf16 ``nn.Linear`` computes
    them (the rounding passed straight through: the gradient of the logits is that of the rounded ones)."""
    h, w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    b = None if bias is None else bias.detach().double().requires_grad_()
    rounded = torch.nn.functional.linear(
        hidden.detach(), weight.detach().bfloat16(), None if bias is None else bias.detach().bfloat16()
    ).double()
    exact = torch.nn.functional.linear(h, w, b)
    logp = torch.log_softmax(exact + (rounded - exact).detach(), -1)
    loss = task_loss(logp, targets, task)
    loss.backward()
    return loss.detach(), [t.grad for t in (h, w, b) if t is not None]


def task_loss(logp, targets, task):
    valid = targets != IGNORE
    picked = logp[valid].gather(1, targets[valid][:, None])[:, 0]
    if task == "weighted_ce":
        return -picked.sum() / valid.sum()
    entropy = -(logp.exp() * logp).sum(-1)[valid]
    return -picked.sum() + 0.3 * entropy.sum()


def head_loss(hidden, weight, bias, targets, task, precision="low_logits"):
    head = FusedLMHead(weight, bias, matmul_precision=precision, chunk_size=32)
    if task == "weighted_ce":
        return head.weighted_ce(hidden, targets, 1.0 / int((targets != IGNORE).sum()))
    out = head(hidden, targets, ("logprobs", "entropy"))
    return -out.logprobs.sum() + 0.3 * out.entropy.sum()


@pytest.fixture(params=["compiled", "eager"])
def kernels(request, monkeypatch):
    if request.param == "compiled":
        monkeypatch.setattr(entropy_kernels, "COMPILE_MIN_LOGITS", 1)
    else:
        monkeypatch.setenv(entropy_kernels.ENV_SWITCH, "0")
    return request.param


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=["bf16_true", "bf16_mixed"])
@pytest.mark.parametrize("task", ["weighted_ce", "per_token_entropy"])
def test_the_loss_and_gradients_are_those_of_the_bf16_rounded_logits(task, weight_dtype, bias, kernels):
    hidden, weight, b, targets = problem(weight_dtype, bias=bias)
    want_loss, want_grads = float64_of_rounded_logits(hidden, weight, b, targets, task)
    loss = head_loss(hidden, weight, b, targets, task)
    loss.backward()
    # the loss from fp32 statistics of the same rounded logits; unrounded logits differ by ~1e-4 here
    torch.testing.assert_close(loss.double(), want_loss, rtol=2e-6, atol=0)
    for got, want in zip([t.grad for t in (hidden, weight, b) if t is not None], want_grads, strict=True):
        scale = want.abs().max()
        # the logit gradient is rounded to bf16 for the matmuls (as with ``low``), the input gradients too
        torch.testing.assert_close(got.double() / scale, want / scale, rtol=0, atol=2e-2)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=["bf16_true", "bf16_mixed"])
@pytest.mark.parametrize("task", ["weighted_ce", "per_token_entropy"])
def test_auto_writes_every_block_of_logits_in_bf16(task, weight_dtype, kernels, monkeypatch):
    """``auto`` takes ``blocked`` (for an fp32 weight too, where the plain cross-entropy would otherwise
    take ``chunked``), and every block of logits, in forward and in backward, is a bf16 tensor; with
    ``low`` the same blocks are fp32."""
    written = []
    block_logits = vocab_blocks.block_logits

    def recorded(*args, **kwargs):
        z, w_blk = block_logits(*args, **kwargs)
        written.append(z.dtype)
        return z, w_blk

    monkeypatch.setattr(vocab_blocks, "block_logits", recorded)
    hidden, weight, _, targets = problem(weight_dtype)
    head_loss(hidden, weight, None, targets, task).backward()
    blocks = -(-1000 // vocab_blocks.vocab_block_size(82, 1000, 32, chunk_size=32, device="cpu"))
    assert written == [torch.bfloat16] * 2 * blocks
    written.clear()
    head_loss(hidden, weight, None, targets, task, precision="low").backward()
    if weight_dtype == torch.bfloat16 or task != "weighted_ce":  # else ``chunked``: no blocks
        assert set(written) == {torch.float32} and written


@pytest.mark.parametrize("task", ["weighted_ce", "per_token_entropy"])
def test_the_eager_passes_round_the_gradient_as_the_compiled_kernels(task, monkeypatch):
    """Without the compiled kernels (``LIT_LOSSES_COMPILE_KERNELS=0``) the bf16 logits' gradient is still
    computed in fp32 and rounded to bf16 once, over the logits: the bias gradient, a sum of that rounded
    gradient, is the compiled kernels' to fp32 rounding."""
    results = {}
    for name in ("compiled", "eager"):
        with monkeypatch.context() as m:
            if name == "compiled":
                m.setattr(entropy_kernels, "COMPILE_MIN_LOGITS", 1)
            else:
                m.setenv(entropy_kernels.ENV_SWITCH, "0")
            hidden, weight, b, targets = problem(bias=True)
            loss = head_loss(hidden, weight, b, targets, task)
            loss.backward()
            results[name] = [loss.detach(), hidden.grad, weight.grad, b.grad]
    # the passes' fp32 statistics differ in rounding (float64 sums in the kernels): a bf16 gradient entry
    # may round the other way, one bf16 step; the unrounded gradient's bias sum differed by 4e-3 of its max
    for got, want, atol in zip(results["eager"], results["compiled"], (1e-6, 5e-3, 5e-3, 5e-4), strict=True):
        scale = want.abs().max().double()
        torch.testing.assert_close(got.double() / scale, want.double() / scale, rtol=0, atol=atol)
