"""PostgreSQL restarted mid-sweep: the driver waits for the Optuna storage and retries, and no trial is lost or
told twice (every trial COMPLETE once in Optuna, TERMINATED once in Ray Tune, one FINISHED MLflow run).

The sweep is a real ``nas sweep`` subprocess whose Optuna study is in a fresh PostgreSQL database on the server at
127.0.0.1:5432 (MLflow in SQLite, so the restart hits Optuna only); once a trial is COMPLETE in the study the
test stops the server (``service postgresql stop``) for several seconds, then starts it again, always (``finally``).
The retry helper itself is tested on plain functions that raise SQLAlchemy's errors.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy.exc
from sqlalchemy.engine import make_url

from benchmarks.bench_resume import audit
from nas.errors import NasError
from nas.search.retry import RETRY_ENV, retry_storage
from tests.conftest import POSTGRES_ADMIN_URL, _postgres_unavailable, nas_env, read_sweep, sweep_with_supernet, \
    tiny_spec_dict

psycopg = pytest.importorskip("psycopg", reason="psycopg is not installed; pip install 'psycopg[binary]'")

TRIALS = 5
MIN_OUTAGE_S = 8.0
"""The server stays down at least this long (seconds) ..."""
MAX_OUTAGE_S = 60.0
"""... and longer, up to this, until the sweep has met the outage (it printed the wait, or it exited)."""
WAITING = "waiting for the Optuna storage"

SERVICE = shutil.which("service", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
"""The ``service`` command (in /usr/sbin, which a root shell has on PATH and a clean ``env -i`` does not)."""


def _admin() -> psycopg.Connection:
    return psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=3)


@pytest.fixture
def restartable_postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL database (``postgresql+psycopg://...``), dropped afterwards over a new connection
    (conftest's ``postgres_url`` keeps its admin connection open across the test, which a restart breaks)."""
    if os.geteuid() != 0 or SERVICE is None:
        pytest.skip("stopping the database server needs root and the `service` command")
    try:
        with _admin() as admin:
            name = f"nas_test_{uuid.uuid4().hex[:12]}"
            admin.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as e:
        _postgres_unavailable(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    try:
        yield make_url(POSTGRES_ADMIN_URL).set(drivername="postgresql+psycopg", database=name).render_as_string(
            hide_password=False)
    finally:
        with _admin() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _completed_trials(url: str) -> int:
    """COMPLETE trials in the study's database (0 while its tables don't exist yet)."""
    try:
        with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), connect_timeout=3) as conn:
            return conn.execute("SELECT count(*) FROM trials WHERE state = 'COMPLETE'").fetchone()[0]
    except (psycopg.errors.UndefinedTable, psycopg.OperationalError):
        return 0


def _service(action: str) -> None:
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])  # the init scripts call sbin tools
    subprocess.run([SERVICE, "postgresql", action], check=True, capture_output=True, timeout=120,
                   env={**os.environ, "PATH": path})


def _wait_for_server(timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _admin().close()
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _sweep_through_a_restart(spec_file: Path, env: dict[str, str], url: str,
                             work: Path) -> tuple[int, str, float, float]:
    """Run the sweep, restart PostgreSQL once a trial is COMPLETE; returns (exit code, log, outage s, sweep s)."""
    log_path = work / "sweep.log"
    outage_s = 0.0
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "nas.cli", "sweep", str(spec_file)], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=work, text=True)
        try:
            while proc.poll() is None and _completed_trials(url) < 1 and time.monotonic() - start < 600:
                time.sleep(0.5)
            assert proc.poll() is None, "the sweep ended before a trial completed:\n" + log_path.read_text()[-4000:]
            down = time.monotonic()
            try:
                _service("stop")
                while time.monotonic() - down < MIN_OUTAGE_S or (
                        time.monotonic() - down < MAX_OUTAGE_S and proc.poll() is None
                        and WAITING not in log_path.read_text()):
                    time.sleep(0.5)
            finally:
                _service("start")
                _wait_for_server()
                outage_s = time.monotonic() - down
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return proc.returncode, log_path.read_text(), outage_s, time.monotonic() - start


