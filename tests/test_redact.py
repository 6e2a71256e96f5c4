"""nas.redact: a backend URL's passwords never reach a message, a status line or a log (issue 15).

The CLI tests point ``MLFLOW_TRACKING_URI`` at a real SQLite store whose URL carries a password in its query
(SQLite ignores unknown URI parameters) or at an unreachable PostgreSQL URL with one in its user info too,
and check every line the command prints.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml
from typer.testing import CliRunner

from nas.redact import REDACTED, redact_url
from tests.conftest import tiny_spec_dict

SECRET = "hunter2"


@pytest.mark.parametrize("url, shown", [
    ("postgresql://nas:hunter2@db:5432/optuna", "postgresql://nas:***@db:5432/optuna"),
    ("postgresql+psycopg://nas:hunter2@db/optuna?sslmode=require",
     "postgresql+psycopg://nas:***@db/optuna?sslmode=require"),
    ("https://user:hunter2@mlflow.example:443/prefix", "https://user:***@mlflow.example:443/prefix"),
    ("mysql://nas:hun/ter@2@db/x", "mysql://nas:***@db/x"),  # unencoded / and @ in the password
    ("postgresql://nas:hun?ter2@db/x", "postgresql://nas:***@db/x"),  # unencoded ? in the password
])
def test_the_password_in_the_user_info_is_masked(url, shown):
    assert redact_url(url) == shown


@pytest.mark.parametrize("url, shown", [
    ("sqlite:////tmp/mlflow.db?password=hunter2", "sqlite:////tmp/mlflow.db?password=***"),
    ("postgresql://db/x?user=nas&PASSWORD=hunter2&sslmode=require",
     "postgresql://db/x?user=nas&PASSWORD=***&sslmode=require"),
    ("mssql://db/x?pwd=hunter2&sslpassword=hunter2", "mssql://db/x?pwd=***&sslpassword=***"),
    ("https://mlflow.example/?token=hunter2&access_token=hunter2#top",
     "https://mlflow.example/?token=***&access_token=***#top"),
    ("s3://bucket/ray?client_secret=hunter2&endpoint_override=minio:9000",
     "s3://bucket/ray?client_secret=***&endpoint_override=minio:9000"),
    ("postgresql://nas:hunter2@db/x?password=hunter2", "postgresql://nas:***@db/x?password=***"),
])
def test_secret_query_parameters_are_masked(url, shown):
    assert redact_url(url) == shown


@pytest.mark.parametrize("url", ["sqlite:////tmp/mlflow.db", "http://127.0.0.1:5000", "postgresql://nas@db/optuna",
                                 "/runs/tiny/optuna.journal", "file:///tmp/mlruns", "s3://bucket/a@b",
                                 "databricks", "postgresql://db/x?sslmode=require&application_name=nas"])
def test_a_url_without_secrets_is_unchanged(url):
    assert redact_url(url) == url


def test_masking_twice_changes_nothing():
    url = "postgresql://nas:hunter2@db/x?password=hunter2&token=t"
    assert redact_url(redact_url(url)) == redact_url(url) and SECRET not in redact_url(url)
    assert redact_url(url).count(REDACTED) == 3


# --------------------------------------------------------------------------- what the commands print


@pytest.fixture
def secret_store(tmp_path, monkeypatch, multi30k):
    """A real MLflow SQLite store at a URI holding ``password=hunter2``, the cwd, and a tiny sweep YAML."""
    uri = f"sqlite:///{tmp_path}/mlflow.db?password={SECRET}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    from nas import tracking

    tracking.get_client().search_experiments()  # the store exists: read-only commands refuse a missing one
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(yaml.safe_dump(tiny_spec_dict(multi30k, tmp_path, workdir=str(tmp_path / "runs"))))
    return spec_file


def _invoke(args: list[str]):
    from nas.cli import app

    result = CliRunner().invoke(app, args)
    printed = result.stdout + result.stderr
    assert SECRET not in printed, printed
    return result, " ".join(printed.split())


@pytest.mark.parametrize("args, says", [
    (["leaderboard"], "no sweep found at sqlite:///"),
    (["leaderboard", "--experiment", "nope"], "no MLflow experiment named 'nope' at sqlite:///"),
    (["report", "nope"], "no sweep with nas.sweep_id 'nope' in any experiment at sqlite:///"),
])
def test_not_found_errors_name_the_tracking_uri_without_its_password(secret_store, args, says):
    result, printed = _invoke(args)
    assert result.exit_code == 2 and says in printed and "mlflow.db?password=***" in printed


def test_a_missing_store_is_named_without_the_password(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/nothing.db?password={SECRET}")
    monkeypatch.chdir(tmp_path)
    result, printed = _invoke(["leaderboard"])
    assert result.exit_code == 2 and f"no MLflow store at {tmp_path / 'nothing.db'}" in printed, printed
    assert "nothing.db?password=***" in printed and not (tmp_path / "nothing.db").exists()


def test_sweep_status_and_the_end_of_a_sweep_show_the_tracking_uri_without_its_password(secret_store, tmp_path,
                                                                                          monkeypatch):
    from nas import search, tracking
    from nas.search.runner import SWEEP_FILE, SweepResult

    parent = tracking.start_run("tiny", "tiny-1", role="sweep", tags={tracking.TAG_SWEEP_ID: "tiny-1"})
    tracking.end_run(parent)
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    (tmp_path / "runs" / "tiny" / SWEEP_FILE).write_text(json.dumps(
        {"sweep_id": "tiny-1", "name": "tiny", "created": "now", "spec_file": str(secret_store), "cwd": str(tmp_path)}))
    result, printed = _invoke(["sweep", str(secret_store), "--status", "tiny"])
    assert result.exit_code == 0, printed
    assert "mlflow none; duplicates 0; sweep run FINISHED" in printed and "mlflow.db?password=***]" in printed

    done = SweepResult("tiny-1", parent, "tiny", tmp_path / "runs" / "tiny" / "supernet", {}, 0, 0)
    monkeypatch.setattr(search, "run_sweep", lambda *args, **kwargs: done)  # the sweep itself is not under test
    result, printed = _invoke(["sweep", str(secret_store)])
    assert result.exit_code == 0, printed
    assert f"parent run {parent} at sqlite:///" in printed and "mlflow.db?password=***" in printed


def test_an_unreachable_tracking_database_is_named_without_its_passwords(secret_store, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"postgresql://nas:{SECRET}@127.0.0.1:1/mlflow?password={SECRET}")
    result, printed = _invoke(["sweep", str(secret_store)])
    assert result.exit_code == 2
    assert "MLflow tracking database postgresql://nas:***@127.0.0.1:1/mlflow?password=*** " in printed


def test_the_report_names_an_optuna_storage_it_cannot_open_without_its_passwords():
    from nas.report.sweep import ImportanceError, locate_study

    parent = SimpleNamespace(data=SimpleNamespace(tags={}))
    with pytest.raises(ImportanceError) as info:
        locate_study(parent, "R1", storage=f"postgresql://nas:{SECRET}@127.0.0.1:1/optuna?password={SECRET}")
    assert SECRET not in str(info.value)
    assert "cannot open the Optuna storage postgresql://nas:***@127.0.0.1:1/optuna?password=***" in str(info.value)
