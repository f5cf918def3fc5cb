"""One run, one folder: no two runs share a log folder, a checkpoint folder or a config file unless the
user says so (`lit_losses.cli.run_dir`), and Lightning's refusals of trainer options are one line before the
run started, and left alone after (`lit_losses.cli.trainer_errors`)."""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import pytest
import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.loops.fit_loop import _FitLoop

from lit_losses.cli.app import cli_main
from lit_losses.cli.run_dir import claim_file, claim_folder

pytestmark = [pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter"), pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[1]
M, D, T = "--model.init_args.", "--data.init_args.", "--trainer."


def fit_args(tmp_path: Path, *extra: str, logger: bool = False, command: str = "fit") -> list[str]:
    """A one-step run of a tiny model on a tiny corpus (`tests/test_bad_inputs.py`'s base)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 8)
    root = tmp_path / "run"
    args = [command, "--config", str(REPO / "configs" / "tiny_lm.yaml"), f"{T}max_steps=1"]
    args += [f"{T}default_root_dir={root}", f"{T}val_check_interval=1", f"{T}limit_val_batches=1"]
    args += [f"{T}logger.init_args.save_dir={root}"] if logger else [f"{T}logger=false"]
    args += [f"{M}d_model=16", f"{M}n_heads=2", f"{M}n_layers=1", f"{D}vocab_size=300", f"{D}seq_len=16"]
    args += [f"{D}tokens_per_batch=32", f"{D}cache_dir={tmp_path / 'cache'}", f"{D}paths=[{corpus}]"]
    args += [f"{D}val_fraction=0"]  # one document: no validation item to hold out
    return [*args, f"{T}enable_progress_bar=false", *extra]


def one_line_error(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(args)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert exit_info.value.code == 2 and len(lines) == 1 and lines[0].startswith("lit-losses: error: "), lines
    return lines[0]


# ---- the claims themselves, from concurrent threads ---------------------------------------------------
def _concurrently(fn, n: int = 8) -> list:
    barrier, results = threading.Barrier(n), [None] * n

    def work(i: int) -> None:
        barrier.wait()
        results[i] = fn()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    return results


def test_version_folders_claimed_at_the_same_time_are_distinct(tmp_path):
    (tmp_path / "version_0").mkdir()  # an earlier run's
    versions = _concurrently(lambda: claim_folder(lambda n: tmp_path / f"version_{n}", 0))
    assert sorted(versions) == list(range(1, 9))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"version_{n}" for n in range(9))


def test_config_files_claimed_at_the_same_time_are_distinct(tmp_path):
    paths = _concurrently(lambda: claim_file(tmp_path, "config.yaml", reuse=True, refuse=None))
    assert len(set(paths)) == 8 and {p.name for p in paths} == {"config.yaml"} | {
        f"config_{n}.yaml" for n in range(1, 8)
    }


# ---- runs with a logger --------------------------------------------------------------------------------
def test_a_run_that_takes_the_version_this_run_picked_leaves_its_folder_alone(tmp_path, monkeypatch):
    """Deterministic race: another run creates ``version_0`` (and writes its config) right after this run's
    logger listed the folders and picked 0, before this run wrote anything."""
    pick = TensorBoardLogger._get_next_version

    def concurrent_pick(logger: TensorBoardLogger) -> int:
        version = pick(logger)
        other = Path(logger.root_dir) / f"version_{version}"
        if not other.exists():
            other.mkdir(parents=True)
            (other / "config.yaml").write_text("the other run's config\n")
        return version

    monkeypatch.setattr(TensorBoardLogger, "_get_next_version", concurrent_pick)
    cli = cli_main(fit_args(tmp_path, logger=True))
    runs = tmp_path / "run" / "tensorboard"
    assert Path(cli.trainer.log_dir) == runs / "version_1" and cli.trainer.logger.version == 1
    assert sorted(p.name for p in (runs / "version_0").iterdir()) == ["config.yaml"]
    assert (runs / "version_0" / "config.yaml").read_text() == "the other run's config\n"
    assert (
        yaml.safe_load((runs / "version_1" / "config.yaml").read_text())["model"]["init_args"]["d_model"]
        == 16
    )
    assert list((runs / "version_1" / "checkpoints").glob("*.ckpt"))


def test_runs_one_after_the_other_get_their_own_version_and_config(tmp_path):
    first = cli_main(fit_args(tmp_path, logger=True))
    config = (Path(first.trainer.log_dir) / "config.yaml").read_bytes()
    second = cli_main(fit_args(tmp_path, f"{M}d_model=32", logger=True))
    assert (
        Path(first.trainer.log_dir).name == "version_0" and Path(second.trainer.log_dir).name == "version_1"
    )
    assert (Path(first.trainer.log_dir) / "config.yaml").read_bytes() == config
    assert b"d_model: 32" in (Path(second.trainer.log_dir) / "config.yaml").read_bytes()


def test_two_loggers_of_one_run_under_one_root_share_its_folder(tmp_path):
    root = tmp_path / "run"
    init = f"init_args: {{save_dir: {root}, name: logs}}"
    kinds = ("TensorBoardLogger", "CSVLogger")
    loggers = [f"{{class_path: lightning.pytorch.loggers.{kind}, {init}}}" for kind in kinds]
    (root / "logs" / "version_0").mkdir(parents=True)  # an earlier run's
    cli = cli_main(fit_args(tmp_path, f"{T}logger=[{', '.join(loggers)}]"))
    assert [(type(lg).__name__, lg.version) for lg in cli.trainer.loggers] == [
        ("TensorBoardLogger", 1),
        ("CSVLogger", 1),
    ]
    assert sorted(p.name for p in (root / "logs").iterdir()) == ["version_0", "version_1"]
    assert {lg.log_dir for lg in cli.trainer.loggers} == {str(root / "logs" / "version_1")}


# ---- runs without a logger: trainer.default_root_dir is the run's folder -------------------------------
def test_a_second_fit_into_the_same_folder_is_refused_unless_asked_and_never_overwrites(tmp_path, capsys):
    cli_main(fit_args(tmp_path, f"{T}enable_checkpointing=false"))
    config = tmp_path / "run" / "config.yaml"
    first = config.read_bytes()
    line = one_line_error(fit_args(tmp_path, f"{T}enable_checkpointing=false", f"{M}d_model=32"), capsys)
    assert f"{tmp_path / 'run'} already holds another run's config.yaml" in line and "--reuse_run_dir" in line
    assert config.read_bytes() == first and not (tmp_path / "run" / "config_1.yaml").exists()

    cli_main(fit_args(tmp_path, f"{T}enable_checkpointing=false", f"{M}d_model=32", "--reuse_run_dir=true"))
    assert config.read_bytes() == first
    assert b"d_model: 32" in (tmp_path / "run" / "config_1.yaml").read_bytes()


def test_validate_and_predict_save_their_config_beside_the_fits_never_over_it(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("the fit's config\n")
    for command in ("validate", "validate", "predict"):
        cli_main(fit_args(tmp_path, command=command))
    names = sorted(p.name for p in (tmp_path / "run").glob("*.yaml"))
    assert names == ["config.yaml", "config_1.yaml", "config_2.yaml", "config_3.yaml"]
    assert (tmp_path / "run" / "config.yaml").read_text() == "the fit's config\n"


def test_a_run_refused_at_set_up_gives_its_config_file_back(tmp_path, capsys):
    line = one_line_error(fit_args(tmp_path, f"{T}val_check_interval=10000"), capsys)
    assert "trainer.val_check_interval=10000 is larger than the number of training batches" in line
    assert not (tmp_path / "run" / "config.yaml").exists()  # written at set-up, given back
    cli = cli_main(fit_args(tmp_path))  # so that the corrected run may use the folder
    assert cli.trainer.global_step == 1 and (tmp_path / "run" / "config.yaml").exists()


# ---- Lightning's refusals: one line before the run started, untouched after or through your code -----
class LightningRefusalInSetup(Callback):
    """A callback whose own code makes Lightning raise (a bug of the callback, not a trainer option)."""

    def setup(self, trainer, pl_module, stage) -> None:
        Trainer(accelerator="cpu", devices=0)


def test_lightning_refusal_before_the_run_started_is_one_line_naming_the_option(tmp_path, capsys):
    line = one_line_error(fit_args(tmp_path, f"{T}accelerator=cpu", f"{T}devices=0"), capsys)
    assert line.startswith("lit-losses: error: trainer.devices=0: `Trainer(devices=")


def test_lightning_refusal_raised_through_your_own_code_keeps_its_traceback(tmp_path):
    args = fit_args(tmp_path, f"{T}callbacks+=tests.test_run_dir.LightningRefusalInSetup")
    with pytest.raises(MisconfigurationException, match=r"Trainer\(devices=0\)"):
        cli_main(args)


def test_lightning_refusal_once_training_ran_is_left_as_it_is(tmp_path, monkeypatch):
    """The same refusal, raised by Lightning's own code (no frame of ours: a ``partial`` of `Trainer`) at the
    end of the first epoch, after training started: not an option checked at set-up."""
    monkeypatch.setattr(_FitLoop, "on_advance_end", functools.partial(Trainer, accelerator="cpu", devices=0))
    with pytest.raises(MisconfigurationException, match=r"Trainer\(devices=0\)"):
        cli_main(fit_args(tmp_path))
    assert (tmp_path / "run" / "config.yaml").exists()  # a run that started keeps its folder


def test_lightning_refusal_raised_from_your_own_error_keeps_its_traceback():
    """Lightning re-raising a user's error (``raise MisconfigurationException(...) from err``) is the user's
    bug, not an option: it is not turned into one line."""
    import lightning as L

    from lit_losses.cli.trainer_errors import lightning_config_error

    try:
        L.Trainer(accelerator="cpu", devices=0)
    except Exception as exc:
        refusal = exc
    assert lightning_config_error(refusal) is not None  # Lightning's own: one line
    try:
        raise ValueError("a bug in the user's code")
    except ValueError as user_error:
        refusal.__cause__ = user_error
    assert lightning_config_error(refusal) is None


def test_a_slurm_requeue_that_lightning_resumes_is_not_a_second_run(tmp_path, monkeypatch):
    """An auto-requeued SLURM job runs again in the same folder without --ckpt_path: Lightning resumes it
    from ``hpc_ckpt_*.ckpt`` by itself, so its folder is its own (outside SLURM, or without such a
    checkpoint, the folder stays refused)."""
    from lit_losses.cli.app import slurm_requeue

    (tmp_path / "hpc_ckpt_1.ckpt").write_bytes(b"")
    assert not slurm_requeue(tmp_path)  # not under SLURM
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    assert slurm_requeue(tmp_path)
    assert not slurm_requeue(tmp_path / "elsewhere")