@pytest.mark.slow
def test_sweep_waits_out_a_postgres_restart_and_loses_no_trial(multi30k, tmp_path, tiny_supernet,
                                                                restartable_postgres_url):
    url = restartable_postgres_url
    raw = tiny_spec_dict(multi30k, tmp_path, search={"trials": TRIALS, "max_concurrent": 2, "beam_size": 2,
                                                     "latency_sentences": 2, "method": "random"},
                         tracking={"experiment": "pg-restart", "optuna_storage": url})
    spec_file = sweep_with_supernet(raw, tmp_path, tiny_supernet)
    env = nas_env(tmp_path, **{RETRY_ENV: "120"})
    code, log, outage_s, sweep_s = _sweep_through_a_restart(spec_file, env, url, tmp_path)
    print(f"outage {outage_s:.1f} s, sweep {sweep_s:.1f} s")
    assert code == 0, log[-6000:]
    assert WAITING in log, log[-6000:]  # the outage did overlap the sweep's use of the study
    assert "OperationalError" not in log.split(WAITING, 1)[0]  # no traceback before the wait

    records = read_sweep(spec_file, env)
    counts, problems = audit(TRIALS, records.optuna, records.ray, records.runs)
    assert problems == [], (counts, log[-4000:])
    assert sorted(t.number for t in records.optuna) == list(range(TRIALS))
    assert {t.state.name for t in records.optuna} == {"COMPLETE"}
    runs = records.trial_runs()
    assert sorted(int(r.data.tags["nas.optuna_trial"]) for r in runs) == list(range(TRIALS))  # one run per trial
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert not [r for r in records.runs if r.info.status == "RUNNING"]


# --------------------------------------------------------------------------- the retry helper


def _operational_error() -> sqlalchemy.exc.OperationalError:
    return sqlalchemy.exc.OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused\ndetail"))


def test_retry_storage_retries_a_transient_error_until_the_call_succeeds(monkeypatch, capsys):
    monkeypatch.setenv(RETRY_ENV, "30")
    calls = []

    @retry_storage("postgresql://nas:secret@db/optuna", first_wait_s=0.01)
    def flaky(x: int) -> int:
        calls.append(x)
        if len(calls) < 3:
            raise _operational_error()
        return x * 2

    assert flaky(21) == 42 and calls == [21, 21, 21]
    err = capsys.readouterr().err
    assert err.count(WAITING) == 1, err  # one line per outage, not per attempt
    assert "postgresql://nas:***@db/optuna" in err and "secret" not in err
    assert "retrying for up to 30 s" in err


def test_retry_storage_retries_a_wrapped_error_and_an_invalidated_connection(monkeypatch):
    monkeypatch.setenv(RETRY_ENV, "30")
    errors = [_operational_error(), sqlalchemy.exc.DBAPIError("SELECT 1", {}, OSError("reset"),
                                                              connection_invalidated=True)]

    @retry_storage("sqlite://", first_wait_s=0.01)
    def flaky() -> str:
        if errors:
            error = errors.pop(0)
            try:
                raise error
            except sqlalchemy.exc.OperationalError as e:  # as Optuna's RDBStorage wraps it
                raise RuntimeError("An exception is raised during the commit") from e
        return "ok"

    assert flaky() == "ok" and errors == []


def test_retry_storage_does_not_retry_a_non_transient_error(monkeypatch):
    monkeypatch.setenv(RETRY_ENV, "30")
    calls = []

    @retry_storage("sqlite://", first_wait_s=0.01)
    def broken() -> None:
        calls.append(1)
        raise sqlalchemy.exc.IntegrityError("INSERT", {}, ValueError("duplicate key"))

    with pytest.raises(sqlalchemy.exc.IntegrityError):
        broken()
    assert calls == [1]


def test_retry_storage_gives_up_after_its_bound_with_the_last_error(monkeypatch):
    monkeypatch.setenv(RETRY_ENV, "0.2")
    calls = []

    @retry_storage("sqlite://", first_wait_s=0.01)
    def down() -> None:
        calls.append(1)
        raise _operational_error()

    start = time.monotonic()
    with pytest.raises(sqlalchemy.exc.OperationalError):
        down()
    assert 0.2 <= time.monotonic() - start < 5 and len(calls) >= 2


def test_retry_storage_retries_only_the_outermost_call(monkeypatch):
    monkeypatch.setenv(RETRY_ENV, "30")
    calls = {"outer": 0, "inner": 0}

    @retry_storage("sqlite://", first_wait_s=0.01)
    def inner() -> None:
        calls["inner"] += 1
        if calls["inner"] == 1:
            raise _operational_error()

    @retry_storage("sqlite://", first_wait_s=0.01)
    def outer() -> None:
        calls["outer"] += 1
        inner()

    outer()
    assert calls == {"outer": 2, "inner": 2}  # the failed inner call is retried through the outer one


def test_retry_storage_bound_must_be_a_number(monkeypatch):
    monkeypatch.setenv(RETRY_ENV, "soon")

    @retry_storage("sqlite://")
    def down() -> None:
        raise _operational_error()

    with pytest.raises(NasError, match="NAS_BACKEND_RETRY_S=soon"):
        down()
