"""``tests.conftest.nas_cli`` (a read-only ``nas`` command in the test's own process) answers as ``run_nas`` (the
same command in a subprocess) does: the exit code and the output, with the environment given for the call only."""

from __future__ import annotations

import os

from tests.conftest import nas_cli, nas_env, run_nas


def test_in_process_and_subprocess_give_the_same_exit_code_and_lines(tmp_path):
    env = nas_env(tmp_path, NAS_HELPER_MARK="1")  # MLflow at tmp_path/mlflow.db, which does not exist
    args = ["leaderboard", "--experiment", "nope"]
    here, there = nas_cli(args, env, tmp_path), run_nas(args, env, tmp_path)
    assert here.returncode == there.returncode == 2, (here, there)
    assert " ".join(here.stderr.split()) == " ".join(there.stderr.split()) != "", (here.stderr, there.stderr)
    assert here.stdout == there.stdout
    assert "NAS_HELPER_MARK" not in os.environ and not (tmp_path / "mlflow.db").exists()


def test_an_unhandled_exception_is_exit_1_with_its_traceback(tmp_path, monkeypatch):
    """What a subprocess prints for an error no handler caught: exit 1 and Python's traceback on stderr."""
    import nas.space

    def boom(*args, **kwargs):
        raise RuntimeError("boom from load_spec")

    monkeypatch.setattr(nas.space, "load_spec", boom)
    (tmp_path / "s.yaml").write_text("name: s\n")
    here = nas_cli(["space", "show", str(tmp_path / "s.yaml")], nas_env(tmp_path), tmp_path)
    assert here.returncode == 1, here
    assert "Traceback (most recent call last)" in here.stderr and "RuntimeError: boom from load_spec" in here.stderr
