"""Fixtures of the infrastructure tests: an ``mlflow server`` that can be stopped and started again, the
PostgreSQL server restarted under a sweep, and a PostgreSQL server of a module's own that the restart leaves up."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import POSTGRES_ADMIN_URL, _postgres_unavailable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM the process group led by ``proc`` (started with ``start_new_session``), SIGKILL it after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


class RestartableMlflowServer:
    """``mlflow server`` on a fixed 127.0.0.1 port, backend store (``store``, default SQLite in ``work``) and
    artifact folder: ``start``/``stop`` any number of times, each start on the same port and store. ``mlflow server``
    runs uvicorn as a child process: the server gets its own session and is stopped as a process group, so no worker
    outlives a stop."""

    def __init__(self, work: Path, store: str | None = None) -> None:
        self.work = work
        self.port = _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.store = store or f"sqlite:///{work / 'mlflow-server.db'}"
        self.artifacts = work / "artifact-store"
        self.log_path = work / "mlflow-server.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 180) -> None:
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", self.store,
                 "--artifacts-destination", self.artifacts.as_uri(), "--serve-artifacts",
                 "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
                 "--allowed-hosts", f"127.0.0.1:{self.port},localhost:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.work, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"mlflow server did not start on port {self.port}:\n" + self.log_path.read_text()[-3000:])
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)
            self.proc = None


SERVICE = shutil.which("service", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
"""The ``service`` command (in /usr/sbin, which a root shell has on PATH and a clean ``env -i`` does not)."""


class RestartablePostgres:
    """The PostgreSQL server at ``POSTGRES_ADMIN_URL``, stopped and started with ``service postgresql`` (root), and
    the databases created on it. Every statement opens a fresh admin connection: conftest's ``postgres_databases``
    keeps one open across a test, which a restart breaks."""

    def __init__(self) -> None:
        import psycopg

        self.psycopg = psycopg
        self.names: list[str] = []

    def admin(self):
        return self.psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=3)

    def create_database(self) -> str:
        """A fresh empty database, as ``postgresql+psycopg://USER@HOST:PORT/nas_test_<hex>``."""
        from sqlalchemy.engine import make_url

        name = f"nas_test_{uuid.uuid4().hex[:12]}"
        with self.admin() as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        self.names.append(name)
        return make_url(POSTGRES_ADMIN_URL).set(drivername="postgresql+psycopg", database=name).render_as_string(
            hide_password=False)

    def drop_databases(self) -> None:
        with self.admin() as admin:
            for name in self.names:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def _service(self, action: str) -> None:
        path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])  # the init scripts call sbin tools
        subprocess.run([SERVICE, "postgresql", action], check=True, capture_output=True, timeout=120,
                       env={**os.environ, "PATH": path})

    def stop(self) -> None:
        self._service("stop")

    def start(self, timeout_s: float = 60) -> None:
        """Start the server and wait until it accepts a connection."""
        self._service("start")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.admin().close()
                return
            except self.psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


