"""Fixtures of the infrastructure tests: an ``mlflow server`` that can be stopped and started again."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest


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
    """``mlflow server`` on a fixed 127.0.0.1 port, SQLite store and artifact folder: ``start``/``stop`` any number
    of times, each start on the same port and store. ``mlflow server`` runs uvicorn as a child process: the server
    gets its own session and is stopped as a process group, so no worker outlives a stop."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.port = _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.store = f"sqlite:///{work / 'mlflow-server.db'}"
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


@pytest.fixture
def restartable_mlflow_server(tmp_path) -> Iterator[RestartableMlflowServer]:
    """A started :class:`RestartableMlflowServer` in ``tmp_path``; stopped afterwards whatever the test left."""
    server = RestartableMlflowServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
