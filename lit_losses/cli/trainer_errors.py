"""Lightning's own refusals of trainer options, as one `ConfigError` line.

The user need: a mistyped or impossible trainer option given to ``lit-losses fit`` (``val_check_interval``
larger than the epoch, an accelerator the host lacks). Without this module the CLI prints Lightning's
multi-sentence traceback and exits with 1, like a crash, instead of one line naming the option and exit
code 2.

Lightning checks some trainer options only when a run sets up (``trainer.val_check_interval`` against the
number of training batches, an accelerator that is not there, …) and raises a ``ValueError`` or a
``MisconfigurationException`` (a ``TypeError`` for some values, ``devices=-2``) with a message over several
sentences. `lightning_config_error` turns such an exception into a `ConfigError` naming the option and its
value, if Lightning raised it in its own code (not through a model's, a data module's or a callback's
code) before the run started (`RunStarted`); any other exception (a bug in a model, a data module, a
callback, or anything raised once training runs) is left as it is.
"""

from __future__ import annotations

import inspect
import re
import sysconfig
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import lightning_utilities
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, Trainer

from lit_losses.errors import ConfigError

_LIGHTNING = Path(pl.__file__).resolve().parents[1]
"""The ``lightning`` package: where the exceptions this module translates must be raised."""
_LIBRARIES = (
    _LIGHTNING,
    Path(lightning_utilities.__file__).resolve().parent,
    Path(torch.__file__).resolve().parent,
)
_STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()
_VAL_CHECK = re.compile(
    r"`val_check_interval` \((\d+)\) must be less than or equal to the number of the "
    r"training batches \((\d+)\)"
)
_TRAINER_OPTIONS = tuple(inspect.signature(Trainer.__init__).parameters)
_OPTION_OF = {word: "accelerator" for word in ("gpu", "cuda", "mps", "tpu", "xla", "hpu", "backend")}
"""Words of Lightning refusals that name no option but are about one (``No supported gpu backend found!``)."""


class RunStarted(Callback):
    """Records whether the run got past its set-up: training (``fit``), or the evaluation loop of
    ``validate``, ``test`` or ``predict`` started (the sanity check does not count)."""

    def __init__(self) -> None:
        self.started = False

    def on_train_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self.started = True

    def on_validation_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self.started = self.started or not trainer.sanity_checking

    def on_test_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self.started = True

    def on_predict_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self.started = True


def _trusted(filename: str) -> bool:
    """Code of Lightning, torch or the standard library (not of lit_losses, nor of the user)."""
    if filename.startswith("<"):  # frozen modules
        return True
    path = Path(filename).resolve()
    if any(path.is_relative_to(root) for root in _LIBRARIES):
        return True
    installed = "site-packages" in path.parts or "dist-packages" in path.parts
    return not installed and path.is_relative_to(_STDLIB)


def _raised_by_lightning(err: BaseException) -> bool:
    """Whether Lightning raised ``err`` in its own code: the innermost frame is Lightning's, and no frame
    between the first of Lightning's and it is foreign (a model's, a data module's or a callback's code:
    a Lightning error raised through them is theirs, not an option's)."""
    frames, tb = [], err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    inside = [
        Path(f).resolve().is_relative_to(_LIGHTNING) if not f.startswith("<") else False for f in frames
    ]
    if not frames or not inside[-1]:
        return False
    return all(_trusted(f) for f in frames[inside.index(True) :])


def lightning_config_error(
    err: BaseException, options: Mapping[str, Any] | None = None
) -> ConfigError | None:
    """``err`` as one `ConfigError` line when it is Lightning refusing a trainer option (a
    ``MisconfigurationException``, ``ValueError`` or ``TypeError`` raised in Lightning's own code), else
    ``None``. Call it only for exceptions raised before the run started (`RunStarted`). With the trainer's
    ``options`` (the parsed ``trainer`` section), the line gives the option's value too
    (``trainer.devices=-2: …``).

    Example:
        >>> err = ValueError(" `val_check_interval` (125) must be less than or equal to the number of the "
        ...                  "training batches (40). If you want to disable validation ...")
        >>> print(lightning_config_error(err))
        None
        >>> try:
        ...     Trainer(accelerator="cpu", devices=0)
        ... except Exception as exc:
        ...     print(lightning_config_error(exc))  # doctest: +ELLIPSIS
        trainer.devices: `Trainer(devices=0)` value is not a valid input using cpu accelerator.
        >>> try:
        ...     Trainer(accelerator="cpu", devices=-2)
        ... except Exception as exc:
        ...     print(lightning_config_error(exc, {"accelerator": "cpu", "devices": -2}))
        trainer.devices=-2: `devices` selected with `CPUAccelerator` should be an int > 0.
    """
    if isinstance(err, ConfigError) or not isinstance(
        err, MisconfigurationException | ValueError | TypeError
    ):
        return None
    if not _raised_by_lightning(err):
        return None
    if err.__cause__ is not None and not _raised_by_lightning(err.__cause__):
        return None  # Lightning re-raising a model's, a data module's or a callback's error: theirs
    message = " ".join(str(err).split())
    match = _VAL_CHECK.search(message)
    if match:
        return ConfigError(
            f"trainer.val_check_interval={match.group(1)} is larger than the number of training batches "
            f"per epoch ({match.group(2)}); lower it, set trainer.check_val_every_n_epoch=null to count it "
            "across epochs, or trainer.limit_val_batches=0 to disable validation"
        )
    words = re.findall(r"`(?:Trainer\()?(\w+)", message) + re.findall(r"\w+", message.lower())
    named = next((w for w in words if w in _TRAINER_OPTIONS and w != "self"), None)
    named = named or next((_OPTION_OF[w] for w in words if w in _OPTION_OF), None)
    if not named:
        return ConfigError(f"Lightning refused the run: {message}")
    value = f"={options[named]}" if options and named in options else ""
    return ConfigError(f"trainer.{named}{value}: {message}")
