"""Every command that talks to MLflow checks it first (issue 30): a tracking database whose role does not exist,
or a server that does not answer, is one line and exit 2 within 15 s, naming the backend (password masked), what
failed and the fix; MLflow's retries (over 100 s) and its traceback are never reached."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

BAD_ROLE = "postgresql+psycopg://nosuchrole:secret@127.0.0.1:5432/test"
NOTHING_LISTENS = "http://127.0.0.1:9/"


def _postgres_up() -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", 5432)) == 0


@pytest.mark.slow  # over 5 s on 2 cores: out of the inner loop (pytest -m "not slow")
@pytest.mark.parametrize("uri", [BAD_ROLE, NOTHING_LISTENS], ids=["postgres-bad-role", "http-nothing-listens"])
@pytest.mark.parametrize("args", [["leaderboard"], ["leaderboard", "--experiment", "e"], ["report", "abc123"],
                                  ["export", "--best", "--out", "exported"],
                                  ["retrain", "search_spaces/quickstart.yaml", "--arch", "enc[128/256] dec[128/256]"],
                                  ["train", "search_spaces/quickstart.yaml"]],
                         ids=lambda a: " ".join(a[:2]))
def test_a_backend_that_refuses_is_one_line_within_15_s(args, uri, tmp_path):
    if uri == BAD_ROLE and not _postgres_up():
        pytest.skip("PostgreSQL is not running on 127.0.0.1:5432")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(REPO)}
    cwd = REPO if args[0] in ("train", "retrain") else tmp_path  # the YAML's data paths are relative to the root
    before = sorted(p.name for p in cwd.iterdir())
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "nas.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)
    seconds = time.monotonic() - start
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert seconds < 15, f"{seconds:.1f} s"
    assert "secret" not in lines[0] and "MLFLOW_TRACKING_URI" in lines[0], lines[0]
    if uri == BAD_ROLE:  # the role is what is missing, not the database
        assert "CREATE ROLE nosuchrole" in lines[0] and "CREATE DATABASE" not in lines[0], lines[0]
    assert sorted(p.name for p in cwd.iterdir()) == before  # nothing written
