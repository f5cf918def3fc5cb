"""``lit-losses report RUN_DIR [RUN_DIR ...] [--out FILE]``: one self-contained HTML page with a picture of
each run's logged scalars (matplotlib figures embedded as PNG; the plotted numbers embedded as JSON).

Panels, each drawn when its tags were logged (several runs overlay, e.g. an ablation):

- **loss**: ``train/loss_total``, ``train/base_loss``, ``train/regularizer_total``; a controller's firings
  (``controller/<name>/fired``) as dotted vertical lines, spike recoveries (``…/rollback``) dashed, optimizer
  steps skipped for a non-finite loss or gradient (``train/non_finite_step``) dash-dotted;
- **contributions**: each regularizer's ``regularizers/<name>/contribution`` stacked (one panel per run);
- **regularizer values** and **weights** (``regularizers/<name>/value``, ``…/weight``);
- **learning rate** (Lightning's `LearningRateMonitor`: ``lr-<optimizer>[/pg<i>]``);
- **validation loss** (``val/loss``);
- **gradient norms** (tags containing ``grad_norm``);
- **RL telemetry** (``train/base_loss/<metric>``: clip fraction, ratio mean, approximate KL, ...);
- **preference rewards** (``train/rewards/…``: TRL's chosen, rejected, accuracies,
  margins) and **sequence log-probabilities** (``train/logps/…``), with a preference loss.

Works on a run still going (what the logger flushed so far). A folder with no event file and no
``metrics.csv`` is one error line and exit code 2. The telemetry schema: ``docs/concepts/telemetry.md``.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure

from lit_losses.report_data import RunScalars, finite, read_runs

LOSS_TAGS = ("train/loss_total", "train/base_loss", "train/regularizer_total")
MARKER_STYLES = {
    "fired": (":", "crimson"),
    "rollback": ("--", "darkorange"),
    "non_finite_step": ("-.", "black"),
}
"""How the step axis marks a controller firing, a spike recovery, an optimizer step skipped for NaN/Inf."""


@dataclass
class Line:
    """One plotted series: its label, steps and values (the logged values; non-finite ones left out)."""

    label: str
    steps: list[int]
    values: list[float]


@dataclass
class Panel:
    """One figure: a title, its lines, whether they are stacked, and the steps marked on the time axis."""

    title: str
    ylabel: str
    lines: list[Line] = field(default_factory=list)
    stacked: bool = False
    markers: list[Line] = field(default_factory=list)


def line(run: RunScalars, tag: str, name: str | None = None, runs: int = 1) -> Line:
    """The line of ``tag`` in ``run``, labelled with the run's name when several runs overlay."""
    steps, values = finite(run.scalars[tag])
    label = name or tag
    return Line(f"{run.label}: {label}" if runs > 1 else label, steps, values)


def tag_panel(runs: list[RunScalars], title: str, ylabel: str, tags_of) -> Panel:
    """A panel with the tags ``tags_of(run)`` of every run."""
    panel = Panel(title, ylabel)
    for run in runs:
        panel.lines += [line(run, tag, runs=len(runs)) for tag in tags_of(run)]
    return panel


def controller_markers(runs: list[RunScalars]) -> list[Line]:
    """Each run's controller firings and spike recoveries (the steps at which they were logged)."""
    markers = []
    for run in runs:
        for tag in run.tags("controller/", "/fired") + run.tags("controller/", "/rollback"):
            markers.append(line(run, tag, runs=len(runs)))
        if "train/non_finite_step" in run.scalars:  # the steps skipped for a NaN/Inf (value 1)
            skipped = line(run, "train/non_finite_step", runs=len(runs))
            kept = [(step, v) for step, v in zip(skipped.steps, skipped.values, strict=True) if v > 0]
            if kept:
                markers.append(Line(skipped.label, [step for step, _ in kept], [v for _, v in kept]))
    return markers


def panels(runs: list[RunScalars]) -> list[Panel]:
    """What the report draws, in order; panels without any logged tag are left out."""
    loss = tag_panel(
        runs, "Training loss", "loss", tags_of=lambda r: [t for t in LOSS_TAGS if t in r.scalars]
    )
    loss.markers = controller_markers(runs)
    drawn = [loss]
    for run in runs:
        stacked = Panel(f"Regularizer contributions (stacked): {run.label}", "w·r", stacked=True)
        stacked.lines = [
            line(run, tag, tag.split("/")[1]) for tag in run.tags("regularizers/", "/contribution")
        ]
        drawn.append(stacked)
    drawn += [
        tag_panel(runs, "Regularizer values", "r", tags_of=lambda r: r.tags("regularizers/", "/value")),
        tag_panel(runs, "Regularizer weights", "w", tags_of=lambda r: r.tags("regularizers/", "/weight")),
        tag_panel(runs, "Learning rate", "lr", tags_of=lambda r: r.tags("lr-")),
        tag_panel(runs, "Validation loss", "loss", tags_of=lambda r: r.tags("val/loss")),
        tag_panel(
            runs, "Gradient norms", "norm", tags_of=lambda r: [t for t in r.tags() if "grad_norm" in t]
        ),
        tag_panel(runs, "RL telemetry", "value", tags_of=lambda r: r.tags("train/base_loss/")),
        tag_panel(runs, "Preference rewards", "reward", tags_of=lambda r: r.tags("train/rewards/")),
        tag_panel(runs, "Sequence log-probabilities", "log p", tags_of=lambda r: r.tags("train/logps/")),
    ]
    return [p for p in drawn if p.lines]


