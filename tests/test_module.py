import itertools

import pytest
import torch

from lit_losses import TinyLM
from lit_losses.data.packing import MicroBatchDataset, Pieces
from lit_losses.optim import OptimizerConfig


def packed_batch(vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7, 2)]
    return MicroBatchDataset(Pieces.from_documents(docs, 16), 16, 64, True, pad_id=0)[0]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"])
def test_head_backends_give_the_same_loss_and_gradients(mode):
    batch = packed_batch()
    grads, losses = {}, {}
    for backend in ("naive", "chunked"):
        torch.manual_seed(0)
        model = TinyLM(vocab_size=64, d_model=16, n_layers=1, n_heads=2, head_backend=backend, loss_agg=mode)
        model = model.double()
        loss = model.compute_loss(batch, "train").total
        loss.backward()
        losses[backend] = loss.detach()
        grads[backend] = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.testing.assert_close(losses["chunked"], losses["naive"], rtol=1e-12, atol=1e-12)
    for name, g in grads["naive"].items():
        torch.testing.assert_close(grads["chunked"][name], g, rtol=1e-10, atol=1e-12)


def test_base_loss_equals_a_hand_computed_token_mean():
    batch = packed_batch()
    torch.manual_seed(0)
    model = TinyLM(vocab_size=64, d_model=16, n_layers=1, n_heads=2).double()
    logits = model.forward_logits(batch)
    ref = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100
    )
    torch.testing.assert_close(model.compute_loss(batch).total, ref)
    logprobs = model.predict_step(batch, 0)
    assert logprobs.shape == batch["labels"].shape
    torch.testing.assert_close(-logprobs.sum() / (batch["labels"] != -100).sum(), ref)


def test_missing_batch_key_names_the_key():
    model = TinyLM(vocab_size=64, d_model=16, n_layers=1, n_heads=2)
    with pytest.raises(KeyError, match="'labels'"):
        model.compute_loss({"input_ids": torch.zeros(1, 4, dtype=torch.long)})


def test_schedule_warmup_then_cosine_to_min_ratio():
    cfg = OptimizerConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    factors = [cfg.lr_factor(s, 110) for s in range(111)]
    assert factors[0] < factors[5] < factors[9] <= 1.0
    assert factors[10] == pytest.approx(1.0)
    assert factors[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(factors[10:]))
    with pytest.raises(ValueError, match=r"optimizer\.lr"):
        OptimizerConfig(lr=0)
