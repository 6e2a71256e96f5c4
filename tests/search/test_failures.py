"""Failing trials: a trial that raises, reports NaN or runs out of memory is recorded as failed, with its
error, in Optuna (FAIL), Ray Tune (ERROR) and MLflow (FAILED + nas.error), and the sweep goes on; a sweep
whose every trial failed exits 1 with the errors; ``search.max_failures`` retries a trial.

Faults come from the test-only hook ``NAS_TEST_FAULT`` armed through :mod:`nas.faults` (the point ``score_trial``);
Ray Tune, Optuna and MLflow are the real ones. The supernet is trained once per session.
"""

from __future__ import annotations

import pytest
from optuna.trial import TrialState

from tests.conftest import nas_env, read_sweep, run_nas, sweep_with_supernet, tiny_spec_dict

pytestmark = pytest.mark.slow


def _sweep(multi30k, tmp_path, tiny_supernet, fault: str, trials: int = 3, **search):
    raw = tiny_spec_dict(multi30k, tmp_path, search={"trials": trials, "max_concurrent": 2, "beam_size": 2,
                                                     "latency_sentences": 2, "method": "random", **search},
                         tracking={"experiment": "faults"})
    spec_file = sweep_with_supernet(raw, tmp_path, tiny_supernet)
    env = nas_env(tmp_path, NAS_TEST_FAULT=fault)
    proc = run_nas(["sweep", str(spec_file)], env, tmp_path)
    return proc, read_sweep(spec_file, env), proc.stdout[-3000:] + proc.stderr[-5000:]


def test_raising_nan_and_out_of_memory_trials_are_failed_everywhere_and_the_sweep_goes_on(multi30k, tmp_path,
                                                                                         tiny_supernet):
    """One sweep carries the three independent faults, one trial each (``NAS_TEST_FAULT``'s ``trialN``): trial 0
    raises, trial 1 reports a NaN metric, trial 2 runs out of memory, trial 3 completes."""
    proc, records, log = _sweep(multi30k, tmp_path, tiny_supernet, "raise:trial0,nan:trial1,oom:trial2", trials=4)
    assert proc.returncode == 0, log
    errors = {0: "NAS_TEST_FAULT=raise: injected failure", 1: "FloatingPointError", 2: "OutOfMemoryError"}
    assert [t.state for t in records.optuna] == [TrialState.FAIL] * 3 + [TrialState.COMPLETE], log
    for n, text in errors.items():
        assert text in records.optuna[n].user_attrs["error"], records.optuna[n].user_attrs
    assert "valid_loss=nan" in records.optuna[1].user_attrs["error"]  # the metric named
    assert "lower search.max_concurrent" in records.optuna[2].user_attrs["error"]  # the fix named
    ray_status = {t.config["optuna_trial"]: t.status for t in records.ray}
    assert ray_status == {0: "ERROR", 1: "ERROR", 2: "ERROR", 3: "TERMINATED"}, log
    runs = {int(r.data.tags["nas.optuna_trial"]): r for r in records.trial_runs()}
    assert len(records.trial_runs()) == 4 and sorted(runs) == [0, 1, 2, 3]
    assert [runs[n].info.status for n in range(4)] == ["FAILED"] * 3 + ["FINISHED"]
    for n, text in errors.items():
        assert text in runs[n].data.tags["nas.error"]
    assert "nas.error" not in runs[3].data.tags and runs[3].data.metrics["bleu"] >= 0
    assert [r.info.status for r in records.roles("sweep")] == ["FINISHED"]
    assert "completed 1, failed 3" in proc.stdout


def test_sweep_whose_every_trial_failed_exits_1_with_the_errors(multi30k, tmp_path, tiny_supernet):
    """Also the control for the retry test: ``raise:first`` does fail every trial when max_failures is 0."""
    proc, records, log = _sweep(multi30k, tmp_path, tiny_supernet, "raise:first", trials=2)
    assert proc.returncode == 1, log
    summary = proc.stderr[proc.stderr.find("error: all 2 search trials"):]  # the CLI's one message, at the end
    assert summary and 'cli.py", line' not in proc.stderr, log  # ended by the CLI, not by a driver traceback
    assert "trial 0: RuntimeError: NAS_TEST_FAULT=raise: injected failure in Optuna trial 0" in summary
    assert "trial 1: RuntimeError: NAS_TEST_FAULT=raise: injected failure in Optuna trial 1" in summary
    assert [t.state for t in records.optuna] == [TrialState.FAIL] * 2
    assert sorted(t.status for t in records.ray) == ["ERROR", "ERROR"]
    assert sorted(r.info.status for r in records.trial_runs()) == ["FAILED", "FAILED"]
    assert [r.info.status for r in records.roles("sweep")] == ["FAILED"]


def test_max_failures_retries_a_trial_until_it_succeeds(multi30k, tmp_path, tiny_supernet):
    proc, records, log = _sweep(multi30k, tmp_path, tiny_supernet, "raise:first", trials=2, max_failures=1)
    assert proc.returncode == 0, log
    assert [t.state for t in records.optuna] == [TrialState.COMPLETE] * 2, log
    assert sorted(t.status for t in records.ray) == ["TERMINATED"] * 2
    assert all(t.num_failures == 1 for t in records.ray), [t.num_failures for t in records.ray]
    runs = records.trial_runs()
    assert len(runs) == 2 and sorted(r.data.tags["nas.optuna_trial"] for r in runs) == ["0", "1"]  # retry reuses its run
    assert all(r.info.status == "FINISHED" and r.data.tags["nas.retries"] == "1" for r in runs)
    assert all("injected failure" in r.data.tags["nas.last_error"] for r in runs)

