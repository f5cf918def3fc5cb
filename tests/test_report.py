"""``lit-losses report``: the plotted numbers are the logged ones, two runs overlay, no events: one error."""

from __future__ import annotations

import json
import re
import sys

import pytest

from lit_losses.cli import main
from lit_losses.cli.report import draw, panels, write_report
from lit_losses.cli.report_data import read_runs
from tests.cli_runs import fit_short, read_scalars, run_folder

ABLATION = "--model.init_args.regularizers=[{name: z_loss, weight: 1.0e-4}]"  # entropy off
DEFAULT_INTERVAL = "--trainer.log_every_n_steps=10"  # the shipped config's: more than the run's 6 steps


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The main job (regularizers under a controller), short, and the same with the entropy term off."""
    root = tmp_path_factory.mktemp("report")
    fit_short(root / "full")
    fit_short(root / "no_entropy", ABLATION, DEFAULT_INTERVAL)
    return run_folder(root / "full"), run_folder(root / "no_entropy")


def run_report(monkeypatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", ["lit-losses", "report", *args])
    main()


def embedded_data(page: str) -> list[dict]:
    (data,) = re.findall(r'<script type="application/json" id="plotted-data">(.*?)</script>', page, re.S)
    return json.loads(data)


def plotted_line(panel: dict, label: str, name: str) -> dict:
    """The line of ``name`` (alone, or among the identical series drawn with it) of run ``label``."""
    (found,) = [
        ln
        for ln in panel["lines"]
        if ln["label"].startswith(f"{label}: ") and name in ln["name"].split(" = ")
    ]
    return found


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
    for title, tag in [
        ("Training loss", "train/loss_total"),
        ("Training loss", "train/base_loss"),
        ("Regularizer total", "train/regularizer_total"),
        ("Regularizer z_loss: value", "regularizers/z_loss/value"),
        ("Regularizer weights", "regularizers/z_loss/weight"),
        ("Validation loss", "val/loss"),
        ("Gradient norms", "regularizers/z_loss/grad_norm"),
        ("Learning rate", "lr-AdamW/pg1"),
    ]:
        for label, scalars in zip(labels, logged):
            line = plotted_line(plotted[title], label, tag)
            assert dict(zip(line["steps"], line["values"])) == scalars[tag], (title, label)
            checked += 1
    assert checked == 16
    entropy = [ln["label"] for ln in plotted["Regularizer entropy: value"]["lines"]]
    assert entropy == [f"{labels[0]}: regularizers/entropy/value"]  # only the run that has the term
    (stacked,) = [p for t, p in plotted.items() if t == f"Regularizer contributions (stacked): {labels[0]}"]
    assert {ln["label"]: dict(zip(ln["steps"], ln["values"])) for ln in stacked["lines"]} == {
        name: logged[0][f"regularizers/{name}/contribution"] for name in ("entropy", "z_loss")
    }


def test_a_short_run_logs_its_training_loss_at_every_step(two_runs):
    """The ablation ran 6 steps with the shipped logging interval of 10: every step is logged all the same."""
    assert sorted(read_scalars(two_runs[1])["train/loss_total"]) == [0, 1, 2, 3, 4, 5]


def test_identical_series_are_drawn_once_and_named_together(tmp_path):
    """Without regularizers ``loss_total`` = ``base_loss``; two parameter groups share one schedule: one line
    each, named together; a series that differs stays apart."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(tmp_path) as writer:
        for step in range(4):
            for tag in ("train/loss_total", "train/base_loss"):
                writer.add_scalar(tag, 5.0 - step, step)
            for tag in ("lr-AdamW/pg1", "lr-AdamW/pg2"):
                writer.add_scalar(tag, 1e-3 * step, step)
            writer.add_scalar("lr-AdamW/pg3", 2e-3 * step, step)
    drawn = {p.title: p for p in panels(read_runs([tmp_path]))}
    assert [ln.name for ln in drawn["Training loss"].lines] == ["train/loss_total = train/base_loss"]
    assert [ln.name for ln in drawn["Learning rate"].lines] == ["lr-AdamW/pg1 = lr-AdamW/pg2", "lr-AdamW/pg3"]
    assert drawn["Training loss"].lines[0].values == [5.0, 4.0, 3.0, 2.0]


def test_overlaid_runs_have_a_colour_each_and_a_table_of_finals_and_differing_options(two_runs, tmp_path):
    page = write_report(list(two_runs), tmp_path / "r.html").read_text()
    runs = read_runs(list(two_runs))
    (loss, *_) = panels(runs)
    colours = {(ln.run, ln.name): line.get_color() for ln, line in zip(loss.lines, draw(loss).axes[0].lines)}
    assert colours[(0, "train/loss_total")] == colours[(0, "train/base_loss")]
    assert colours[(0, "train/loss_total")] != colours[(1, "train/loss_total")]
    final = runs[1].scalars["train/loss_total"][max(runs[1].scalars["train/loss_total"])]
    assert f"<td>{final:.4g}</td>" in page  # the second run's final training loss, in the runs table
    assert "<code>model.init_args.regularizers</code>" in page  # the option the ablation changed
    assert "trainer.log_every_n_steps" in page


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


def test_custom_metrics_are_plotted_and_series_of_other_scales_get_their_own_panel(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(tmp_path) as writer:
        for step in range(3):
            writer.add_scalar("train/loss_total", 3.0, step)
            writer.add_scalar("regularizers/topo/value", 60.0 + step, step)
            writer.add_scalar("regularizers/topo/custom/n_holes", 4.0 + step, step)
            writer.add_scalar("train/base_loss/clip_fraction", 0.02, step)
            writer.add_scalar("train/base_loss/ratio_max", 20.0 + step, step)
            writer.add_scalar("train/my_metric", 0.5, step)  # logged by the user's own model
    drawn = {p.title: [ln.name for ln in p.lines] for p in panels(read_runs([tmp_path]))}
    assert drawn["Regularizer topo: custom metrics"] == ["regularizers/topo/custom/n_holes"]
    assert drawn["RL telemetry (~1e1)"] == ["train/base_loss/ratio_max"]
    assert drawn["RL telemetry (~1e-2)"] == ["train/base_loss/clip_fraction"]
    assert drawn["Other logged scalars"] == ["train/my_metric"]
