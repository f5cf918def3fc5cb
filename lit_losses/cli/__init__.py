"""The command-line application around the library: ``lit-losses``.

`entry` (the console script: `main`), `app` (LightningCLI: ``fit``, ``validate``, ``predict``, ``test``),
`report` (``report``: the HTML report of runs, with `report_data`), `checkpoint` (``checkpoint``), `console`
(progress bar, quiet third-party output), `run_dir` (each run's own log folder and config file), `run_end`
(the end summary and ``run_end.json``), `objective_line` (what a run optimized, as one line),
`trainer_errors` (Lightning's refusals as one line), `import_hint` (a missing package named by its extra).
The library (everything else in `lit_losses`) never imports this subpackage. The names of `app` are
imported on first use, so that ``lit-losses report`` and ``lit-losses --version`` start without torch or
Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lit_losses.cli.entry import main
from lit_losses.lazy import lazy_exports

if TYPE_CHECKING:
    from lit_losses.cli.app import LitLossesCLI, LitLossesParser, cli_main, slurm_requeue

__all__ = ["LitLossesCLI", "LitLossesParser", "cli_main", "main", "slurm_requeue"]

_EXPORTS = {
    name: "lit_losses.cli.app" for name in ("LitLossesCLI", "LitLossesParser", "cli_main", "slurm_requeue")
}

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
