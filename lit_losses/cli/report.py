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

import base64
import html
import io
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure

from lit_losses.cli.arguments import OneLineArgumentParser
from lit_losses.cli.objective_line import describe_objective
from lit_losses.cli.report_data import RunScalars, config_differences, final_values, finite, read_runs
from lit_losses.errors import ConfigError

LOSS_TAGS = ("train/loss_total", "train/base_loss")
VAL_TAGS = ("val/loss", "val/loss_total")
MARKER_STYLES = {
    "fired": (":", "crimson"),
    "rollback": ("--", "darkorange"),
    "non_finite_step": ("-.", "black"),
}
"""How the step axis marks a controller firing, a spike recovery, an optimizer step skipped for NaN/Inf."""
LINE_STYLES = ("-", "--", ":", "-.")
"""Overlaid runs: one colour per run, one line style per series."""


@dataclass
class Line:
    """One plotted series: its label, steps and values (the logged values; non-finite ones left out), the
    run it belongs to (its index in the report) and its series name (a tag, or tags that logged the same)."""

    label: str
    steps: list[int]
    values: list[float]
    run: int = 0
    name: str = ""


@dataclass
class Panel:
    """One figure: a title, its lines, whether they are stacked, and the steps marked on the time axis."""

    title: str
    ylabel: str
    lines: list[Line] = field(default_factory=list)
    stacked: bool = False
    markers: list[Line] = field(default_factory=list)
    runs: int = 1


def line(run: RunScalars, tag: str, name: str | None = None, runs: int = 1, index: int = 0) -> Line:
    """The line of ``tag`` in ``run``, labelled with the run's name when several runs overlay."""
    steps, values = finite(run.scalars[tag])
    label = name or tag
    return Line(f"{run.label}: {label}" if runs > 1 else label, steps, values, run=index, name=label)


def merge_identical(lines: list[Line], runs: list[RunScalars]) -> list[Line]:
    """Series of one run that logged the same numbers at the same steps, drawn once and named together
    (``train/loss_total = train/base_loss`` without regularizers, two learning-rate groups, ...)."""
    merged: dict[tuple, Line] = {}
    for ln in lines:
        key = (ln.run, tuple(ln.steps), tuple(ln.values))
        if key in merged:
            kept = merged[key]
            kept.name = f"{kept.name} = {ln.name}"
            prefix = f"{runs[ln.run].label}: " if len(runs) > 1 else ""
            kept.label = f"{prefix}{kept.name}"
        else:
            merged[key] = ln
    return list(merged.values())


def tag_panel(runs: list[RunScalars], title: str, ylabel: str, tags_of) -> Panel:
    """A panel with the tags ``tags_of(run)`` of every run, identical series of a run merged."""
    panel = Panel(title, ylabel, runs=len(runs))
    for index, run in enumerate(runs):
        panel.lines += [line(run, tag, runs=len(runs), index=index) for tag in tags_of(run)]
    panel.lines = merge_identical(panel.lines, runs)
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


def term_names(runs: list[RunScalars]) -> list[str]:
    """The regularizers any run logged a value of, sorted."""
    return sorted({t.split("/")[1] for r in runs for t in r.tags("regularizers/", "/value")})


def scale_of(values: list[float]) -> int:
    """The decade of a series' largest magnitude (``-2`` for values up to about 0.05), for grouping."""
    largest = max((abs(v) for v in values), default=0.0)
    return math.floor(math.log10(largest)) if largest > 0 else -99


def scale_panels(runs: list[RunScalars], title: str, tags_of) -> list[Panel]:
    """The tags ``tags_of(run)`` in panels of series of one decade each, so that none flattens another."""
    by_scale: dict[int, list[str]] = {}
    for run in runs:
        for tag in tags_of(run):
            by_scale.setdefault(scale_of(finite(run.scalars[tag])[1]), []).append(tag)
    drawn = []
    for scale in sorted(by_scale, reverse=True):
        tags = set(by_scale[scale])
        name = title if len(by_scale) == 1 else f"{title} (~1e{scale})"
        drawn.append(
            tag_panel(runs, name, "value", tags_of=lambda r, tags=tags: sorted(tags & set(r.scalars)))
        )
    return drawn


