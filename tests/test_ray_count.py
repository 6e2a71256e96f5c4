"""The suite's Ray counter (tests/ray_count.py) counts Ray's session folders and those in which Ray Tune ran."""

import os

import pytest

from tests.ray_count import ENV, RayCounter


def _session(root, name: str, experiments: int) -> None:
    folder = root / "ray" / name
    folder.mkdir(parents=True)
    for n in range(experiments):
        (folder / "artifacts" / "2026-11-28_18-00-00" / f"exp{n}").mkdir(parents=True)


def test_counts_only_sessions_created_after_it_started_and_those_that_ran_tune(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))  # a RAY_TMPDIR already set: kept, and restored after the test
    _session(tmp_path, "session_old_1", 1)  # before the counter: not this session's
    counter = RayCounter()
    assert counter.counts().starts == 0
    _session(tmp_path, "session_a_2", 3)  # a sweep: supernet, search, fine-tune experiments
    _session(tmp_path, "session_b_3", 0)  # Ray without Tune (data encoding)
    (tmp_path / "ray" / "session_latest").symlink_to(tmp_path / "ray" / "session_b_3")
    counts = counter.counts()
    assert (counts.starts, counts.sweeps, counts.experiments) == (2, 1, 3)
    assert counter.sessions_with_tune() == {tmp_path / "ray" / "session_a_2"}
    assert counts.line().startswith("1 Ray sweeps started (2 local Ray clusters, 3 Ray Tune experiments)")
    counter.close()
    assert (tmp_path / "ray").is_dir()  # a folder it did not create is left alone


def test_without_ray_tmpdir_it_sets_its_own_folder_and_removes_it(monkeypatch):
    monkeypatch.delenv(ENV)  # the suite's own counter set it: monkeypatch puts it back after the test
    counter = RayCounter()
    root = counter.root
    assert root.is_dir() and str(root) == os.environ[ENV] and len(str(root)) < 40
    _session(root, "session_x_1", 1)
    assert counter.counts().sweeps == 1
    counter.close()
    assert not root.exists()


def test_counts_the_sessions_of_the_xdist_workers_subfolders_too(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))  # the controller's folder; each worker's Ray writes under gwN/
    counter = RayCounter()
    _session(tmp_path / "gw0", "session_a_1", 2)
    _session(tmp_path / "gw1", "session_b_2", 0)
    _session(tmp_path / "other", "session_c_3", 1)  # not a worker's folder
    counts = counter.counts()
    assert (counts.starts, counts.sweeps, counts.experiments) == (2, 1, 2)
    assert counter.sessions_with_tune() == {tmp_path / "gw0" / "ray" / "session_a_1"}
    counter.close()


def test_an_xdist_worker_gets_its_own_subfolder_and_the_controller_counts_it(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))  # as xdist's controller set it before starting the worker
    worker = RayCounter(worker="gw1")
    assert worker.root == tmp_path / "gw1" and worker.root.is_dir() and os.environ[ENV] == str(tmp_path / "gw1")
    monkeypatch.setenv(ENV, str(tmp_path))
    controller = RayCounter()
    _session(tmp_path / "gw1", "session_w_1", 1)
    assert worker.counts().sweeps == 1 and controller.counts().sweeps == 1
    worker.close()
    assert worker.root.is_dir()  # the controller's folder: the worker leaves it to the controller
    monkeypatch.delenv(ENV)
    alone = RayCounter(worker="gw0")  # no controller's folder: a fresh folder of its own, as outside xdist
    assert alone.owned and alone.root.name.startswith("nas-ray-")
    alone.close()
    assert not alone.root.exists()
    monkeypatch.setenv(ENV, str(tmp_path))
    with pytest.raises(ValueError, match="gw0"):
        RayCounter(worker="w0")
