"""The leaderboard shows the budget a sweep sets, ``latency_ratio``, with the milliseconds beside it (issue 40)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from nas import tracking
from nas.cli import app
from nas.tracking import LeaderboardRow

EXP = "quickstart"


def _table(stdout: str) -> tuple[list[str], list[list[str]]]:
    """The header cells and the row cells of the rich table in ``stdout``."""
    lines = stdout.splitlines()
    header = next(line for line in lines if "rank" in line)
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in lines if line.count("│") > 6]
    return [c.strip() for c in header.split("┃")[1:-1]], rows


def test_table_shows_the_ratio_with_the_milliseconds_beside_it():
    rows = [LeaderboardRow("0123456789abcdef", "L2", 25.0, 50.0, 12.5, 72.4, 2.1, "A", "x", latency_ratio=1.1234),
            LeaderboardRow("fedcba9876543210", "L4", 20.0, None, None, None, None, None, None)]
    table = tracking.leaderboard_table(rows)
    headers = [str(c.header) for c in table.columns]
    assert headers == ["rank", "run id", "arch", "BLEU", "chrF", "params (M)", "latency ratio", "latency (ms)"]
    assert list(table.columns[6].cells) == ["1.12", "-"] and list(table.columns[7].cells) == ["72.40", "-"]


def test_cli_leaderboard_filters_and_shows_the_quickstart_s_budget(quickstart_store):
    runner = CliRunner(env={"COLUMNS": "200"})
    # the README's old filter: the quickstart's trials take 69-108 ms, so no row and a line saying why
    result = runner.invoke(app, ["leaderboard", "--where", "latency_ms<=20"])
    assert result.exit_code == 0, result.output
    assert _table(result.stdout)[1] == [] and "none of the 3 FINISHED trials" in result.stderr
    # the README's filter: the budget the sweep set
    result = runner.invoke(app, ["leaderboard", "--where", "latency_ratio<=1.25", "--pareto", "--objectives",
                                 "bleu:max,latency_ratio:min", "--plot", "front.png"])
    assert result.exit_code == 0, result.output
    headers, rows = _table(result.stdout)
    at = headers.index("latency ratio")
    assert headers[at + 1] == "latency (ms)"  # the milliseconds beside the ratio
    assert [(r[2], r[at], r[at + 1], r[-1]) for r in rows] == [("arch-b", "1.20", "75.00", "*"),
                                                              ("arch-a", "1.10", "69.00", "*")]
    assert "Pareto front (bleu:max, latency_ratio:min): 2 of 2 matching trials" in result.stdout
    # ranked by the ratio: lowest first, the trial over the budget left out
    result = runner.invoke(app, ["leaderboard", "--metric", "latency_ratio"])
    assert result.exit_code == 0, result.output
    assert [r[1] for r in _table(result.stdout)[1]] == [quickstart_store["a"][:8], quickstart_store["b"][:8]]


def test_pareto_without_objectives_takes_the_newest_sweep_s(tmp_path, monkeypatch):
    """A user who swept against latency_ratio gets that front from `--pareto` alone, not latency_ms's."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.chdir(tmp_path)
    old = tracking.start_run(EXP, "old", role="sweep", tags={"nas.sweep_id": "OLD",
                                                               tracking.TAG_OBJECTIVES: "bleu:max,params_m:min"})
    tracking.end_run(old)
    sweep = tracking.start_run(EXP, "sweep", role="sweep", tags={"nas.sweep_id": "S",
                                                                 tracking.TAG_OBJECTIVES: "bleu:max,latency_ratio:min"})
    for name, bleu, ms, ratio in (("a", 20.0, 90.0, 1.10), ("b", 22.0, 70.0, 1.20)):  # ms and ratio disagree
        run = tracking.start_run(EXP, name, role="trial", parent_run_id=sweep,
                                 tags={"nas.arch_summary": f"arch-{name}", "nas.sweep_id": "S"})
        tracking.log_metrics(run, {"bleu": bleu, "latency_ms": ms, "latency_ratio": ratio, "params_m": 1.0})
        tracking.end_run(run, "FINISHED")
    tracking.end_run(sweep)
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["leaderboard", "--pareto"])
    assert result.exit_code == 0, result.output
    assert "Pareto front (bleu:max, latency_ratio:min): 2 of 2" in result.stdout  # by ms, a would be dominated