@pytest.fixture(scope="module")
def restartable_postgres() -> Iterator[RestartablePostgres]:
    """A :class:`RestartablePostgres` for the module; its databases are dropped after the module's last test.
    Skips without root or ``service``; skips, or fails under ``NAS_REQUIRE_POSTGRES=1``, when the server doesn't
    answer or psycopg is missing."""
    if os.geteuid() != 0 or SERVICE is None:
        pytest.skip("stopping the database server needs root and the `service` command")
    try:
        postgres = RestartablePostgres()
    except ImportError as e:
        _postgres_unavailable(f"psycopg is not installed ({e}); pip install 'psycopg[binary]'")
    try:
        postgres.admin().close()
    except postgres.psycopg.OperationalError as e:
        _postgres_unavailable(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    try:
        yield postgres
    finally:
        postgres.drop_databases()


def _postgres_bindir() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl`` (``pg_config --bindir``, else the newest /usr/lib/postgresql/*/bin)."""
    try:
        found = Path(subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True,
                                    timeout=30).stdout.strip())
        if (found / "initdb").is_file():
            return found
    except (OSError, subprocess.SubprocessError):
        pass
    folders = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name)
                     if p.parent.name.isdigit() else 0)
    return next((f for f in reversed(folders) if (f / "initdb").is_file() and (f / "pg_ctl").is_file()), None)


@pytest.fixture(scope="module")
def own_postgres_url() -> Iterator[str]:
    """A database on a PostgreSQL server of the module's own, as ``postgresql+psycopg://postgres@127.0.0.1:PORT/nas``:
    ``initdb`` in a fresh folder under /tmp (trust auth, fsync off), ``pg_ctl start`` on a free 127.0.0.1 port, run
    as the ``postgres`` user; stopped and removed after the module's last test. ``service postgresql`` does not know
    it, so it stays up while :class:`RestartablePostgres` restarts the shared server. Skips without root, or fails
    under ``NAS_REQUIRE_POSTGRES=1`` without PostgreSQL's programs."""
    if os.geteuid() != 0:
        pytest.skip("a PostgreSQL server of the test's own runs as the postgres user: needs root")
    bindir = _postgres_bindir()
    if bindir is None:
        _postgres_unavailable("no initdb/pg_ctl (pg_config --bindir, /usr/lib/postgresql/*/bin)")
    as_postgres = ["runuser", "-u", "postgres", "--"]
    folder = Path(tempfile.mkdtemp(prefix="nas-pg-", dir="/tmp"))  # pytest's folders are root's alone
    shutil.chown(folder, "postgres", "postgres")
    data, port = folder / "data", _free_port()

    def pg(*args: str, timeout_s: float = 300) -> None:
        done = subprocess.run([*as_postgres, *args], capture_output=True, text=True, timeout=timeout_s, cwd=folder)
        if done.returncode != 0:
            log = folder / "server.log"
            pytest.fail(f"{' '.join(args)} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
                        + (log.read_text()[-2000:] if log.is_file() else ""))

    try:
        pg(str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C",
           "--no-sync")
        pg(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(folder / "server.log"), "-w", "-t", "180", "-o",
           f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
        import psycopg

        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres", autocommit=True,
                             connect_timeout=10) as admin:
            admin.execute('CREATE DATABASE "nas"')
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/nas"
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run([*as_postgres, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                           capture_output=True, timeout=120, cwd=folder)
        shutil.rmtree(folder, ignore_errors=True)


def bucket_fs(uri: str):
    """(pyarrow filesystem, ``bucket/key`` path) of an ``s3://`` URI with its query."""
    import pyarrow.fs

    return pyarrow.fs.FileSystem.from_uri(uri)


def bucket_names(uri: str) -> list[str]:
    import pyarrow.fs

    fs, path = bucket_fs(uri)
    return sorted(i.base_name for i in fs.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True)))


def bucket_ray_trials(exp: str, attempts: int = 10) -> list:
    """The Ray Tune trials of the experiment at ``exp``, read from the bucket (none before its first state).

    A running sweep replaces its ``experiment_state-*.json`` while the tests poll it, and pyarrow reads an S3 object
    in ranges after reading its size, so a read can return a cut-off state (``JSONDecodeError``: one run of
    ``tests/infra/test_cluster.py`` failed so on 2026-12-04). Such a read is retried, 0.5 s apart, up to
    ``attempts`` times; the last error is raised."""
    import json

    for _ in range(attempts - 1):
        try:
            return _bucket_ray_trials_once(exp)
        except json.JSONDecodeError:
            time.sleep(0.5)
    return _bucket_ray_trials_once(exp)


def _bucket_ray_trials_once(exp: str) -> list:
    from ray.tune import ExperimentAnalysis

    if not any(n.startswith("experiment_state-") and n.endswith(".json") for n in bucket_names(exp)):
        return []
    return ExperimentAnalysis(exp).trials
