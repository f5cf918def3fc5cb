"""Exact resume: a run resumed from any checkpoint logs the uninterrupted run's per-step losses and ends with
its weights, bit for bit (mid-epoch, accumulation, worker processes, regularizers, a controller)."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers.logger import Logger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_losses import RegularizedLM, RegularizerSpec, TextDataModule, TinyLM, TrainingController
from lit_losses.checkpoint.resume import ADDED_OPTION_DEFAULTS, option_changes
from tests.helpers import LossRecorder, quiet_trainer, seed, tiny_setup

REPO = Path(__file__).resolve().parents[1]
DATA = dict(vocab_size=512, seq_len=64, tokens_per_batch=256, max_documents=12, val_fraction=0.1)
MODEL = dict(vocab_size=512, d_model=32, n_layers=1, n_heads=2)
REGULARIZERS = [RegularizerSpec(name="z_loss", weight=1e-3), RegularizerSpec(name="entropy", weight=0.01)]


class MemoryLogger(Logger):
    """Keeps every logged ``train/loss_total`` by step (what TensorBoard would receive)."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: dict[int, float] = {}

    name, version = "memory", 0

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        if "train/loss_total" in metrics:
            assert step not in self.losses, f"step {step} logged twice"
            self.losses[step] = float(metrics["train/loss_total"])


def train(corpus, root, *, accumulate, workers, max_steps, ckpt_every=None, ckpt_path=None, controlled=False):
    """One fit of the tiny LM on the text corpus; returns (logged losses by step, final weights, trainer)."""
    seed(0 if ckpt_path is None else 123)  # a resumed run must not depend on the global RNG
    model = TinyLM(**MODEL, regularizers=REGULARIZERS)
    data = TextDataModule(paths=[str(corpus / "*.txt")], num_workers=workers, **DATA)
    logger = MemoryLogger()
    callbacks = []
    if ckpt_every:
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=root, every_n_train_steps=ckpt_every, save_top_k=-1, filename="{step}"
            )
        )
    if controlled:
        callbacks.append(TrainingController(str(REPO / "configs" / "controller" / "stop_on_runaway.yaml")))
    trainer = quiet_trainer(
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        limit_train_batches=7,  # 7 micro-batches per epoch: the last window of an epoch is short when A = 2
        logger=logger,
        log_every_n_steps=1,
        callbacks=callbacks,
        default_root_dir=root,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data, ckpt_path=ckpt_path)
    assert not [w for w in caught if "not resumable" in str(w.message)], "Lightning says: not resumable"
    return logger.losses, {k: v.clone() for k, v in model.state_dict().items()}, trainer


def assert_same_run(resumed, full, first_resumed_step):
    losses, weights, _ = resumed
    full_losses, full_weights, _ = full
    assert sorted(losses) == [s for s in sorted(full_losses) if s >= first_resumed_step]
    for step, loss in losses.items():
        assert loss == full_losses[step], (step, loss, full_losses[step])  # exactly
    assert weights.keys() == full_weights.keys()
    for name, value in weights.items():
        assert torch.equal(value, full_weights[name]), name  # bit for bit


