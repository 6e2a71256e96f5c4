"""Tests for nas.tracking against a real MLflow tracking store (SQLite in tmp_path)."""

from __future__ import annotations

import csv
import json
import math

import pytest

from nas import tracking
from nas.tracking import LeaderboardRow
from tests.conftest import EXP


def test_tracking_uri_default_is_absolute_sqlite(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert tracking.tracking_uri() == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://example:5000")
    assert tracking.tracking_uri() == "http://example:5000"


def test_flatten_nested_dicts_and_lists():
    arch = {"encoder": {"layers": 2, "width": [64, 128], "ffn": ({"dim": 256},)},
            "decoder": {"heads": [4]}, "name": "x", "empty": []}
    assert tracking.flatten(arch) == {
        "encoder.layers": 2,
        "encoder.width.0": 64,
        "encoder.width.1": 128,
        "encoder.ffn.0.dim": 256,
        "decoder.heads.0": 4,
        "name": "x",
        "empty": [],
    }
    assert tracking.flatten({"a": {"b": 1}}, prefix="arch", sep="/") == {"arch/a/b": 1}


def test_ensure_experiment_creates_and_restores(mlflow_uri):
    exp_id = tracking.ensure_experiment(EXP)
    assert tracking.ensure_experiment(EXP) == exp_id
    client = tracking.get_client()
    client.delete_experiment(exp_id)
    assert tracking.ensure_experiment(EXP) == exp_id
    assert client.get_experiment(exp_id).lifecycle_stage == "active"


def test_start_run_child_with_parent_tag_params_metrics_artifacts(mlflow_uri, tmp_path):
    parent = tracking.start_run(EXP, "sweep", role="sweep", tags={"nas.sweep_id": "S1"})
    params = {"encoder": {"width": [64, 128]}, "extra": {f"p{i}": i for i in range(150)}}
    child = tracking.start_run(EXP, "trial-0", role="trial", parent_run_id=parent,
                               tags={"nas.trial_id": "0"}, params=params)
    tracking.log_metrics(child, {"bleu": 21.5, "valid_loss": float("nan"), "note": "skip",
                                 "flag": True, "params_m": 12})
    tracking.log_json_artifact(child, {"encoder": {"width": [64, 128]}}, "arch.json")
    yaml_file = tmp_path / "sweep.yaml"
    yaml_file.write_text("name: test\n")
    tracking.log_file_artifact(parent, yaml_file)
    tracking.end_run(child)

    client = tracking.get_client()
    run = client.get_run(child)
    tags = run.data.tags
    assert tags["mlflow.parentRunId"] == parent
    assert tags["nas.role"] == "trial"
    assert tags["nas.trial_id"] == "0"
    assert tags["nas.sweep_id"] == "S1"  # inherited from the parent
    assert tags["mlflow.runName"] == "trial-0"
    assert run.data.params["encoder.width.0"] == "64"
    assert run.data.params["encoder.width.1"] == "128"
    assert len(run.data.params) == 152  # > 100: logged in several batches
    m = run.data.metrics
    assert m["bleu"] == 21.5 and m["params_m"] == 12.0 and math.isnan(m["valid_loss"])
    assert "note" not in m and "flag" not in m
    assert run.info.status == "FINISHED"
    assert [f.path for f in client.list_artifacts(child)] == ["arch.json"]
    assert [f.path for f in client.list_artifacts(parent)] == ["sweep.yaml"]

    assert [r.info.run_id for r in tracking.find_runs(EXP, parent_run_id=parent)] == [child]
    assert [r.info.run_id for r in tracking.find_runs(EXP, role="sweep")] == [parent]
    assert len(tracking.find_runs(EXP, sweep_id="S1")) == 2
    assert tracking.find_runs(EXP, sweep_id="nope") == []


def test_end_run_rejects_bad_status(mlflow_uri):
    run_id = tracking.start_run(EXP, "r", role="trial")
    with pytest.raises(ValueError, match="FINISHED"):
        tracking.end_run(run_id, "DONE")


def test_leaderboard_bleu_descending_excludes_non_trials_and_unfinished(populated):
    rows = tracking.leaderboard(EXP)
    assert [r.run_id for r in rows] == [populated[k] for k in ("b1", "t2", "t3", "t1", "t4")]
    best = rows[0]
    assert best == LeaderboardRow(
        run_id=populated["b1"], arch="arch-b1", bleu=30.0, chrf=55.0, params_m=50.0,
        latency_ms=40.0, valid_loss=2.0, sweep_id="B", arch_id="id-b1",
    )


def test_leaderboard_latency_ascending_and_top(populated):
    rows = tracking.leaderboard(EXP, metric="latency_ms", top=3)
    assert [r.run_id for r in rows] == [populated[k] for k in ("t3", "t4", "t1")]
    rows = tracking.leaderboard(EXP, metric="latency_ms", top=2, ascending=False)
    assert [r.run_id for r in rows] == [populated[k] for k in ("t2", "b1")]


def test_leaderboard_sweep_filter(populated):
    rows = tracking.leaderboard(EXP, sweep_id="A", top=2)
    assert [r.run_id for r in rows] == [populated["t2"], populated["t3"]]
    assert {r.sweep_id for r in tracking.leaderboard(EXP, sweep_id="A")} == {"A"}
    assert [r.run_id for r in tracking.leaderboard(EXP, sweep_id="B")] == [populated["b1"]]
    assert tracking.leaderboard(EXP, sweep_id="missing") == []


def test_leaderboard_unknown_experiment_and_bad_args(mlflow_uri):
    with pytest.raises(LookupError) as exc:
        tracking.leaderboard("nope")
    assert str(exc.value) == (
        f"no MLflow experiment named 'nope' at {mlflow_uri}; "
        "run `nas sweep FILE` first or set MLFLOW_TRACKING_URI"
    )
    tracking.ensure_experiment(EXP)
    with pytest.raises(ValueError, match="bleu, chrf"):
        tracking.leaderboard(EXP, metric="accuracy")
    with pytest.raises(ValueError, match="top"):
        tracking.leaderboard(EXP, top=0)
    assert tracking.leaderboard(EXP) == []


def test_leaderboard_table_columns():
    rows = [LeaderboardRow("0123456789abcdef", "L2-w64", 25.0, 50.0, 12.5, 3.0, 2.1, "A", "x"),
            LeaderboardRow("fedcba9876543210", "L4-w128", None, None, None, None, None, None, None)]
    table = tracking.leaderboard_table(rows, title="top")
    assert [str(c.header) for c in table.columns] == [
        "rank", "run id", "arch", "BLEU", "chrF", "params (M)", "latency (ms)"]
    assert list(table.columns[1].cells) == ["01234567", "fedcba98"]
    assert list(table.columns[3].cells) == ["25.00", "-"]
    assert table.title == "top"


ROWS = [
    LeaderboardRow("r1", "L6-w512", 27.25, 55.5, 44.1, 12.0, 1.9, "A", "a1"),
    LeaderboardRow("r2", "L2, w=64 \"q\"", None, 40.0, 8.0, None, 3.5, None, None),
]


def _read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        out = []
        for rec in csv.DictReader(f):
            out.append(LeaderboardRow(**{
                k: (None if v == "" else v if k in ("run_id", "arch", "sweep_id", "arch_id")
                    else float(v)) for k, v in rec.items()}))
        return out


def _read_json(path):
    return [LeaderboardRow(**rec) for rec in json.loads(path.read_text())]


def _read_parquet(path):
    import pyarrow.parquet as pq

    return [LeaderboardRow(**rec) for rec in pq.read_table(path).to_pylist()]


@pytest.mark.parametrize("fmt,reader", [("csv", _read_csv), ("json", _read_json),
                                        ("parquet", _read_parquet)])
def test_write_leaderboard_round_trip(tmp_path, fmt, reader):
    out = tmp_path / "sub" / f"lb.{fmt}"
    assert tracking.write_leaderboard(ROWS, fmt, out) == out
    assert reader(out) == ROWS
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temp file left behind
    tracking.write_leaderboard(ROWS[:1], fmt, out)  # overwrite in place
    assert reader(out) == ROWS[:1]


def test_write_leaderboard_empty_parquet(tmp_path):
    import pyarrow.parquet as pq

    out = tracking.write_leaderboard([], "parquet", tmp_path / "empty.parquet")
    table = pq.read_table(out)
    assert table.num_rows == 0 and "bleu" in table.column_names


def test_write_leaderboard_bad_format(tmp_path):
    with pytest.raises(ValueError, match="'xlsx'"):
        tracking.write_leaderboard(ROWS, "xlsx", tmp_path / "lb.xlsx")
    assert not list(tmp_path.iterdir())
