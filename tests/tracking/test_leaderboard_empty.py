"""An empty leaderboard says why (an unknown sweep id is bad input, exit 2; a filter no trial meets is named), and
an --out that the table format would ignore is refused (before: an empty table, exit 0, no reason; --out ignored)."""

from __future__ import annotations

from typer.testing import CliRunner

from nas import tracking
from nas.cli import app


def _sweep(mlflow_uri) -> None:
    parent = tracking.start_run("E", "sweep", role="sweep", tags={"nas.sweep_id": "S1"},
                                params={tracking.PARAM_CONSTRAINTS: "latency_ms<=30"})
    for name, latency in (("a", 40.0), ("b", 50.0)):
        run = tracking.start_run("E", name, role="trial", parent_run_id=parent, tags={"nas.arch_summary": name})
        tracking.log_metrics(run, {"bleu": 20.0, "latency_ms": latency})
        tracking.end_run(run)
    tracking.end_run(parent)


def test_an_unknown_sweep_id_is_one_line_naming_the_sweeps_there(mlflow_uri):
    _sweep(mlflow_uri)
    result = CliRunner().invoke(app, ["leaderboard", "--experiment", "E", "--sweep", "nosuch"])
    assert result.exit_code == 2, result.output
    assert "--sweep nosuch: experiment 'E' has no sweep of that id; its sweeps: S1" in " ".join(result.stderr.split())


def test_filters_that_no_trial_meets_are_named(mlflow_uri):
    _sweep(mlflow_uri)
    runner = CliRunner()
    result = runner.invoke(app, ["leaderboard", "--experiment", "E"])  # both break latency_ms<=30
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert "none of the 2 FINISHED trials in experiment E meets its sweep's search.constraints" in said, said
    result = runner.invoke(app, ["leaderboard", "--experiment", "E", "--include-infeasible", "--where", "bleu>30"])
    said = " ".join(result.stderr.split())
    assert "none of the 2 FINISHED trials in experiment E meets --where bleu>30" in said, said
    result = runner.invoke(app, ["leaderboard", "--experiment", "E", "--status", "FAILED"])
    assert "no FAILED trial in experiment E (2 trial runs in all" in " ".join(result.stderr.split())
    result = runner.invoke(app, ["leaderboard", "--experiment", "E", "--include-infeasible"])
    assert result.stderr.strip() == "" and "40.00" in result.stdout  # rows: nothing to explain


def test_out_with_the_table_format_is_refused(mlflow_uri, tmp_path):
    _sweep(mlflow_uri)
    result = CliRunner().invoke(app, ["leaderboard", "--experiment", "E", "--out", str(tmp_path / "lb.csv")])
    assert result.exit_code == 2
    assert "the table is printed, not written; pass --format csv, json or parquet" in " ".join(result.stderr.split())
    assert not (tmp_path / "lb.csv").exists()
