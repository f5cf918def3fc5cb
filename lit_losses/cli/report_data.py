"""A run's logged scalars, read back from its TensorBoard event files (TensorBoard's own `EventAccumulator`)
or from the ``metrics.csv`` of Lightning's `CSVLogger`, for ``lit-losses report``.

A run folder is a logger's version folder (``runs/tiny_lm/tensorboard/version_0``); a folder above such
folders (``runs/tiny_lm``) stands for every run under it. Reading works on a run that is still going: what
the logger has flushed so far is read.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_losses.errors import ConfigError

Series = dict[int, float]
"""One logged scalar: step → value."""


class NoEventsError(ConfigError):
    """A folder holds no TensorBoard event file and no ``metrics.csv``."""


@dataclass
class RunScalars:
    """The scalars of one run: ``scalars[tag][step] = value``; ``label`` names the run in legends."""

    folder: Path
    label: str
    scalars: dict[str, Series] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    """The run's ``config.yaml`` as dotted option paths (``model.init_args.loss_agg``: value), or empty."""
    end: dict[str, Any] = field(default_factory=dict)
    """The run's ``run_end.json`` (why and where it ended); empty while it runs or without."""

    def tags(self, prefix: str = "", suffix: str = "") -> list[str]:
        """The logged tags that start with ``prefix`` and end with ``suffix``, sorted."""
        return sorted(t for t in self.scalars if t.startswith(prefix) and t.endswith(suffix))


def run_folders(folder: str | Path) -> list[Path]:
    """The run folders in ``folder``: itself if it holds event files or ``metrics.csv``, else every folder
    under it that does (sorted).

    Raises:
        NoEventsError: none is found.
    """
    root = Path(folder)
    if not root.is_dir():
        raise NoEventsError(f"report: {str(root)!r} is not a folder")
    if _holds_logs(root):
        return [root]
    patterns = ("events.out.tfevents.*", "metrics.csv")
    found = sorted({p.parent for pattern in patterns for p in root.rglob(pattern)})
    if not found:
        raise NoEventsError(
            f"report: {str(root)!r} holds no TensorBoard event file (events.out.tfevents.*) and no "
            "metrics.csv; pass a run's log folder, e.g. runs/tiny_lm/tensorboard/version_0"
        )
    return found


def _holds_logs(folder: Path) -> bool:
    return any(folder.glob("events.out.tfevents.*")) or (folder / "metrics.csv").is_file()


