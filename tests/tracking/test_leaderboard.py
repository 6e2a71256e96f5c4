"""Leaderboard filters, paging, the Pareto front and its plot, against a real MLflow store (SQLite)."""

from __future__ import annotations

import math
import random

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from nas import tracking
from nas.cli import app
from nas.tracking.plots import PARETO_PLOT, log_pareto_plot, pareto_png
from nas.tracking import DEFAULT_OBJECTIVES, Objective, pareto_mask
from tests.conftest import EXP

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _brute_force_front(points, maximize):
    """O(n^2) reference: i is on the front iff it is complete and no complete j dominates it."""
    def ok(p):
        return all(v is not None and not math.isnan(v) for v in p)

    def better_eq(a, b, up):
        return a >= b if up else a <= b

    def dominates(a, b):
        return (all(better_eq(x, y, up) for x, y, up in zip(a, b, maximize))
                and any(x != y for x, y in zip(a, b)))

    return [ok(p) and not any(ok(q) and dominates(q, p) for q in points) for p in points]


@pytest.mark.parametrize("seed", range(6))
def test_pareto_mask_matches_brute_force_on_random_points_with_ties_and_gaps(seed):
    rng = random.Random(seed)
    for n in (0, 1, 2, 7, 60):
        for k in (1, 2, 3):
            maximize = [rng.random() < 0.5 for _ in range(k)]
            points = []
            for _ in range(n):
                p = [float(rng.randint(0, 5)) for _ in range(k)]  # few values: many ties and duplicates
                if rng.random() < 0.1:
                    p[rng.randrange(k)] = rng.choice([None, math.nan])
                points.append(p)
            assert pareto_mask(points, maximize) == _brute_force_front(points, maximize), (points, maximize)


def test_pareto_mask_bleu_up_latency_down_keeps_duplicates_and_rejects_bad_points():
    #          t1          t2          t3          t4          t3 again
    points = [(20, 30), (25, 50), (22, 10), (18, 20), (22, 10)]
    assert pareto_mask(points, [True, False]) == [False, True, True, False, True]
    assert pareto_mask([(1, None), (0, 5)], [True, False]) == [False, True]
    with pytest.raises(ValueError, match="point 1 has 1 values, expected 2"):
        pareto_mask([(1, 2), (3,)], [True, False])
    with pytest.raises(ValueError, match="at least one objective"):
        pareto_mask([(1,)], [])


def test_status_filter_selects_failed_running_or_all(populated):
    ids = {v: k for k, v in populated.items()}

    def names(**kw):
        return {ids[r.run_id] for r in tracking.leaderboard(EXP, top=100, **kw)}

    assert names(status="FAILED") == {"failed"}
    assert names(status="RUNNING") == {"running"}
    assert names(status="all") == {"t1", "t2", "t3", "t4", "failed", "running", "b1"}  # never the supernet
    assert names() == {"t1", "t2", "t3", "t4", "b1"}
    with pytest.raises(ValueError, match="unknown status 'DONE'"):
        tracking.leaderboard(EXP, status="DONE")


def test_where_constraints_filter_in_the_store_and_bad_ones_are_named(populated):
    ids = {v: k for k, v in populated.items()}
    rows = tracking.leaderboard(EXP, top=100, where=["latency_ms<=30"])
    assert [ids[r.run_id] for r in rows] == ["t3", "t1", "t4"]  # by BLEU
    rows = tracking.leaderboard(EXP, top=100, where=["latency_ms <= 30", "bleu>19", "chrf != 48"])
    assert [ids[r.run_id] for r in rows] == ["t1"]
    assert tracking.leaderboard(EXP, where=["params_m==50"])[0].run_id == populated["b1"]
    with pytest.raises(ValueError, match=r"bad constraint 'latency_ms<<40': expected METRIC OP NUMBER"):
        tracking.leaderboard(EXP, where=["latency_ms<<40"])
    with pytest.raises(ValueError, match=r"unknown metric 'latncy_ms'; expected one of bleu"):
        tracking.leaderboard(EXP, where=["latncy_ms<=40"])
    with pytest.raises(ValueError, match=r"bad constraint 'bleu>=abc': expected METRIC OP NUMBER"):
        tracking.leaderboard(EXP, where=["bleu>=abc"])
    with pytest.raises(ValueError, match=r"'1e999' is not a finite number"):
        tracking.leaderboard(EXP, where=["bleu>=1e999"])