@pytest.mark.slow
@pytest.mark.parametrize(
    ("accumulate", "workers", "ckpt_step"),
    [(1, 0, 5), (2, 0, 5), (2, 2, 3), (1, 2, 9)],
    ids=["A1-w0-epoch0", "A2-w0-epoch1", "A2-w2-epoch0", "A1-w2-epoch1"],
)
def test_resume_mid_epoch_reproduces_every_step_and_the_weights(
    text_corpus, tmp_path, accumulate, workers, ckpt_step
):
    """7 micro-batches per epoch: 7 steps (A = 1) or 4 (A = 2, the last window of 1); checkpoints are
    taken every few steps, in the middle of epochs 0 and 1; the resumed run must be the same run."""
    max_steps = 12 if accumulate == 1 else 7
    full = train(
        text_corpus,
        tmp_path / "full",
        accumulate=accumulate,
        workers=workers,
        max_steps=max_steps,
        controlled=True,
    )
    assert len(full[0]) == max_steps
    train(
        text_corpus,
        tmp_path / "first",
        accumulate=accumulate,
        workers=workers,
        max_steps=ckpt_step,
        ckpt_every=ckpt_step,
        controlled=True,
    )
    ckpt = tmp_path / "first" / f"step={ckpt_step}.ckpt"
    state = torch.load(ckpt, weights_only=True)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    batches_per_epoch = 7
    micro_batches_done = ckpt_step * accumulate
    if accumulate == 2:  # epochs of 4 steps: 7 micro-batches
        micro_batches_done = (ckpt_step // 4) * 7 + (ckpt_step % 4) * 2
    assert state[0]["index"] == micro_batches_done % batches_per_epoch  # a mid-epoch position
    assert 0 < state[0]["index"] < batches_per_epoch
    resumed = train(
        text_corpus,
        tmp_path / "resumed",
        accumulate=accumulate,
        workers=workers,
        max_steps=max_steps,
        ckpt_path=str(ckpt),
        controlled=True,
    )
    assert_same_run(resumed, full, ckpt_step)  # steps are logged 0-based


@pytest.mark.slow
def test_extending_a_run_that_max_steps_stopped_mid_epoch_reproduces_the_longer_run(text_corpus, tmp_path):
    """``max_steps=3`` stops epoch 0 (7 micro-batches) after 3; Lightning counts the epoch as processed and
    a checkpoint saved then (``trainer.save_checkpoint`` after the fit, as ``ModelCheckpoint``'s epoch-end
    save) must still resume at micro-batch 3 of epoch 0: the extended run equals a 9-step run."""
    full = train(text_corpus, tmp_path / "full", accumulate=1, workers=0, max_steps=9)
    *_, trainer = train(text_corpus, tmp_path / "first", accumulate=1, workers=0, max_steps=3)
    trainer.save_checkpoint(tmp_path / "stopped.ckpt")
    loops = torch.load(tmp_path / "stopped.ckpt", weights_only=True)["loops"]["fit_loop"]
    assert loops["epoch_progress"]["total"]["processed"] == 1  # what Lightning saves: the epoch "ended"
    assert loops["state_dict"]["combined_loader"][0]["index"] == 3
    resumed = train(
        text_corpus,
        tmp_path / "resumed",
        accumulate=1,
        workers=0,
        max_steps=9,
        ckpt_path=str(tmp_path / "stopped.ckpt"),
    )
    assert_same_run(resumed, full, 3)


def test_an_old_checkpoint_without_the_data_position_cannot_resume_mid_epoch(text_corpus, tmp_path):
    """A mid-epoch checkpoint without the loader's position (saved before the loader was resumable)
    raises at the first step instead of training the epoch's first micro-batches again."""
    train(text_corpus, tmp_path / "first", accumulate=1, workers=0, max_steps=3, ckpt_every=3)
    ckpt = torch.load(tmp_path / "first" / "step=3.ckpt", weights_only=True)
    del ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    old = tmp_path / "old.ckpt"
    torch.save(ckpt, old)
    with pytest.raises(RuntimeError, match="yields micro-batch 0 of its pass where Lightning is at batch 3"):
        train(text_corpus, tmp_path / "resumed", accumulate=1, workers=0, max_steps=6, ckpt_path=str(old))


def test_a_checkpoint_of_other_data_cannot_resume_mid_epoch(text_corpus, tmp_path):
    train(text_corpus, tmp_path / "first", accumulate=1, workers=0, max_steps=3, ckpt_every=3)
    ckpt = torch.load(tmp_path / "first" / "step=3.ckpt", weights_only=True)
    ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["length"] = 9
    other = tmp_path / "other.ckpt"
    torch.save(ckpt, other)
    with pytest.raises(RuntimeError, match="epoch of 9 micro-batches, but this run's epoch has 7"):
        train(text_corpus, tmp_path / "resumed", accumulate=1, workers=0, max_steps=6, ckpt_path=str(other))


@pytest.mark.slow
def test_checkpoint_resume_gives_the_same_per_step_losses(text_corpus, tmp_path):
    """Resume at an epoch boundary (every epoch's order depends only on the seed and the epoch)."""
    seed()
    model, data = tiny_setup(text_corpus)
    full = LossRecorder()
    quiet_trainer(max_epochs=2, callbacks=[full], enable_checkpointing=False, limit_train_batches=4).fit(
        model, data
    )
    steps_per_epoch = len(full.losses) // 2
    assert steps_per_epoch == 4

    seed()
    model, data = tiny_setup(text_corpus)
    first = LossRecorder()
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    quiet_trainer(max_epochs=1, callbacks=[first, ckpt], limit_train_batches=4).fit(model, data)

    seed(123)  # a different global RNG state must not matter
    model, data = tiny_setup(text_corpus)
    resumed = LossRecorder()
    quiet_trainer(max_epochs=2, callbacks=[resumed], limit_train_batches=4, default_root_dir=tmp_path).fit(
        model, data, ckpt_path=str(tmp_path / "last.ckpt")
    )

    assert sorted(resumed.losses) == sorted(k for k in full.losses if k > steps_per_epoch)
    for step, loss in resumed.losses.items():
        assert loss == pytest.approx(full.losses[step], rel=1e-6, abs=1e-7), step
    for step, loss in first.losses.items():
        assert loss == pytest.approx(full.losses[step], rel=1e-6, abs=1e-7), step


def tensorboard_losses(root: Path) -> dict[int, float]:
    (events,) = {p.parent for p in root.rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("train/loss_total")}


@pytest.mark.slow
def test_resume_from_the_main_jobs_periodic_checkpoint(tmp_path):
    """The main job (configs/tiny_lm.yaml, shrunk) with the controller: its checkpoint is the one written at
    each validation, in the middle of the epoch; the resumed run logs the same losses and ends with the
    same weights as the uninterrupted one."""
    from lit_losses.cli.app import cli_main

    def job(name, max_steps, *extra):
        root = tmp_path / name
        cli = cli_main(
            [
                "fit",
                "--config",
                str(REPO / "configs" / "tiny_lm.yaml"),
                "--config",
                str(REPO / "configs" / "controlled.yaml"),
                f"--trainer.default_root_dir={root}",
                f"--trainer.logger.init_args.save_dir={root}",
                f"--trainer.max_steps={max_steps}",
                "--trainer.val_check_interval=3",
                "--trainer.limit_val_batches=2",
                "--trainer.log_every_n_steps=1",
                "--trainer.enable_progress_bar=false",
                "--data.init_args.max_documents=30",
                "--data.init_args.seq_len=64",
                "--data.init_args.tokens_per_batch=512",
                "--data.init_args.vocab_size=512",
                "--model.init_args.n_layers=1",
                "--model.init_args.d_model=48",
                "--model.init_args.optimizer.total_steps=8",  # the schedule must not depend on max_steps
                *extra,
            ]
        )
        return cli, root

    full, full_root = job("full", 8)
    _, first_root = job("first", 4)  # validations after micro-batches 3 (its checkpoint is kept) and 6
    (ckpt,) = first_root.rglob("*.ckpt")
    position = torch.load(ckpt, weights_only=True)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert position[0]["index"] == 3 and position[0]["length"] > 3  # mid-epoch
    resumed, resumed_root = job("resumed", 8, f"--ckpt_path={ckpt}")
    full_losses, resumed_losses = tensorboard_losses(full_root), tensorboard_losses(resumed_root)
    assert sorted(resumed_losses) == [s for s in sorted(full_losses) if s >= 3]
    assert all(resumed_losses[s] == full_losses[s] for s in resumed_losses), (resumed_losses, full_losses)
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, full.model.state_dict()[name]), name