def read_run(folder: Path, label: str | None = None) -> RunScalars:
    """Every scalar logged in ``folder`` (event files first; else ``metrics.csv``).

    Example:
        >>> import tempfile
        >>> from torch.utils.tensorboard import SummaryWriter
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     with SummaryWriter(tmp) as writer:
        ...         for step in range(3):
        ...             writer.add_scalar("train/loss_total", 5.0 - step, step)
        ...     read_run(Path(tmp), "a").scalars
        {'train/loss_total': {0: 5.0, 1: 4.0, 2: 3.0}}
    """
    label = label or folder.name
    if any(folder.glob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        accumulator.Reload()
        scalars = {
            tag: {int(e.step): float(e.value) for e in accumulator.Scalars(tag)}
            for tag in accumulator.Tags()["scalars"]
        }
    else:
        scalars = read_csv(folder / "metrics.csv")
    return RunScalars(folder, label, scalars, config=read_config(folder), end=read_end(folder))


def read_config(folder: Path) -> dict[str, Any]:
    """The run's ``config.yaml`` (written by ``lit-losses fit``) as dotted option paths, or ``{}``."""
    path = folder / "config.yaml"
    if not path.is_file():
        return {}
    loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    return flatten(loaded) if isinstance(loaded, dict) else {}


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``{"a.b.c": value}``; lists (regularizers, callbacks) as one value each.

    Example:
        >>> flatten({"model": {"init_args": {"loss_agg": "token-mean", "regularizers": [{"name": "z"}]}}})
        {'model.init_args.loss_agg': 'token-mean', 'model.init_args.regularizers': "[{'name': 'z'}]"}
    """
    flat: dict[str, Any] = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat |= flatten(value, f"{path}.")
        else:
            flat[path] = str(value) if isinstance(value, list) else value
    return flat


def read_end(folder: Path) -> dict[str, Any]:
    """The run's ``run_end.json``; ``{}`` while the run goes on (or for a run of another tool)."""
    path = folder / "run_end.json"
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except json.JSONDecodeError:
        return {}


RUN_SPECIFIC = ("default_root_dir", "save_dir", "version", "dirpath", "ckpt_path", "name")
"""Option names whose values differ between any two runs (folders, versions): not a difference of setup."""


def config_differences(runs: list[RunScalars]) -> dict[str, list[Any]]:
    """The options whose values differ between the runs (``-`` where a run has no such option), folders and
    versions left out.

    Example:
        >>> a = RunScalars(Path("a"), "a", config={"model.lr": 0.1, "trainer.default_root_dir": "a"})
        >>> b = RunScalars(Path("b"), "b", config={"model.lr": 0.2, "trainer.default_root_dir": "b"})
        >>> config_differences([a, b])
        {'model.lr': [0.1, 0.2]}
    """
    keys = sorted({k for r in runs for k in r.config if k.rpartition(".")[2] not in RUN_SPECIFIC})
    rows = {k: [r.config.get(k, "-") for r in runs] for k in keys}
    return {k: values for k, values in rows.items() if len({repr(v) for v in values}) > 1}


def final_values(runs: list[RunScalars], tags: tuple[str, ...]) -> dict[str, list[float | None]]:
    """The last finite value of each tag in each run (``None`` where a run did not log it); tags that no
    run logged are left out."""
    table = {}
    for tag in tags:
        values = [finite(r.scalars[tag])[1][-1:] if tag in r.scalars else [] for r in runs]
        if any(values):
            table[tag] = [v[0] if v else None for v in values]
    return table


def read_csv(path: Path) -> dict[str, Series]:
    """The scalars of a `CSVLogger`'s ``metrics.csv`` (a row per step and logging call; empty cells out)."""
    scalars: dict[str, Series] = {}
    with path.open(newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            step = row.get("step")
            if not step:
                continue
            for tag, cell in row.items():
                if tag in ("step", "epoch") or cell in ("", None):
                    continue
                value = float(cell)
                scalars.setdefault(tag, {})[int(float(step))] = value
    return scalars


def read_runs(folders: list[str | Path]) -> list[RunScalars]:
    """The runs of every folder given, labelled by their paths relative to what the folders share.

    Raises:
        NoEventsError: a folder holds no run, or a run folder holds no scalar yet.
    """
    found = [run for folder in folders for run in run_folders(folder)]
    labels = run_labels(found)
    runs = [read_run(folder, label) for folder, label in zip(found, labels, strict=True)]
    for run in runs:
        if not run.scalars:
            raise NoEventsError(f"report: {str(run.folder)!r} holds no logged scalar yet")
    return runs


def run_labels(folders: list[Path]) -> list[str]:
    """Short distinct names: each folder's path below the folders' common parent.

    Example:
        >>> run_labels([Path("runs/a/tb/version_0"), Path("runs/b/tb/version_0")])
        ['a/tb/version_0', 'b/tb/version_0']
        >>> run_labels([Path("runs/a/tb/version_0")])
        ['version_0']
    """
    if len(folders) == 1:
        return [folders[0].name]
    resolved = [f.resolve() for f in folders]
    parts = list(zip(*(r.parts for r in resolved), strict=False))
    common = 0
    while common < len(parts) and len(set(parts[common])) == 1:
        common += 1
    return [str(Path(*r.parts[common:])) if len(r.parts) > common else r.name for r in resolved]


def finite(series: Series) -> tuple[list[int], list[float]]:
    """The steps and values of a series, in step order, without non-finite values (plots skip them)."""
    steps = sorted(s for s, v in series.items() if math.isfinite(v))
    return steps, [series[s] for s in steps]