def regularizer_panels(runs: list[RunScalars]) -> list[Panel]:
    """The regularizer total on its own axis, each run's stacked contributions, one panel per term's value
    (a z-loss of ~60 does not flatten a term of ~4), the weights, and each term's custom metrics."""
    drawn = [
        tag_panel(runs, "Regularizer total", "Σ w·r", tags_of=lambda r: r.tags("train/regularizer_total"))
    ]
    for run in runs:
        stacked = Panel(f"Regularizer contributions (stacked): {run.label}", "w·r", stacked=True)
        stacked.lines = [
            line(run, tag, tag.split("/")[1]) for tag in run.tags("regularizers/", "/contribution")
        ]
        drawn.append(stacked)
    for name in term_names(runs):
        drawn.append(
            tag_panel(
                runs,
                f"Regularizer {name}: value",
                "r",
                tags_of=lambda r, n=name: r.tags(f"regularizers/{n}/value"),
            )
        )
    drawn.append(
        tag_panel(runs, "Regularizer weights", "w", tags_of=lambda r: r.tags("regularizers/", "/weight"))
    )
    custom = sorted({t.split("/")[1] for r in runs for t in r.tags("regularizers/") if "/custom/" in t})
    for name in custom:
        drawn += scale_panels(
            runs,
            f"Regularizer {name}: custom metrics",
            tags_of=lambda r, n=name: r.tags(f"regularizers/{n}/custom/"),
        )
    return drawn


def other_tags(run: RunScalars, drawn: list[Panel]) -> list[str]:
    """The tags of ``run`` that no panel draws (custom metrics a model logged itself, ...)."""
    shown = {tag for panel in drawn for ln in panel.lines for tag in ln.name.split(" = ")}
    return [
        t
        for t in run.tags()
        if t not in shown
        and t not in ("epoch", "train/non_finite_step")
        and not t.startswith(("controller/", "regularizers/"))
    ]


def panels(runs: list[RunScalars]) -> list[Panel]:
    """What the report draws, in order; panels without any logged tag are left out."""
    loss = tag_panel(
        runs, "Training loss", "loss", tags_of=lambda r: [t for t in LOSS_TAGS if t in r.scalars]
    )
    drawn = [loss, *regularizer_panels(runs)]
    drawn += [
        tag_panel(runs, "Learning rate", "lr", tags_of=lambda r: r.tags("lr-")),
        tag_panel(runs, "Validation loss", "loss", tags_of=lambda r: [t for t in VAL_TAGS if t in r.scalars]),
        tag_panel(
            runs, "Gradient norms", "norm", tags_of=lambda r: [t for t in r.tags() if "grad_norm" in t]
        ),
        *scale_panels(runs, "RL telemetry", tags_of=lambda r: r.tags("train/base_loss/")),
        *scale_panels(runs, "Preference rewards", tags_of=lambda r: r.tags("train/rewards/")),
        *scale_panels(runs, "Sequence log-probabilities", tags_of=lambda r: r.tags("train/logps/")),
    ]
    drawn += scale_panels(runs, "Other logged scalars", tags_of=lambda r: other_tags(r, drawn))
    markers = controller_markers(runs)
    for panel in drawn:
        panel.runs = len(runs)
        if not panel.stacked:
            panel.markers = markers
    return [p for p in drawn if p.lines]


def draw(panel: Panel) -> Figure:
    """The panel as a matplotlib figure (no pyplot: nothing global, no display needed). Overlaid runs
    have one colour each and one line style per series; a single run one colour per series."""
    figure = Figure(figsize=(8, 3.4), layout="constrained")
    axes = figure.add_subplot()
    if panel.stacked:
        stack(axes, panel.lines)
    else:
        names = list(dict.fromkeys(ln.name for ln in panel.lines))
        for ln in panel.lines:
            style = {"label": ln.label, "marker": "." if len(ln.steps) < 30 else None}
            if panel.runs > 1:
                style |= {"color": f"C{ln.run % 10}", "linestyle": LINE_STYLES[names.index(ln.name) % 4]}
            axes.plot(ln.steps, ln.values, **style)
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


