"""Fixtures of the tracking tests: MLflow runs written by hand into a real store (the store itself:
``mlflow_uri`` in tests/conftest.py)."""

from __future__ import annotations

import shutil

import pytest

from nas import tracking
from tests.conftest import EXP

QUICKSTART = "quickstart"
"""The experiment of :func:`quickstart_store_db`."""


def _trial(parent, name, *, status="FINISHED", role="trial", **metrics):
    run_id = tracking.start_run(
        EXP, name, role=role, parent_run_id=parent,
        tags={"nas.arch_summary": f"arch-{name}", "nas.arch_id": f"id-{name}",
              "nas.trial_id": name},
    )
    tracking.log_metrics(run_id, metrics)
    if status is not None:
        tracking.end_run(run_id, status)
    return run_id


@pytest.fixture
def populated(mlflow_uri):
    """Two sweeps; sweep A: 4 finished trials + 1 failed + 1 running + supernet; sweep B: 1 trial."""
    a = tracking.start_run(EXP, "sweep-a", role="sweep", tags={"nas.sweep_id": "A"})
    b = tracking.start_run(EXP, "sweep-b", role="sweep", tags={"nas.sweep_id": "B"})
    ids = {
        "t1": _trial(a, "t1", bleu=20.0, chrf=45.0, latency_ms=30.0, params_m=40.0, valid_loss=3.0),
        "t2": _trial(a, "t2", bleu=25.0, chrf=50.0, latency_ms=50.0, params_m=60.0, valid_loss=2.5),
        "t3": _trial(a, "t3", bleu=22.0, chrf=48.0, latency_ms=10.0, params_m=20.0, valid_loss=2.8),
        "t4": _trial(a, "t4", bleu=18.0, chrf=40.0, latency_ms=20.0, params_m=30.0, valid_loss=3.2),
        "failed": _trial(a, "failed", status="FAILED", bleu=99.0, latency_ms=1.0),
        "running": _trial(a, "running", status=None, bleu=98.0, latency_ms=2.0),
        "supernet": _trial(a, "supernet", role="supernet", bleu=97.0, latency_ms=0.5),
        "b1": _trial(b, "b1", bleu=30.0, chrf=55.0, latency_ms=40.0, params_m=50.0, valid_loss=2.0),
    }
    for sweep in (a, b):
        tracking.end_run(sweep)
    return ids


@pytest.fixture(scope="session")
def quickstart_store_db(tmp_path_factory):
    """A SQLite MLflow store (built once per session) holding a quickstart-like sweep under ``latency_ratio<=1.25``
    whose trials take 69-108 ms: ``a`` (1.10x) and ``b`` (1.20x) meet the budget, ``c`` (1.70x) does not."""
    root = tmp_path_factory.mktemp("quickstart-store")
    ids = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root}/mlflow.db")
        mp.chdir(root)
        sweep = tracking.start_run(QUICKSTART, "sweep", role="sweep", tags={"nas.sweep_id": "S"},
                                   params={tracking.PARAM_CONSTRAINTS: "latency_ratio<=1.25"})
        for name, bleu, ms, ratio in (("a", 20.0, 69.0, 1.10), ("b", 22.0, 75.0, 1.20), ("c", 24.0, 108.0, 1.70)):
            ids[name] = tracking.start_run(QUICKSTART, name, role="trial", parent_run_id=sweep,
                                           tags={"nas.arch_summary": f"arch-{name}", "nas.sweep_id": "S"})
            tracking.log_metrics(ids[name], {"bleu": bleu, "latency_ms": ms, "latency_ratio": ratio,
                                             "latency_reference_ms": ms / ratio})
            tracking.end_run(ids[name], "FINISHED")
        tracking.end_run(sweep)
    return root / "mlflow.db", ids


@pytest.fixture
def quickstart_store(quickstart_store_db, tmp_path, monkeypatch):
    """A copy of :func:`quickstart_store_db` in ``tmp_path`` (the tracking store and the current folder); returns the trial
    run ids by name."""
    shutil.copyfile(quickstart_store_db[0], tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.chdir(tmp_path)
    return quickstart_store_db[1]
