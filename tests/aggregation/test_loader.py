"""GlobalStatsLoader: windows, counts, Lightning integration, bad input."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.rank_zero import WarningCache

import lit_losses.module
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


def test_plain_loader_with_accumulation_warns_about_local_normalization(monkeypatch):
    # the warning is given once per process: start from a fresh cache whatever ran before
    monkeypatch.setattr(lit_losses.module, "_WARNINGS", WarningCache())
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


# ---- resumable position and skipped micro-batches ------------------------------------------------------
class CountingDataset(torch.utils.data.Dataset):
    """Micro-batch ``i`` holds ``i + 1`` valid labels; counts the items it loads (in this process)."""

    def __init__(self, n: int) -> None:
        self.n, self.loaded = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        self.loaded.append(i)
        return {"labels": torch.tensor([[1] * (i + 1) + [-100] * (self.n - i)]), "index": i}


def indices(batches) -> list[int]:
    return [int(b["index"]) for b in batches]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_restored_position_continues_the_pass_without_loading_the_skipped_items(workers):
    data = CountingDataset(7)
    first = GlobalStatsLoader(data, batch_size=None, accumulate_grad_batches=2, num_workers=workers)
    first.configure(2, ("labels",), -100, max_batches=7)
    iterator = iter(first)
    seen = [next(iterator) for _ in range(4)]
    state = first.state_dict()
    assert state["index"] == 4 and state["length"] == 7 and indices(seen) == [0, 1, 2, 3]

    resumed = GlobalStatsLoader(data, batch_size=None, accumulate_grad_batches=2, num_workers=workers)
    resumed.configure(2, ("labels",), -100, max_batches=7)
    resumed.load_state_dict(state)
    data.loaded.clear()
    rest = list(resumed)
    assert indices(rest) == [4, 5, 6]
    if workers == 0:
        assert data.loaded == [4, 5, 6]  # the first 4 were not loaded again
    stats = [b[GLOBAL_STATS_KEY] for b in rest]
    assert [(s.index, s.position, s.window, s.ends_window) for s in stats] == [
        (4, 0, 2, False),
        (5, 1, 2, True),
        (6, 0, 1, True),
    ]
    assert stats[0].get().num_tokens == 5 + 6  # the window's counts: micro-batches 4 and 5
    assert indices(resumed) == list(range(7))  # the next pass starts at the beginning


def test_a_finished_pass_resumes_at_the_start_of_the_next():
    loader = GlobalStatsLoader(CountingDataset(3), batch_size=None, accumulate_grad_batches=1)
    loader.configure(1, ("labels",), -100, max_batches=3)
    list(loader)
    resumed = GlobalStatsLoader(CountingDataset(3), batch_size=None, accumulate_grad_batches=1)
    resumed.configure(1, ("labels",), -100, max_batches=3)
    resumed.load_state_dict(loader.state_dict())
    assert indices(resumed) == [0, 1, 2]


def test_skipped_micro_batches_end_the_pass_at_the_last_whole_window():
    loader = GlobalStatsLoader(CountingDataset(10), batch_size=None, accumulate_grad_batches=2)
    loader.configure(2, ("labels",), -100, max_batches=10)
    iterator = iter(loader)
    seen = [next(iterator) for _ in range(4)]
    loader.skip(3)  # items 4, 5, 6 dropped: 7, 8 make a window; 9 alone would not: dropped too
    seen += list(iterator)
    assert indices(seen) == [0, 1, 2, 3, 7, 8]
    assert [b[GLOBAL_STATS_KEY].index for b in seen] == [0, 1, 2, 3, 4, 5]  # Lightning's batch index
    assert loader.position.skipped == 3 and loader.state_dict()["index"] == 6


def test_an_iterable_dataset_resumes_by_consuming_the_skipped_items():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from ({"labels": torch.tensor([[i]]), "index": i} for i in range(5))

    loader = GlobalStatsLoader(Stream(), batch_size=None, accumulate_grad_batches=1)
    loader.load_state_dict({"index": 2, "length": None, "epoch": None, "skipped": 0})
    assert indices(loader) == [2, 3, 4]


def test_a_position_of_another_epoch_or_length_is_refused():
    loader = GlobalStatsLoader(CountingDataset(4), batch_size=None, accumulate_grad_batches=1)
    loader.configure(1, ("labels",), -100, max_batches=4)
    loader.load_state_dict({"index": 2, "length": 5, "epoch": None, "skipped": 0})
    with pytest.raises(RuntimeError, match="epoch of 5 micro-batches, but this run's epoch has 4"):
        list(loader)


def test_a_saved_position_applies_to_its_own_epoch_only():
    from lit_losses.aggregation.position import LoaderPosition

    saved = LoaderPosition(epoch=1, index=3, length=7, accumulate_grad_batches=1)
    assert saved.resume_point(epoch=1, length=7, accumulate=1) == 3
    assert saved.resume_point(epoch=2, length=7, accumulate=1) == 0  # that pass ended early (epoch stop)
    with pytest.raises(RuntimeError, match="micro-batch 3 of epoch 1, but the resumed run starts epoch 0"):
        saved.resume_point(epoch=0, length=7, accumulate=1)
    done = LoaderPosition(epoch=1, index=3, length=7, done=True)  # its data ran out (skipped micro-batches)
    assert done.resume_point(epoch=1, length=7, accumulate=1) == 0
