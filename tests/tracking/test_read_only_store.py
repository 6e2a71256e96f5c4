"""Read-only commands create nothing (issue 30): ``nas leaderboard``, ``nas report`` and ``nas export`` run from a
folder without ``mlflow.db`` (and no ``MLFLOW_TRACKING_URI``) fail in one line naming where they looked and the two
fixes, and leave the folder as it was; MLflow would otherwise create an empty store there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow  # over 5 s on 2 cores: out of the inner loop (pytest -m "not slow")
@pytest.mark.parametrize("args", [["leaderboard"], ["leaderboard", "--experiment", "e"], ["report", "abc123"],
                                  ["export", "--best", "--out", "exported"], ["export", "--run-id", "abcd", "--out", "x"]])
def test_a_read_only_command_in_a_folder_without_a_store_creates_nothing(args, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-m", "nas.cli", *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"no MLflow store at {tmp_path / 'mlflow.db'}" in lines[0], proc.stderr
    assert "MLFLOW_TRACKING_URI" in lines[0] and "folder the sweep ran in" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_the_python_leaderboard_creates_no_store_either(tmp_path, monkeypatch):
    import nas

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(nas.NasError, match="no MLflow store at"):
        nas.leaderboard("e")
    with pytest.raises(nas.NasError, match="no MLflow store at"):
        nas.export(tmp_path / "out", best=True)
    assert list(tmp_path.iterdir()) == []
