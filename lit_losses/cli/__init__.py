"""The command-line application around the library: ``lit-losses``.

`app` (LightningCLI entry point: ``fit``, ``validate``, ``predict``, ``test``; ``report``), `console`
(progress bar, quiet third-party output), `run_dir` (each run's own log folder and config file),
`run_end` (the end summary and ``run_end.json``), `report` and `report_data` (the HTML report of runs),
`objective_line` (what a run optimized, as one line), `trainer_errors` (Lightning's refusals as one line),
`import_hint` (a missing package named by its extra).
The library (everything else in `lit_losses`) never imports this subpackage.
"""

from lit_losses.cli.app import LitLossesCLI, LitLossesParser, cli_main, main, slurm_requeue

__all__ = ["LitLossesCLI", "LitLossesParser", "cli_main", "main", "slurm_requeue"]
