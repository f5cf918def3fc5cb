"""``lit-losses report``: the plotted numbers are the logged ones, two runs overlay, no events: one error."""

from __future__ import annotations

import json
import re
import sys

import pytest

from lit_losses.cli.app import main
from lit_losses.cli.report import panels
from lit_losses.cli.report_data import read_runs
from tests.cli_runs import fit_short, read_scalars, run_folder

ABLATION = "--model.init_args.regularizers=[{name: z_loss, weight: 1.0e-4}]"  # entropy off


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The main job (regularizers under a controller), short, and the same with the entropy term off."""
    root = tmp_path_factory.mktemp("report")
    fit_short(root / "full")
    fit_short(root / "no_entropy", ABLATION)
    return run_folder(root / "full"), run_folder(root / "no_entropy")


def run_report(monkeypatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", ["lit-losses", "report", *args])
    main()


def embedded_data(page: str) -> list[dict]:
    (data,) = re.findall(r'<script type="application/json" id="plotted-data">(.*?)</script>', page, re.S)
    return json.loads(data)


def test_report_plots_exactly_the_logged_values_of_two_runs(two_runs, tmp_path, monkeypatch, capsys):
    out = tmp_path / "ablation.html"
    run_report(monkeypatch, *map(str, two_runs), "--out", str(out))
    assert f"report written to {out}" in capsys.readouterr().out
    page = out.read_text()
    assert page.count('src="data:image/png;base64,') >= 6  # self-contained: every figure inline
    plotted = {p["title"]: p for p in embedded_data(page)}
    logged = [read_scalars(folder) for folder in two_runs]
    labels = [r.label for r in read_runs(list(two_runs))]
    checked = 0
    for title, tag, name in [
        ("Training loss", "train/loss_total", "train/loss_total"),
        ("Training loss", "train/base_loss", "train/base_loss"),
        ("Training loss", "train/regularizer_total", "train/regularizer_total"),
        ("Regularizer values", "regularizers/z_loss/value", "regularizers/z_loss/value"),
        ("Regularizer weights", "regularizers/z_loss/weight", "regularizers/z_loss/weight"),
        ("Validation loss", "val/loss", "val/loss"),
        ("Gradient norms", "regularizers/z_loss/grad_norm", "regularizers/z_loss/grad_norm"),
        ("Learning rate", "lr-AdamW/pg1", "lr-AdamW/pg1"),
    ]:
        for label, scalars in zip(labels, logged):
            (line,) = [ln for ln in plotted[title]["lines"] if ln["label"] == f"{label}: {name}"]
            assert dict(zip(line["steps"], line["values"])) == scalars[tag], (title, label)
            checked += 1
    assert checked == 16
    values = plotted["Regularizer values"]["lines"]
    entropy = [ln["label"] for ln in values if ln["label"].endswith("/entropy/value")]
    assert entropy == [f"{labels[0]}: regularizers/entropy/value"]  # only the run that has the term
    (stacked,) = [p for t, p in plotted.items() if t == f"Regularizer contributions (stacked): {labels[0]}"]
    assert {ln["label"]: dict(zip(ln["steps"], ln["values"])) for ln in stacked["lines"]} == {
        name: logged[0][f"regularizers/{name}/contribution"] for name in ("entropy", "z_loss")
    }


def test_a_folder_without_events_is_one_error_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as stopped:
        run_report(monkeypatch, str(tmp_path / "empty"))
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lit-losses: error: report: ")
    assert "holds no TensorBoard event file" in err


def test_controller_firings_recoveries_and_skipped_steps_are_marked_where_logged(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(tmp_path) as writer:
        for step in range(10):
            writer.add_scalar("train/loss_total", 1.0 / (step + 1), step)
            writer.add_scalar("train/non_finite_step", float(step == 7), step)
        for step in (3, 5):
            writer.add_scalar("controller/recover/fired", 1.0, step)
        writer.add_scalar("controller/recover/rollback", 1.0, 5)
    (loss, *_) = panels(read_runs([tmp_path]))
    assert {m.label: m.steps for m in loss.markers} == {
        "controller/recover/fired": [3, 5],
        "controller/recover/rollback": [5],
        "train/non_finite_step": [7],
    }
