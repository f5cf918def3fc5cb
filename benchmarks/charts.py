"""Draw the charts of the docs' benchmarks page from ``benchmarks/current.yaml`` (rerunnable).

One PNG per figure, ``docs/assets/benchmarks/<id>.png``: a horizontal bar chart per numeric column, the
package's own rows highlighted, the target (if the figure has one) as a dashed line. The page's tables are
made from the same file when the docs are built (``docs/hooks.py``), so that tables and charts never
disagree.

Usage: ``python benchmarks/charts.py [--data benchmarks/current.yaml] [--out docs/assets/benchmarks]``
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml
from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "current.yaml"
OUT = ROOT / "docs" / "assets" / "benchmarks"


def read_figures(path: Path = DATA) -> list[dict[str, Any]]:
    """The figures of ``current.yaml``, each checked for the fields the page and the charts read."""
    figures = yaml.safe_load(path.read_text(encoding="utf-8"))["figures"]
    for figure in figures:
        missing = {"id", "title", "device", "date", "command", "columns", "rows"} - set(figure)
        if missing:
            raise ValueError(f"{path}: figure {figure.get('id')!r} lacks {sorted(missing)}")
        width = len(figure["columns"])
        if any(len(row) != width for row in figure["rows"]):
            raise ValueError(f"{path}: figure {figure['id']!r} has rows of another width than its columns")
    return figures


def draw(figure: dict[str, Any]) -> Figure:
    """The bar charts of one figure: one panel per numeric column, rows top to bottom as in the table."""
    labels = [str(row[0]) for row in figure["rows"]][::-1]
    columns = figure["columns"][1:]
    highlight = set(figure.get("highlight", ()))
    chart = Figure(figsize=(4.2 * len(columns) + 1.6, 0.42 * len(labels) + 1.2), layout="constrained")
    axes = chart.subplots(1, len(columns), sharey=True, squeeze=False)[0]
    colours = ["tab:orange" if label in highlight else "tab:blue" for label in labels]
    for index, (column, ax) in enumerate(zip(columns, axes, strict=True)):
        values = [float(row[index + 1]) for row in figure["rows"]][::-1]
        ax.barh(labels, values, color=colours)
        for y, value in enumerate(values):
            ax.text(value, y, f" {value:g}", va="center", fontsize="small")
        if "target" in figure:
            ax.axvline(float(figure["target"]), linestyle="--", color="crimson", label="target")
            ax.legend(fontsize="small", loc="lower right")
        ax.set_xlabel(column)
        ax.margins(x=0.18)
    chart.suptitle(f"{figure['title']}\n{figure['device']} · {figure['date']}", fontsize="medium")
    return chart


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--out", type=Path, default=OUT)
    options = parser.parse_args(argv)
    options.out.mkdir(parents=True, exist_ok=True)
    for figure in read_figures(options.data):
        path = options.out / f"{figure['id']}.png"
        draw(figure).savefig(path, dpi=90)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