@pytest.fixture
def search_calls(monkeypatch):
    """Counts the real MlflowClient.search_runs calls for trial runs and the max_results each asked for (the one
    query for the sweeps' parent runs, whose constraints judge the trials, is not counted)."""
    calls = []
    original = MlflowClient.search_runs

    def counting(self, *args, **kwargs):
        if "'trial'" in (args[1] if len(args) > 1 else kwargs.get("filter_string", "")):
            calls.append(args[3] if len(args) > 3 else kwargs.get("max_results"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "search_runs", counting)
    return calls


def test_top_stops_paging_once_found_and_the_front_scans_every_page(populated, search_calls):
    rows = tracking.leaderboard(EXP, top=2, page_size=1)
    assert [r.run_id for r in rows] == [populated["b1"], populated["t2"]]
    assert search_calls == [1, 1]  # two pages of one run, then stop: 3 more trials are never fetched
    search_calls.clear()
    assert len(tracking.leaderboard(EXP, top=3, page_size=2)) == 3
    assert search_calls == [2, 1]
    search_calls.clear()
    scan = tracking.pareto_scan(EXP, DEFAULT_OBJECTIVES, top=1, page_size=2)
    assert scan.scanned == 5 and len(search_calls) == 3  # pages of 2, 2, 1
    assert [r.run_id for r in scan.rows] == [populated["b1"]]


@pytest.fixture
def many_trials(mlflow_uri):
    """60 finished trials of sweep S with random BLEU/latency/params (ties included)."""
    client = tracking.get_client()
    tracking.start_run(EXP, "sweep-s", role="sweep", tags={"nas.sweep_id": "S"})
    exp_id = tracking.ensure_experiment(EXP)
    rng = random.Random(7)
    values = {}
    for i in range(60):
        run_id = client.create_run(exp_id, tags={"nas.role": "trial", "nas.sweep_id": "S",
                                                 "nas.arch_summary": f"a{i}"}).info.run_id
        m = {"bleu": float(rng.randint(10, 25)), "latency_ms": float(rng.randint(5, 60)),
             "params_m": float(rng.randint(1, 9))}
        client.log_batch(run_id, metrics=[Metric(k, v, 0, 0) for k, v in m.items()])
        client.set_terminated(run_id)
        values[run_id] = m
    return values


@pytest.mark.parametrize("objectives", ["bleu:max,latency_ms:min", "bleu:max,latency_ms:min,params_m:min",
                                        "latency_ms:min,params_m:max"])
def test_paged_front_equals_the_brute_force_front_of_all_runs(many_trials, objectives):
    objs = tracking.parse_objectives(objectives)
    ids = list(many_trials)
    points = [[many_trials[i][o.metric] for o in objs] for i in ids]
    expected = {i for i, on in zip(ids, _brute_force_front(points, [o.maximize for o in objs])) if on}
    scan = tracking.pareto_scan(EXP, objs, top=5, sweep_id="S", page_size=7, keep_points=True)
    assert {r.run_id for r in scan.front} == expected and all(r.pareto for r in scan.front)
    assert scan.scanned == 60 and sorted(scan.points) == sorted(map(tuple, points))
    first = objs[0]
    best = sorted(ids, key=lambda i: many_trials[i][first.metric], reverse=first.maximize)[:5]
    assert [many_trials[r.run_id][first.metric] for r in scan.rows] == [many_trials[i][first.metric] for i in best]
    assert all(r.pareto == (r.run_id in expected) for r in scan.rows)
    assert [getattr(r, first.metric) for r in scan.front] == sorted(
        (getattr(r, first.metric) for r in scan.front), reverse=first.maximize)


def test_parse_objectives_names_the_bad_item():
    assert tracking.parse_objectives("bleu:max, latency_ms:minimize") == DEFAULT_OBJECTIVES
    with pytest.raises(ValueError, match="bad objective 'bleu' in 'bleu'"):
        tracking.parse_objectives("bleu")
    with pytest.raises(ValueError, match="unknown metric 'speed'"):
        tracking.parse_objectives("bleu:max,speed:min")
    with pytest.raises(ValueError, match="'bleu' appears twice"):
        tracking.parse_objectives("bleu:max,bleu:min")


def test_cli_leaderboard_marks_the_front_filters_and_writes_the_plot(populated, tmp_path):
    runner = CliRunner()
    png = tmp_path / "plots" / "front.png"
    result = runner.invoke(app, ["leaderboard", "--experiment", EXP, "--sweep", "A", "--pareto", "--where",
                                 "latency_ms<=45", "--plot", str(png), "--page-size", "2"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in lines if line.count("│") > 8]
    marked = {c[2] for c in cells if c[-1] == "*"}
    assert marked == {"arch-t3"}  # t2 (latency 50) is filtered out, so t3 dominates t1 and t4
    assert "front" in result.stdout and "1 of 3 matching trials" in result.stdout
    assert png.read_bytes().startswith(PNG_MAGIC) and list(png.parent.iterdir()) == [png]

    result = runner.invoke(app, ["leaderboard", "--experiment", EXP, "--pareto", "--status", "all",
                                 "--format", "json", "--out", str(tmp_path / "lb.json")])
    assert result.exit_code == 0, result.output
    import json

    rows = {r["run_id"]: r["pareto"] for r in json.loads((tmp_path / "lb.json").read_text())}
    # over every status the failed trial (BLEU 99, 1 ms) dominates all others, the running one (98, 2 ms) too
    assert len(rows) == 7 and {k for k, v in rows.items() if v} == {populated["failed"]}

    result = runner.invoke(app, ["leaderboard", "--experiment", EXP, "--where", "latency<=3"])
    assert result.exit_code == 2 and "bad constraint 'latency<=3': unknown metric 'latency'" in result.stderr
    for bad in ("bleu >> 3", "bleu>=1e999"):  # not METRIC OP NUMBER; not finite: bad input too, not a traceback
        result = runner.invoke(app, ["leaderboard", "--experiment", EXP, "--where", bad])
        assert result.exit_code == 2 and f"bad constraint {bad!r}" in result.stderr, (result.output, result.exception)
    result = runner.invoke(app, ["leaderboard", "--experiment", EXP, "--plot", str(tmp_path / "x.png"),
                                 "--objectives", "bleu:max"])
    assert result.exit_code == 2 and "--plot needs exactly two objectives" in result.stderr
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("args", [["--format", "csv", "--out"], ["--format", "parquet", "--out"], ["--plot"]])
def test_cli_leaderboard_file_onto_a_folder_fails_in_one_line_and_leaves_the_folder(populated, tmp_path, args):
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "mine.csv").write_text("keep")
    result = CliRunner().invoke(app, ["leaderboard", "--experiment", EXP, "--pareto", *args, str(folder)])
    assert result.exit_code == 2, result.output
    assert f"{args[-1]}: {folder} is a folder, not a file" in " ".join(result.stderr.split())
    assert result.exception is None or isinstance(result.exception, SystemExit)  # no traceback
    assert [p.name for p in folder.iterdir()] == ["mine.csv"] and not list(tmp_path.glob(".results*"))


def test_sweep_objectives_come_from_the_tag_then_the_yaml_artifact(populated, tmp_path):
    client = tracking.get_client()
    sweep = tracking.find_sweep_run("A", EXP)
    assert tracking.sweep_objectives(sweep) == DEFAULT_OBJECTIVES  # no YAML logged
    yaml_file = tmp_path / "a.yaml"
    yaml_file.write_text("search:\n  metrics: [{name: chrf, goal: maximize}, {name: params_m, goal: minimize}]\n")
    tracking.log_file_artifact(sweep.info.run_id, yaml_file)
    assert tracking.sweep_objectives(sweep) == (Objective("chrf", True), Objective("params_m", False))
    client.set_tag(sweep.info.run_id, "nas.objectives", "bleu:max,params_m:min")
    assert tracking.sweep_objectives(client.get_run(sweep.info.run_id)) == (
        Objective("bleu", True), Objective("params_m", False))
    with pytest.raises(LookupError, match="no sweep with nas.sweep_id 'Z'"):
        tracking.find_sweep_run("Z")


def test_log_pareto_plot_logs_a_png_to_the_sweep_parent_run(populated):
    client = tracking.get_client()
    parent = tracking.find_sweep_run("A", EXP).info.run_id
    assert log_pareto_plot(EXP, "A", parent) == PARETO_PLOT
    assert PARETO_PLOT in [a.path for a in client.list_artifacts(parent)]
    from pathlib import Path

    data = Path(client.download_artifacts(parent, PARETO_PLOT)).read_bytes()
    from PIL import Image
    import io

    assert data.startswith(PNG_MAGIC) and Image.open(io.BytesIO(data)).size == (640, 440)
    empty = tracking.start_run(EXP, "sweep-e", role="sweep", tags={"nas.sweep_id": "E"})
    assert log_pareto_plot(EXP, "E", empty) is None and client.list_artifacts(empty) == []


def test_pareto_png_draws_front_and_rest_in_different_colours():
    from PIL import Image
    import io

    png = pareto_png([(20, 30), (25, 50), (22, 10), (None, 5)], [False, True, True, False], DEFAULT_OBJECTIVES)
    colours = {c for _, c in Image.open(io.BytesIO(png)).convert("RGB").getcolors(1 << 20)}
    assert (214, 39, 40) in colours  # matplotlib's tab:red marks the front
    assert (153, 153, 153) in colours  # grey "0.6" for the dominated trial
    with pytest.raises(ValueError, match="exactly two objectives"):
        pareto_png([(1, 2, 3)], [True], [Objective("bleu", True)] * 3)


@pytest.fixture
def constrained(mlflow_uri):
    """Sweep C under ``latency_ms<=30`` (recorded on its parent run as `nas sweep` does): the two best trials by
    BLEU break it (50 ms; no latency at all), three meet it (one exactly at the bound); sweep U has no
    constraints."""
    from tests.tracking.conftest import _trial

    c = tracking.start_run(EXP, "sweep-c", role="sweep", tags={"nas.sweep_id": "C"},
                           params={tracking.PARAM_CONSTRAINTS: "latency_ms<=30"})
    u = tracking.start_run(EXP, "sweep-u", role="sweep", tags={"nas.sweep_id": "U"})
    ids = {
        "slow": _trial(c, "slow", bleu=30.0, latency_ms=50.0, params_m=3.0),
        "unmeasured": _trial(c, "unmeasured", bleu=28.0, params_m=3.0),
        "u1": _trial(u, "u1", bleu=27.0, latency_ms=60.0, params_m=3.0),
        "ok": _trial(c, "ok", bleu=25.0, latency_ms=20.0, params_m=2.0),
        "edge": _trial(c, "edge", bleu=24.0, latency_ms=30.0, params_m=2.0),
        "fast": _trial(c, "fast", bleu=22.0, latency_ms=10.0, params_m=1.0),
    }
    for sweep in (c, u):
        tracking.end_run(sweep)
    return ids


def test_rankings_keep_the_trials_meeting_their_sweep_s_constraints_unless_asked(constrained):
    names = {v: k for k, v in constrained.items()}
    rows = tracking.leaderboard(EXP, top=10)
    assert [names[r.run_id] for r in rows] == ["u1", "ok", "edge", "fast"]  # u1: its sweep has no constraints
    assert [r.feasible for r in rows] == [None, True, True, True]
    rows = tracking.leaderboard(EXP, top=10, include_infeasible=True)
    assert [(names[r.run_id], r.feasible) for r in rows] == [
        ("slow", False), ("unmeasured", False), ("u1", None), ("ok", True), ("edge", True), ("fast", True)]
    # the top stays full when infeasible trials lead: paging goes on past them
    assert [names[r.run_id] for r in tracking.leaderboard(EXP, sweep_id="C", top=2, page_size=1)] == ["ok", "edge"]
    scan = tracking.pareto_scan(EXP, DEFAULT_OBJECTIVES, sweep_id="C", top=10, page_size=2)
    assert [names[r.run_id] for r in scan.rows] == ["ok", "edge", "fast"] and scan.scanned == 5
    assert {names[r.run_id] for r in scan.front} == {"ok", "fast"} and scan.infeasible == 2
    scan = tracking.pareto_scan(EXP, DEFAULT_OBJECTIVES, sweep_id="C", top=10, include_infeasible=True)
    assert [names[r.run_id] for r in scan.rows] == ["slow", "unmeasured", "ok", "edge", "fast"]
    assert {names[r.run_id] for r in scan.front} == {"ok", "fast"}  # the front: feasible trials only, always
    from nas.space.constraints import parse_constraint

    assert tracking.constraints_by_sweep(EXP) == {"C": (parse_constraint("latency_ms<=30"),), "U": ()}
    assert tracking.describe_constraints(tracking.constraints_by_sweep(EXP)) == "latency_ms<=30 (sweep C)"


def test_best_trial_is_the_best_feasible_one_and_none_feasible_names_the_constraints(constrained):
    from nas.errors import NasError, NotFoundError

    assert tracking.best_trial(EXP, metric="bleu").run_id == constrained["u1"]
    assert tracking.best_trial(EXP, where=["params_m<=2"]).run_id == constrained["ok"]
    assert tracking.best_trial(EXP, where=["params_m<=2"], metric="latency_ms").run_id == constrained["fast"]
    assert tracking.best_trial(EXP, include_infeasible=True).run_id == constrained["slow"]
    with pytest.raises(NasError, match=r"none of the 2 finished trials meeting params_m>=3 and bleu>=28 in experiment 'nas-test' "
                                       r"meets its sweep's search.constraints \(latency_ms<=30 \(sweep C\)\); pass "
                                       r"--include-infeasible"):
        tracking.best_trial(EXP, where=["params_m>=3", "bleu>=28"])
    with pytest.raises(NotFoundError, match="no finished trial meeting bleu>=99"):
        tracking.best_trial(EXP, where=["bleu>=99"])
    other = tracking.start_run("other", "sweep-d", role="sweep", tags={"nas.sweep_id": "D"},
                               params={tracking.PARAM_CONSTRAINTS: "params_m<=1; latency_ms<20"})
    tracking.end_run(other)
    with pytest.raises(NotFoundError, match="no finished trial in experiment 'other'"):
        tracking.best_trial("other")


def test_cli_leaderboard_shows_feasibility_and_says_which_constraints_it_applied(constrained, tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["leaderboard", "--experiment", EXP, "--sweep", "C"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = next(line for line in lines if "rank" in line)
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in lines if line.count("│") > 7]
    assert header.split()[-2:] == ["feasible", "┃"] and [(r[2], r[-1]) for r in rows] == [
        ("arch-ok", "yes"), ("arch-edge", "yes"), ("arch-fast", "yes")]
    text = " ".join(result.stdout.split())
    assert ("feasible trials only, under search.constraints latency_ms<=30 (sweep C); --include-infeasible shows the "
            "others too") in text

    result = runner.invoke(app, ["leaderboard", "--experiment", EXP, "--include-infeasible", "--format", "json",
                                 "--out", str(tmp_path / "lb.json")])
    assert result.exit_code == 0, result.output
    import json

    rows = json.loads((tmp_path / "lb.json").read_text())
    assert [(r["arch"], r["feasible"]) for r in rows] == [
        ("arch-slow", False), ("arch-unmeasured", False), ("arch-u1", None), ("arch-ok", True), ("arch-edge", True),
        ("arch-fast", True)]
    assert "all trials, feasible or not" in " ".join(result.stdout.split())

    result = runner.invoke(app, ["leaderboard", "--experiment", EXP, "--sweep", "C", "--pareto", "--top", "1"])
    assert result.exit_code == 0, result.output
    assert "arch-ok" in result.stdout and "arch-slow" not in result.stdout and "2 of 5 matching" in result.stdout
