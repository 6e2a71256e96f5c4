"""The leaderboard marks the trials started from ``search.points_to_evaluate`` (tag ``nas.point``: the user's own
archs, the references) and shows them below the top rows with their rank, so a user sees where an own design lands."""

from __future__ import annotations

import csv

from typer.testing import CliRunner

from nas import tracking
from nas.cli import app
from tests.tracking.conftest import QUICKSTART
from tests.tracking.test_leaderboard_ratio import _table


def _tag(runs: dict[str, str], **points: str) -> None:
    """Tag the quickstart store's trials (``a``: BLEU 20, ``b``: 22, both within the budget; ``c``: 24, over it) as
    started from these points."""
    for trial, name in points.items():
        tracking.get_client().set_tag(runs[trial], tracking.TAG_POINT, name)


def test_a_named_trial_below_the_top_is_shown_with_its_rank(quickstart_store):
    _tag(quickstart_store, a="Tiny-S", c="Tiny-L")
    board = tracking.ranked_rows(QUICKSTART, top=1)
    assert [(r.arch, r.point) for r in board.rows] == [("arch-b", None)]
    assert [(rank, r.arch, r.point) for rank, r in board.below] == [(2, "arch-a", "Tiny-S")]  # c breaks the budget
    everything = tracking.ranked_rows(QUICKSTART, top=1, include_infeasible=True)
    assert [r.point for r in everything.rows] == ["Tiny-L"]  # a named trial in the top: no second row for it
    assert [(rank, r.point) for rank, r in everything.below] == [(3, "Tiny-S")]
    by_latency = tracking.ranked_rows(QUICKSTART, top=1, metric="latency_ms", include_infeasible=True)
    assert [r.point for r in by_latency.rows] == ["Tiny-S"] and [(rank, r.point) for rank, r in by_latency.below] \
        == [(3, "Tiny-L")]
    assert tracking.ranked_rows(QUICKSTART, top=1, where=("bleu>=22",)).below == []  # the filters apply to them too


def test_cli_marks_the_named_trials_in_a_point_column_below_the_top(quickstart_store, tmp_path):
    _tag(quickstart_store, a="Tiny-S")
    runner = CliRunner(env={"COLUMNS": "200"})
    result = runner.invoke(app, ["leaderboard", "--top", "1"])
    assert result.exit_code == 0, result.output
    headers, rows = _table(result.stdout)
    assert headers[-1] == "point"
    assert [(r[0], r[2], r[-1]) for r in rows] == [("1", "arch-b", ""), ("2", "arch-a", "Tiny-S")]
    assert "├" in result.stdout  # a line between the top and the named trial below it
    result = runner.invoke(app, ["leaderboard", "--format", "csv", "--out", str(tmp_path / "board.csv")])
    assert result.exit_code == 0, result.output
    with open(tmp_path / "board.csv", newline="", encoding="utf-8") as f:
        assert {r["arch"]: r["point"] for r in csv.DictReader(f)} == {"arch-b": "", "arch-a": "Tiny-S"}


def test_a_leaderboard_without_named_trials_has_no_point_column(quickstart_store):
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["leaderboard"])
    assert result.exit_code == 0, result.output
    assert "point" not in _table(result.stdout)[0]
