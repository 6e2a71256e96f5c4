"""benchmarks/bench_resume.py asserts: its audit names every loss, duplicate and RUNNING run, and a CI-sized run
(6 trials, 3 SIGKILLs of the driver) exits 0 only when nothing was lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from tests.conftest import load_script

REPO = Path(__file__).resolve().parents[1]


def _bench():
    return load_script("benchmarks/bench_resume.py")


def _optuna(n: int, state: str = "COMPLETE"):
    return NS(state=NS(name=state, is_finished=lambda: state in ("COMPLETE", "FAIL", "PRUNED")), params={"w": n})


def _ray(n: int, status: str = "TERMINATED"):
    return NS(status=status, config={"optuna_trial": n})


def _run(n: int | None, status: str = "FINISHED", role: str = "trial"):
    tags = {"nas.role": role, **({} if n is None else {"nas.optuna_trial": str(n)})}
    return NS(info=NS(status=status), data=NS(tags=tags))


def _clean(trials: int = 3):
    return ([_optuna(n) for n in range(trials)], [_ray(n) for n in range(trials)],
            [_run(None, role="sweep"), _run(None, role="supernet"), *(_run(n) for n in range(trials))])


def test_a_clean_sweep_has_no_problem():
    counts, problems = _bench().audit(3, *_clean())
    assert problems == []
    assert counts["completed"] == {"optuna": 3, "ray": 3, "mlflow": 3}


@pytest.mark.parametrize("break_it, expected", [
    (lambda o, r, m: m.append(_run(1)), "1 trial(s) duplicated in mlflow"),
    (lambda o, r, m: r.append(_ray(2)), "1 trial(s) duplicated in ray"),
    (lambda o, r, m: o.pop(), "1 trial(s) lost in optuna"),
    (lambda o, r, m: r.pop(0), "1 trial(s) lost in ray"),
    (lambda o, r, m: m.pop(), "1 trial(s) lost in mlflow"),
    (lambda o, r, m: m.__setitem__(2, _run(0, status="RUNNING")), "1 MLflow run(s) left RUNNING"),
    (lambda o, r, m: m.append(_run(None)), "1 MLflow trial run(s) without a nas.optuna_trial tag"),
    (lambda o, r, m: o.__setitem__(0, _optuna(0, "RUNNING")), "1 trial(s) RUNNING in optuna"),
    (lambda o, r, m: r.__setitem__(0, _ray(0, "ERROR")), "1 trial(s) ERROR in ray"),
])
def test_every_loss_duplicate_and_running_run_is_a_problem(break_it, expected):
    optuna_trials, ray_trials, runs = _clean()
    break_it(optuna_trials, ray_trials, runs)
    _, problems = _bench().audit(3, optuna_trials, ray_trials, runs)
    assert expected in problems


@pytest.mark.slow
def test_ci_sized_run_of_six_trials_killed_at_each_named_point_loses_nothing(multi30k, tmp_path):
    """4 SIGKILLs, one at each kill point of nas.faults: inside data preparation, inside a checkpoint write, as an
    MLflow write starts, and between Optuna's tell and the MLflow run's end; the sweep resumed after each."""
    out = tmp_path / "bench_resume.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_resume.py"), "--trials", "6", "--kills",
                           "4", "--train-steps", "16", "--seed", "1", "--work", str(tmp_path / "work"),
                           "--json", str(out)], capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads(out.read_text())
    assert summary["problems"] == [] and summary["kills"] == 4, summary
    assert [k.get("point") for k in summary["kill_log"]] == ["data_prepare", "checkpoint_write", "mlflow_write",
                                                            "after_tell"], summary["kill_log"]
    assert summary["completed"] == {"optuna": 6, "ray": 6, "mlflow": 6}
    assert "OK: 6 trials, 4 kills" in proc.stdout