# ---- options that differ from the checkpoint's (the Python API; the CLI: tests/test_cli.py) ------------
def test_run_options_are_regularized_lms_own_arguments():
    import inspect

    from lit_losses import RegularizedLM
    from lit_losses.checkpoint.resume import RUN_OPTIONS

    own = [p for p in inspect.signature(RegularizedLM.__init__).parameters if p not in ("self", "kwargs")]
    assert sorted(RUN_OPTIONS) == sorted(own)  # a new option: decide whether a resumed run may change it


def test_resuming_with_another_architecture_is_refused(tmp_path):
    from lit_losses import GlobalStatsLoader
    from lit_losses.errors import ConfigError
    from tests.aggregation.ddp_step import micro_batches

    def tiny(**kwargs):
        return TinyLM(vocab_size=64, d_model=16, n_layers=1, n_heads=2, **kwargs)

    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    quiet_trainer(max_steps=2, callbacks=[ckpt]).fit(
        tiny(), GlobalStatsLoader(micro_batches(), batch_size=None)
    )
    resumed = TinyLM(vocab_size=64, d_model=16, n_layers=1, n_heads=4)  # same weights' shapes, other heads
    with pytest.raises(ConfigError, match=r"model\.init_args\.n_heads: 2 in the checkpoint, 4 now"):
        quiet_trainer(max_steps=3).fit(
            resumed,
            GlobalStatsLoader(micro_batches(), batch_size=None),
            ckpt_path=str(tmp_path / "last.ckpt"),
        )
    with pytest.warns(UserWarning, match=r"model.init_args.regularizers\[z_loss\]: added"):
        quiet_trainer(max_steps=3).fit(
            tiny(regularizers=[RegularizerSpec(name="z_loss", weight=1e-3)]),
            GlobalStatsLoader(micro_batches(), batch_size=None),
            ckpt_path=str(tmp_path / "last.ckpt"),
        )


