"""WPO (``model.dpo.use_weighting``) through the module: one micro-batch's loss and gradients equal TRL's
``DPOTrainer._compute_loss`` with ``use_weighting`` (`tests.objectives.preference_reference.trl_dpo`, written
from its current source) in float64 from the full logits of the policy and of the reference, for ``sigmoid``
and ``ipo``; a real `Trainer` step over 2 accumulated micro-batches holding different numbers of pairs and
tokens equals the step over 1 micro-batch holding every pair, weights included (the weights are per pair,
the denominator stays the step's pairs). The DDP × accumulation and FSDP2 runs: `test_preference_ddp`
(preset ``wpo``); the CLI run: `test_preference_cli`."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lit_losses import GlobalStatsLoader
from lit_losses.data.preference_batches import collate_records
from tests.loss import preference_ddp_worker as worker
from tests.loss.test_preference import loss_and_grads, perturb, tiny
from tests.objectives import preference_reference as trl


def trl_inputs(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, completion_mask)`` of TRL's layout for a batch with next-token ``labels``: TRL's shifted
    completion mask at position ``t`` is ``completion_mask[t + 1]``, here ``labels[t] != -100``."""
    ids, labels = batch["input_ids"], batch["labels"]
    valid = labels != -100
    assert not bool(valid[:, -1].any())  # no label at the last position: the shift loses nothing
    assert torch.equal(labels[:, :-1][valid[:, :-1]], ids[:, 1:][valid[:, :-1]])  # next-token labels
    completion = torch.zeros_like(ids)
    completion[:, 1:] = valid[:, :-1].long()
    return ids, completion


def full_logits(model, batch: dict) -> torch.Tensor:
    """``[rows, T, V]`` materialized logits of ``model`` (float64), for the reference only."""
    weight, bias = model.output_projection()
    return F.linear(model.forward_hidden(batch), weight, bias).double()


def fit_half_of_the_pairs(model, batch: dict, steps: int = 10) -> None:
    """A few SGD steps of cross-entropy on the completions of the first half of the pairs: their labels
    become the policy's likeliest tokens, so their WPO weights exceed 1 (``p_y > Σ_v p_v²``) while the
    other pairs' stay far below (a clamp at 1 would change the loss)."""
    labels = batch["labels"].clone()
    pairs = labels.shape[0] // 2
    labels[pairs // 2 : pairs] = labels[pairs + pairs // 2 :] = -100
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(steps):
        optimizer.zero_grad()
        logits = full_logits(model, batch)
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
        optimizer.step()


def trl_pair_weights(logits: torch.Tensor, ids: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
    """TRL's ``chosen_weights * rejected_weights`` of each pair from the full logits."""
    shift_logits, mask = logits[:, :-1], completion[:, 1:]
    per_token = trl.selective_log_softmax(shift_logits, ids[:, 1:]) * mask
    return trl.wpo_pair_weights(
        {"shift_logits": shift_logits, "shift_completion_mask": mask, "per_token_logps": per_token}
    )


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_the_loss_and_gradients_are_trls_use_weighting_from_full_logits(loss_type):
    batch = worker.whole_batch()
    fields = {"loss_type": loss_type, "beta": 0.3, "use_weighting": True}
    model = tiny(dpo=fields)
    model.reference_model()  # the copy of the initial policy
    naive = tiny()
    perturb(naive, scale=0.5)
    fit_half_of_the_pairs(naive, batch)
    model.load_state_dict(naive.state_dict())
    loss, grads = loss_and_grads(model, batch)

    ids, completion = trl_inputs(batch)
    naive.zero_grad()
    logits = full_logits(naive, batch)
    with torch.no_grad():
        ref_logits = full_logits(tiny(), batch)
        weights = trl_pair_weights(logits, ids, completion)
    assert float(weights.max()) > 1.2 and float(weights.min()) < 0.1, weights  # no clamp at 1 in TRL
    trl_fields = {**fields, "loss_type": [loss_type]}
    expected, _ = trl.trl_dpo(logits, ref_logits, ids, completion, trl_fields)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    for name, p in naive.named_parameters():
        assert p.grad.abs().max() > 0, name
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)


def split_and_whole(pairs: tuple[int, ...] = (3, 1), seed: int = 3) -> tuple[list[dict], dict]:
    """Micro-batches of ``pairs`` pairs each (different token counts), and one holding all of them."""
    g = torch.Generator().manual_seed(seed)
    groups = [worker.pairs_of(n, g) for n in pairs]
    return [collate_records(group, pad_id=0) for group in groups], collate_records(sum(groups, []), pad_id=0)


def first_step(batches: list[dict], accumulate: int, root) -> dict:
    """The gradients and logged values of the first optimizer step of the ``wpo`` preset (float64)."""
    capture = worker.Capture()
    trainer = L.Trainer(
        accelerator="cpu",
        precision="64-true",
        max_steps=1,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[capture],
    )
    trainer.fit(worker.model_of("wpo"), GlobalStatsLoader(batches, batch_size=None, shuffle=False))
    return capture.result


def test_two_accumulated_micro_batches_give_the_step_of_one_holding_every_pair(tmp_path):
    split, whole = split_and_whole()
    tokens = [int((b["labels"] != -100).sum()) for b in split]
    assert [b["labels"].shape[0] // 2 for b in split] == [3, 1] and tokens[0] != 3 * tokens[1], tokens
    got = first_step(split, accumulate=2, root=tmp_path / "split")
    expected = first_step([whole], accumulate=1, root=tmp_path / "whole")
    for name, grad in expected["grads"].items():
        assert grad.dtype == torch.float64 and grad.abs().max() > 0, name
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-10, atol=1e-12, msg=name)
    assert {"train/loss_total", "train/rewards/margins"} <= set(expected["logged"])
    assert got["logged"] == pytest.approx(expected["logged"], rel=1e-10, abs=1e-12)

    # each micro-batch normalized by its own pairs (TRL's mean per micro-batch) is another value: the
    # comparison above sees the denominator
    model = worker.model_of("wpo").double()
    whole_loss = model.compute_loss(whole, "val").total  # "val": each batch's own counts
    per_micro_batch = sum(model.compute_loss(b, "val").total for b in split) / len(split)
    assert abs(float(per_micro_batch - whole_loss)) > 1e-3 * abs(float(whole_loss))
