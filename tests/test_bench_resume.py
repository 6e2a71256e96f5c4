"""benchmarks/bench_resume.py's audit names every loss, duplicate and RUNNING run (on hand-made records).

The bench's own CI-sized run (6 trials, a SIGKILL at each named kill point, 4 Ray sweeps) left the suite: its kills
are made on the one sweep of ``tests/search/test_interrupt.py`` (``checkpoint_write``, ``after_tell``,
``mlflow_write``; ``level1_batch`` there too), which ends with this audit of its records, and in
``tests/data/test_encode.py`` (``data_prepare``, without Ray). Run the bench by hand:
``python benchmarks/bench_resume.py --trials 6 --kills 4 --seed 1``."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from tests.conftest import load_script


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
