"""One lock per run folder (issue 15): a second writer of ``<workdir>/<name>`` is refused, naming the holder,
before it writes anything; a holder killed with SIGKILL releases it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from nas.errors import NasError
from tests.conftest import REPO, tiny_spec_dict

HOLDER = """
import fcntl, json, os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": "T0",
                         "command": "nas sweep held"}).encode())
print("held", flush=True)
time.sleep(600)
"""
"""Holds ``argv[1]`` as any ``nas`` command does (``flock`` on the file, holder recorded as one JSON line)."""


@contextlib.contextmanager
def held(lock: Path) -> Iterator[subprocess.Popen]:
    """Another process holding the lock file ``lock`` until the block ends (then SIGKILL-ed)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


def test_second_process_is_refused_naming_the_holder_until_it_is_killed(tmp_path):
    from nas.locks import RunLockedError, run_lock

    run_dir = tmp_path / "runs" / "tiny"
    with held(run_dir / "run.lock") as proc:
        with pytest.raises(RunLockedError) as info:
            with run_lock(run_dir, "nas train tiny"):
                pass
        message = str(info.value)
        assert "\n" not in message
        assert f"pid {proc.pid} on host " in message and "since T0" in message and str(run_dir) in message
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        with run_lock(run_dir, "nas train tiny") as path:  # the kernel released the killed holder's lock
            assert f'"pid": {os.getpid()}' in path.read_text()


def test_run_lock_is_refused_within_one_process_too(tmp_path):
    from nas.locks import RunLockedError, run_lock

    with run_lock(tmp_path, "nas sweep a"):
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()} .*nas sweep a"):
            with run_lock(tmp_path, "nas sweep b"):
                pass
    with run_lock(tmp_path, "nas sweep c"):  # released at the end of the block
        pass


def _never(*args, **kwargs):
    raise AssertionError("data was prepared while another process held the run folder's lock")


def test_train_refuses_a_locked_run_folder_before_writing_anything(multi30k, tmp_path, monkeypatch):
    """``nas train`` took no lock: it prepared data, ended the holder's MLflow run as KILLED and trained into the
    same supernet folder."""
    import nas.api
    import nas.builders
    from nas.space import parse_spec

    spec = parse_spec(tiny_spec_dict(multi30k, tmp_path), "tiny.yaml")
    monkeypatch.setattr(nas.builders, "prepare_sweep_data", _never)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    with held(spec.run_dir / "run.lock") as proc:
        before = _files(tmp_path)
        with pytest.raises(NasError, match=f"pid {proc.pid} "):
            nas.api.train(spec)
        assert _files(tmp_path) == before


def test_sweep_takes_the_lock_before_preparing_data(multi30k, tmp_path, monkeypatch):
    """The sweep driver's lock used to be taken only after the data was prepared."""
    import nas.search.runner
    from nas.space import parse_spec

    spec = parse_spec(tiny_spec_dict(multi30k, tmp_path), "tiny.yaml")
    monkeypatch.setattr(nas.search.runner, "prepare_sweep_data", _never)
    with held(spec.run_dir / "run.lock") as proc:
        before = _files(tmp_path)
        with pytest.raises(NasError, match=f"pid {proc.pid} "):
            nas.search.runner.run_sweep(spec, tmp_path / "tiny.yaml")
        assert _files(tmp_path) == before
