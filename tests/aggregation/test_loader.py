"""GlobalStatsLoader: windows, counts, Lightning integration, bad input."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch

from lit_losses import GlobalStatsLoader, TinyLM
from lit_losses.aggregation import GLOBAL_STATS_KEY, GlobalStats, count_masks, sum_counts
from lit_losses.errors import ConfigError
from tests.aggregation.ddp_step import micro_batches, one_batch
from tests.helpers import quiet_trainer


def stats_of(loader) -> list:
    return [b[GLOBAL_STATS_KEY] for b in loader]


def test_each_window_carries_its_summed_counts_and_the_trailing_window_is_short():
    data = micro_batches()[:5]
    loader = GlobalStatsLoader(data, batch_size=None, accumulate_grad_batches=3)
    stats = stats_of(loader)
    assert [s.position for s in stats] == [0, 1, 2, 0, 1]
    assert [s.window for s in stats] == [3, 3, 3, 2, 2]
    assert all(s.loss_scale == 3.0 for s in stats)  # Lightning divides the short window by 3 too
    for window, batches in ((stats[:3], data[:3]), (stats[3:], data[3:])):
        expected = sum_counts(count_masks(b) for b in batches)["labels"]
        for s, b in zip(window, batches, strict=True):
            assert s.get() == expected
            assert s.get_local() == count_masks(b)["labels"]


def test_max_batches_caps_the_last_window_and_extra_mask_keys_are_counted():
    data = [{**b, "loss_mask": (b["segment_ids"] == 1)} for b in micro_batches()]
    loader = GlobalStatsLoader(data, batch_size=None)
    loader.configure(
        accumulate_grad_batches=4, mask_keys=("labels", "loss_mask"), ignore_index=-100, max_batches=5
    )
    stats = stats_of(loader)
    assert [s.window for s in stats] == [4, 4, 4, 4, 1]
    assert stats[-1].get("loss_mask") == count_masks(data[4], ("loss_mask",))["loss_mask"]


def test_workers_give_the_same_statistics():
    data = micro_batches()
    serial = stats_of(GlobalStatsLoader(data, batch_size=None, accumulate_grad_batches=2))
    parallel = stats_of(GlobalStatsLoader(data, batch_size=None, accumulate_grad_batches=2, num_workers=2))
    assert [s.masks for s in serial] == [s.masks for s in parallel]


def test_bad_configuration_and_batches_are_named():
    data = micro_batches()[:2]
    with pytest.raises(ConfigError, match="accumulate_grad_batches"):
        list(GlobalStatsLoader(data, batch_size=None))
    loader = GlobalStatsLoader(data, batch_size=None, accumulate_grad_batches=2)
    with pytest.raises(ConfigError, match=r"accumulate_grad_batches=2\) disagrees.*=4"):
        loader.configure(4, ("labels",), -100)
    with pytest.raises(KeyError, match="'loss_mask' is missing"):
        list(GlobalStatsLoader(data, batch_size=None, accumulate_grad_batches=2, mask_keys=("loss_mask",)))
    with pytest.raises(TypeError, match="dict micro-batches"):
        list(GlobalStatsLoader([torch.zeros(2)], batch_size=None, accumulate_grad_batches=1))


class RecordSteps(L.Callback):
    def __init__(self) -> None:
        self.logged, self.grads = [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.logged.append(float(trainer.callback_metrics["train/loss_total"]))
        self.grads.append([p.grad.clone() for p in pl_module.parameters()])


def tiny_model(**kwargs) -> TinyLM:
    L.seed_everything(0, verbose=False)
    return TinyLM(vocab_size=64, d_model=16, n_layers=1, n_heads=2, **kwargs)


def test_lightning_fit_configures_the_loader_and_logs_each_step_exactly():
    """5 micro-batches, accumulate 2, limit 5: windows 2, 2, 1; the logged loss of each step is the
    loss of its window computed in one go."""
    data = micro_batches()
    model, record = tiny_model(), RecordSteps()
    loader = GlobalStatsLoader(data, batch_size=None)
    trainer = quiet_trainer(
        max_epochs=1, limit_train_batches=5, accumulate_grad_batches=2, callbacks=[record]
    )
    with torch.no_grad():
        reference = []
        for window in (data[0:2], data[2:4], data[4:5]):
            total = sum_counts(count_masks(b) for b in window)
            reference.append(
                sum(
                    float(
                        model.compute_loss(
                            {**b, GLOBAL_STATS_KEY: GlobalStats(total, local=count_masks(b))}
                        ).total
                    )
                    for b in window
                )
            )
    trainer.fit(model, train_dataloaders=loader)
    assert loader.accumulate_grad_batches == 2 and loader.max_batches == 5
    assert record.logged[0] == pytest.approx(reference[0], rel=1e-6)
    assert len(record.logged) == 3  # the trailing window of one micro-batch still steps


def test_a_step_without_valid_labels_has_zero_loss_and_zero_gradients():
    data = [{**b, "labels": torch.full_like(b["labels"], -100)} for b in micro_batches()[:2]]
    model, record = tiny_model(), RecordSteps()
    trainer = quiet_trainer(max_steps=1, accumulate_grad_batches=2, callbacks=[record])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train_dataloaders=GlobalStatsLoader(data, batch_size=None))
    assert any("no valid label" in str(w.message) for w in caught)
    assert record.logged == [0.0]
    assert all(torch.equal(g, torch.zeros_like(g)) for g in record.grads[0])


def test_plain_loader_with_accumulation_warns_about_local_normalization():
    model = tiny_model()
    trainer = quiet_trainer(max_steps=1, accumulate_grad_batches=2)
    with pytest.warns(UserWarning, match="normalized by its own counts"):
        trainer.fit(
            model, train_dataloaders=torch.utils.data.DataLoader(micro_batches()[:2], batch_size=None)
        )


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_validation_logs_the_loss_of_the_whole_validation_set(mode):
    data = micro_batches()
    model = tiny_model(loss_agg=mode)
    with torch.no_grad():
        reference = float(model.compute_loss(one_batch(data), "val").base)
    trainer = quiet_trainer(limit_val_batches=None)
    (metrics,) = trainer.validate(
        model, dataloaders=torch.utils.data.DataLoader(data, batch_size=None), verbose=False
    )
    assert metrics["val/loss"] == pytest.approx(reference, rel=1e-6)


def test_lightning_fit_with_worker_processes_matches_the_serial_loader():
    data = micro_batches()
    losses = []
    for workers in (0, 2):
        model, record = tiny_model(), RecordSteps()
        trainer = quiet_trainer(max_steps=2, accumulate_grad_batches=3, callbacks=[record])
        trainer.fit(model, train_dataloaders=GlobalStatsLoader(data, batch_size=None, num_workers=workers))
        losses.append(record.logged)
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