def draw(panel: Panel) -> Figure:
    """The panel as a matplotlib figure (no pyplot: nothing global, no display needed)."""
    figure = Figure(figsize=(8, 3.4), layout="constrained")
    axes = figure.add_subplot()
    if panel.stacked:
        stack(axes, panel.lines)
    else:
        for ln in panel.lines:
            axes.plot(ln.steps, ln.values, label=ln.label, marker="." if len(ln.steps) < 30 else None)
    for marker in panel.markers:
        style, color = MARKER_STYLES[marker.label.rpartition("/")[2]]
        for step in marker.steps:
            axes.axvline(step, linestyle=style, color=color, alpha=0.7)
        axes.plot([], [], linestyle=style, color=color, label=marker.label)
    axes.set_title(panel.title)
    axes.set_xlabel("step")
    axes.set_ylabel(panel.ylabel)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    return figure


def stack(axes, lines: list[Line]) -> None:
    """Stacked bars, one per step: positive contributions stacked upward, negative ones (a bonus) downward."""
    steps = sorted({s for ln in lines for s in ln.steps})
    up, down = dict.fromkeys(steps, 0.0), dict.fromkeys(steps, 0.0)
    for ln in lines:
        bottoms = [up[s] if v >= 0 else down[s] for s, v in zip(ln.steps, ln.values, strict=True)]
        axes.bar(ln.steps, ln.values, bottom=bottoms, width=1.0, label=ln.label, alpha=0.85)
        for s, v in zip(ln.steps, ln.values, strict=True):
            (up if v >= 0 else down)[s] += v
    axes.axhline(0.0, color="black", linewidth=0.6)


def png_base64(figure: Figure) -> str:
    """The figure as a base64 PNG for an ``<img src="data:...">``."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def plotted_data(drawn: list[Panel]) -> list[dict]:
    """The numbers behind the figures, as embedded in the page (``<script id="plotted-data">``)."""
    return [
        {
            "title": p.title,
            "stacked": p.stacked,
            "lines": [vars(ln) for ln in p.lines],
            "markers": [vars(ln) for ln in p.markers],
        }
        for p in drawn
    ]


def render_html(runs: list[RunScalars], drawn: list[Panel]) -> str:
    """The self-contained page: run list, one image per panel, and the plotted numbers as JSON."""
    items = "".join(
        f"<li><code>{html.escape(str(r.folder))}</code> ({html.escape(r.label)})</li>" for r in runs
    )
    figures = "".join(
        f'<h2>{html.escape(p.title)}</h2><img alt="{html.escape(p.title)}" '
        f'src="data:image/png;base64,{png_base64(draw(p))}">'
        for p in drawn
    )
    data = json.dumps(plotted_data(drawn)).replace("</", "<\\/")
    return (
        '<!DOCTYPE html><html><head><meta charset="utf-8"><title>lit-losses report</title>'
        "<style>body{font-family:sans-serif;max-width:900px;margin:auto}img{max-width:100%}</style>"
        f"</head><body><h1>lit-losses report</h1><ul>{items}</ul>{figures}"
        f'<script type="application/json" id="plotted-data">{data}</script></body></html>\n'
    )


def write_report(folders: list[str | Path], out: str | Path | None = None) -> Path:
    """Read the runs in ``folders`` and write the HTML page to ``out`` (default:
    ``<first folder>/report.html``); returns its path.

    Raises:
        NoEventsError: a folder holds no run (`lit_losses.report_data.NoEventsError`).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:  # a CSVLogger's run (TensorBoard event files alike)
        ...     _ = (Path(tmp) / "metrics.csv").write_text(
        ...         "epoch,step,train/loss_total,regularizers/z_loss/contribution\\n"
        ...         "0,0,4.0,0.01\\n0,1,3.0,0.01\\n0,2,2.0,0.01\\n"
        ...     )
        ...     page = write_report([tmp]).read_text()
        >>> [p["title"] for p in json.loads(page.split('id="plotted-data">')[1].split("</script>")[0])]
        ['Training loss', 'Regularizer contributions (stacked): ...']
    """
    runs = read_runs(folders)
    path = Path(out) if out else Path(folders[0]) / "report.html"
    path.write_text(render_html(runs, panels(runs)), encoding="utf-8")
    return path


def report_main(args: list[str]) -> None:
    """``lit-losses report``: errors as one line and exit code 2."""
    parser = argparse.ArgumentParser(
        prog="lit-losses report",
        description="Write one HTML page with plots of the logged scalars of one or more runs.",
    )
    parser.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="a run's log folder (or a folder above runs)"
    )
    parser.add_argument("--out", help="the HTML file to write (default: <first RUN_DIR>/report.html)")
    options = parser.parse_args(args)
    try:
        path = write_report(options.run_dirs, options.out)
    except (ValueError, OSError) as err:
        print(f"lit-losses: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"lit-losses: report written to {path}")
