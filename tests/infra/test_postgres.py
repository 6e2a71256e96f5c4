"""PostgreSQL backends for real: Optuna ``RDBStorage`` and the MLflow tracking store on the server at
127.0.0.1:5432, with a sweep of 2 concurrent trials writing to both; checked afterwards for counts,
states and duplicates. Without PostgreSQL these tests skip (fail under ``NAS_REQUIRE_POSTGRES=1``)."""

from __future__ import annotations

import json
from collections import Counter

import psycopg
import pytest
from optuna.trial import TrialState

from tests.conftest import nas_env, read_sweep, run_nas, sweep_with_supernet, tiny_spec_dict

TRIALS = 4


def _count(url: str, sql: str) -> int:
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        return conn.execute(sql).fetchone()[0]


@pytest.mark.slow
def test_sweep_with_two_concurrent_trials_on_postgres_optuna_and_mlflow(multi30k, tmp_path, tiny_supernet,
                                                                         postgres_databases):
    optuna_url, mlflow_url = postgres_databases(), postgres_databases()
    raw = tiny_spec_dict(multi30k, tmp_path, search={"trials": TRIALS, "max_concurrent": 2, "beam_size": 2,
                                                     "latency_sentences": 2, "method": "tpe"},
                         tracking={"experiment": "pg", "optuna_storage": optuna_url})
    spec_file = sweep_with_supernet(raw, tmp_path, tiny_supernet)
    env = nas_env(tmp_path, MLFLOW_TRACKING_URI=mlflow_url)
    proc = run_nas(["sweep", str(spec_file)], env, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert not (tmp_path / "runs" / "tiny" / "optuna.journal").exists()  # the study went to PostgreSQL

    records = read_sweep(spec_file, env)
    assert [t.number for t in records.optuna] == list(range(TRIALS))
    assert all(t.state == TrialState.COMPLETE for t in records.optuna)
    spans = sorted((t.datetime_start, t.datetime_complete) for t in records.optuna)
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:])), f"no two trials overlapped: {spans}"
    assert Counter(t.config["optuna_trial"] for t in records.ray) == Counter(range(TRIALS))
    assert {t.status for t in records.ray} == {"TERMINATED"}
    runs = records.trial_runs()
    assert sorted(int(r.data.tags["nas.optuna_trial"]) for r in runs) == list(range(TRIALS))
    assert {r.info.status for r in records.runs} == {"FINISHED"}
    assert len(records.roles("sweep")) == 1 and len(records.roles("supernet")) == 1
    values = {t.number: t.values[0] for t in records.optuna}
    assert all(r.data.metrics["bleu"] == pytest.approx(values[int(r.data.tags["nas.optuna_trial"])]) for r in runs)

    # the same counts straight from the databases' tables
    assert _count(optuna_url, "SELECT count(*) FROM trials") == TRIALS
    assert _count(optuna_url, "SELECT count(*) FROM trials WHERE state = 'COMPLETE'") == TRIALS
    assert _count(mlflow_url, "SELECT count(*) FROM runs") == TRIALS + 2
    assert _count(mlflow_url, "SELECT count(*) FROM runs WHERE status <> 'FINISHED'") == 0
    assert _count(mlflow_url, "SELECT count(DISTINCT value) FROM tags WHERE key = 'nas.optuna_trial'") == TRIALS

    status = run_nas(["sweep", "--status", "tiny", "--workdir", str(tmp_path / "runs")], env, tmp_path)
    assert status.returncode == 0, status.stderr[-3000:]
    assert f"COMPLETE {TRIALS}" in status.stdout and f"FINISHED {TRIALS}; duplicates 0" in status.stdout

    # `nas report` finds the study in PostgreSQL from the parent run's tags (failed before: it looked for a journal
    # file beside the supernet, and the parameter importances were "not computed")
    sweep_id = json.loads((tmp_path / "runs" / "tiny" / "sweep.json").read_text())["sweep_id"]
    report = run_nas(["report", sweep_id, "--format", "md", "--out", str(tmp_path / "report.md")], env, tmp_path)
    assert report.returncode == 0, report.stderr[-3000:]
    assert "not computed" not in report.stderr, report.stderr[-3000:]
    assert "## Parameter importances" in (text := (tmp_path / "report.md").read_text()) and "Not computed" not in text

    again = run_nas(["sweep", str(spec_file)], env, tmp_path)  # a finished sweep run again: nothing added
    assert again.returncode == 0 and "(resumed)" in again.stdout, again.stderr[-3000:]
    assert _count(optuna_url, "SELECT count(*) FROM trials") == TRIALS
    assert _count(mlflow_url, "SELECT count(*) FROM runs") == TRIALS + 2


@pytest.mark.slow
def test_unreachable_optuna_postgres_exits_2_naming_the_storage(multi30k, tmp_path):
    raw = tiny_spec_dict(multi30k, tmp_path, tracking={"experiment": "pg",
                                                       "optuna_storage": "postgresql://nas:secret@127.0.0.1:1/optuna"})
    spec_file = tmp_path / "tiny.yaml"
    import yaml

    spec_file.write_text(yaml.safe_dump(raw))
    proc = run_nas(["sweep", str(spec_file)], nas_env(tmp_path), tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    message = proc.stderr.replace("\n", "")
    assert "tracking.optuna_storage" in message and "postgresql://nas:***@127.0.0.1:1/optuna" in message
    assert "secret" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs" / "tiny" / "sweep.json").exists()  # nothing half-started to trip a retry


def test_storage_password_stays_out_of_tuner_pickle_and_sweep_record(multi30k, tmp_path):
    import json
    import pickle

    from nas.search.runner import SweepRecord, _settings, study_ref
    from nas.search.searcher import _REAL_URLS
    from nas.space import parse_spec

    spec = parse_spec(tiny_spec_dict(multi30k, tmp_path, tracking={"optuna_storage": "postgresql://nas:s3cret@db:5432/optuna"}))
    ref = study_ref(spec, "tiny-1")
    blob = pickle.dumps(ref)  # what Ray writes into tuner.pkl (inside the searcher)
    assert b"s3cret" not in blob and pickle.loads(blob).storage_url.endswith(":s3cret@db:5432/optuna")
    _REAL_URLS.clear()  # another process: the password is not there to be found
    assert pickle.loads(blob).storage_url == "postgresql://nas:***@db:5432/optuna"
    record = SweepRecord("tiny-1", "tiny", "now", "f.yaml", str(tmp_path), _settings(spec))
    assert "s3cret" not in json.dumps(record.__dict__)


def test_opening_an_unreachable_study_storage_names_the_masked_url(tmp_path):
    from nas.search.searcher import StudyRef
    from nas.space import SpecError

    with pytest.raises(SpecError, match=r"tracking.optuna_storage: cannot open .* postgresql://nas:\*\*\*@127.0.0.1:1/o") as e:
        StudyRef("s", tmp_path / "j", "postgresql://nas:s3cret@127.0.0.1:1/o").storage()
    assert "s3cret" not in str(e.value)
