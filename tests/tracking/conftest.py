"""Fixtures of the tracking tests: MLflow runs written by hand into a real store (the store itself:
``mlflow_uri`` in tests/conftest.py)."""

from __future__ import annotations

import pytest

from nas import tracking
from tests.conftest import EXP


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
