"""Draw the home page's picture of a report: the training-loss panel of a run, as ``lit-losses report``
draws it (``docs/assets/report-loss.png``).

Usage: ``python docs/report_picture.py RUN_DIR`` (e.g. the run folder of ``make fit``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from lit_losses.cli.report import draw, panels
from lit_losses.cli.report_data import read_runs

OUT = Path(__file__).resolve().parent / "assets" / "report-loss.png"


def main(run_dir: str) -> None:
    drawn = {panel.title: panel for panel in panels(read_runs([run_dir]))}
    figure = draw(drawn["Training loss"])
    figure.savefig(OUT, dpi=80)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main(sys.argv[1])
