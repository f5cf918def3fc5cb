"""How ``lit-losses`` reads its options: whole names only (no argparse abbreviation), the default classes
of ``model`` and ``data`` wherever a run names its classes (command line, ``--config``, environment,
default config files), and the options a run gives itself."""

from __future__ import annotations

import pytest

from lit_losses.cli.app import cli_main
from lit_losses.cli.report import report_main


def error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("--trainer.max_st=3", "trainer.max_st: not an option of Trainer; did you mean 'max_steps'?"),
        # argparse took this one as --model.init_args.optimizer.lr=0.5, silently
        (
            "--model.init_args.optimizer.l=0.5",
            "model.init_args.optimizer.l: not an option of OptimizerConfig; did you mean 'lr'?",
        ),
        ("--model.dpo.bet=0.2", "model.init_args.dpo.bet: not an option of DPOPreset; did you mean 'beta'?"),
    ],
)
def test_an_abbreviated_option_is_refused_with_the_closest_name(option, expected, capsys):
    with pytest.raises(SystemExit) as stop:
        cli_main(["fit", option, "--print_config"])
    assert stop.value.code == 2
    assert error_line(capsys) == f"lit-losses: error: {expected}"


def test_an_abbreviated_report_option_is_refused(tmp_path, capsys):
    (tmp_path / "metrics.csv").write_text("epoch,step,train/loss_total\n0,0,4.0\n")
    with pytest.raises(SystemExit) as stop:
        report_main([str(tmp_path), "--ou", str(tmp_path / "r.html")])  # argparse took it as --out
    assert stop.value.code == 2
    assert error_line(capsys).startswith("lit-losses: error: report: unrecognized arguments: --ou")
    assert not (tmp_path / "r.html").exists()
