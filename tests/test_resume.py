import lightning as L
import pytest

from tests.helpers import LossRecorder, quiet_trainer, seed, tiny_setup


@pytest.mark.slow
def test_checkpoint_resume_gives_the_same_per_step_losses(text_corpus, tmp_path):
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