FINAL_TAGS = ("train/loss_total", "train/base_loss", "train/regularizer_total", "val/loss")
"""The final values the run table shows first (then every ``val/`` tag a run logged)."""


def html_table(header: list[str], rows: list[list[str]]) -> str:
    """A plain HTML table of already-escaped cells."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def cell(value: object) -> str:
    """A value as table text: 4 significant digits for numbers, ``-`` for none."""
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else html.escape(str(value))


def runs_table(runs: list[RunScalars]) -> str:
    """Each run: its folder, why it ended and at which step, what it optimized after presets
    (``run_end.json``), its final values."""
    val_tags = sorted({t for r in runs for t in r.tags("val/")} - set(FINAL_TAGS))
    finals = final_values(runs, (*FINAL_TAGS, *val_tags))
    header = ["run", "folder", "ended", "step", "objective", *map(html.escape, finals)]
    rows = [
        [
            html.escape(r.label),
            f"<code>{html.escape(str(r.folder))}</code>",
            cell(r.end.get("reason")),
            cell(r.end.get("step")),
            cell(describe_objective(r.end["objective"]) if r.end.get("objective") else None),
            *(cell(values[i]) for values in finals.values()),
        ]
        for i, r in enumerate(runs)
    ]
    return html_table(header, rows)


def differences_table(runs: list[RunScalars]) -> str:
    """The options whose values differ between the runs (from each run's ``config.yaml``)."""
    differences = config_differences(runs)
    if len(runs) < 2:
        return ""
    if not differences:
        return "<h2>Options that differ</h2><p>none (or no <code>config.yaml</code> in the run folders)</p>"
    rows = [[f"<code>{html.escape(k)}</code>", *map(cell, values)] for k, values in differences.items()]
    return "<h2>Options that differ</h2>" + html_table(
        ["option", *(html.escape(r.label) for r in runs)], rows
    )


def render_html(runs: list[RunScalars], drawn: list[Panel]) -> str:
    """The self-contained page: the runs and their final values, the options that differ between them,
    one image per panel, and the plotted numbers as JSON."""
    figures = "".join(
        f'<h2>{html.escape(p.title)}</h2><img alt="{html.escape(p.title)}" '
        f'src="data:image/png;base64,{png_base64(draw(p))}">'
        for p in drawn
    )
    data = json.dumps(plotted_data(drawn)).replace("</", "<\\/")
    style = (
        "body{font-family:sans-serif;max-width:900px;margin:auto}img{max-width:100%}"
        "table{border-collapse:collapse;font-size:small}td,th{border:1px solid #ccc;padding:2px 6px}"
    )
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>lit-losses report</title><style>{style}'
        f"</style></head><body><h1>lit-losses report</h1><h2>Runs</h2>{runs_table(runs)}"
        f"{differences_table(runs)}{figures}"
        f'<script type="application/json" id="plotted-data">{data}</script></body></html>\n'
    )


def write_report(folders: list[str | Path], out: str | Path | None = None) -> Path:
    """Read the runs in ``folders`` and write the HTML page to ``out`` (default:
    ``<first folder>/report.html``); returns its path.

    Raises:
        NoEventsError: a folder holds no run (`lit_losses.cli.report_data.NoEventsError`).
        ConfigError: ``out`` is a folder, in a folder that does not exist, or cannot be written (naming
            ``--out``).

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
    path = Path(out) if out else Path(folders[0]) / "report.html"
    where = f"--out {out}" if out else f"the report file {path} (choose another with --out)"
    if path.is_dir():
        raise ConfigError(f"{where} is a folder; give a file name, e.g. --out {path / 'report.html'}")
    if out and not path.parent.is_dir():
        raise ConfigError(f"{where}: its folder {path.parent} does not exist")
    runs = read_runs(folders)
    try:
        path.write_text(render_html(runs, panels(runs)), encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{where} cannot be written ({err.strerror or err})") from None
    return path


def report_main(args: list[str]) -> None:
    """``lit-losses report``: errors as one line and exit code 2."""
    parser = OneLineArgumentParser(
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