def test_options_added_since_a_checkpoint_are_no_change_at_their_defaults():
    """A checkpoint written before ``base_loss``/``base_loss_args``/``loss_agg_norm`` existed trained with
    their defaults: resuming it with them is silent; with another value it is a change."""
    import inspect

    defaults = inspect.signature(RegularizedLM.__init__).parameters
    assert {k: defaults[k].default for k in ADDED_OPTION_DEFAULTS} == ADDED_OPTION_DEFAULTS
    saved = {"d_model": 32, "loss_agg": "token-mean"}
    given = {**saved, "base_loss": "cross_entropy", "base_loss_args": None, "loss_agg_norm": None}
    assert option_changes(saved, given) == []
    changes = option_changes(saved, {**given, "base_loss": "ppo"})
    assert [str(c) for c in changes] == ["model.init_args.base_loss: added ('ppo')"]


def test_hyper_parameters_that_load_from_checkpoint_parsed_in_place_are_no_change():
    """``load_from_checkpoint`` of a LightningCLI checkpoint parses its hyper-parameters with jsonargparse
    (Lightning's ``instantiate_module``), which turns the regularizers' dicts into ``Namespace`` objects
    inside the checkpoint, before ``on_load_checkpoint`` compares them: still the same options."""
    from lightning.pytorch.cli import instantiate_module

    from lit_losses.hparams import plain_data

    model = TinyLM(vocab_size=64, d_model=16, n_layers=1, n_heads=2, regularizers=[{"name": "z_loss"}])
    saved = {"_class_path": "lit_losses.TinyLM", **plain_data(dict(model.hparams))}
    loaded = instantiate_module(TinyLM, dict(saved))  # Lightning hands it a shallow copy
    assert type(saved["regularizers"][0]).__name__ == "Namespace"  # parsed in place
    assert option_changes(saved, dict(loaded.hparams), model_class=TinyLM) == []
    saved["regularizers"][0].init_args.weight = 0.5
    changes = [str(c) for c in option_changes(saved, dict(loaded.hparams), model_class=TinyLM)]
    assert changes == ["model.init_args.regularizers[z_loss].weight: 0.5 in the checkpoint, 1.0 now"]
