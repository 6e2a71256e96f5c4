"""A Ray worker killed mid-trial by an outside ``kill -9`` (not a fault point): the trial is recorded as failed in
Optuna (FAIL, with the error), Ray Tune (ERROR) and MLflow (FAILED, no run left RUNNING), or retried to completion
with ``search.max_failures``; it is never lost and the sweep goes on.

The sweep is a real ``nas sweep`` subprocess (real Ray Tune, Optuna and MLflow); the test finds the Ray actor
process that runs a trial (its process title is ``ray::ImplicitFunc.train`` while it trains) and SIGKILLs it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from optuna.trial import TrialState

from tests.conftest import nas_env, read_sweep, sweep_with_supernet, tiny_spec_dict

pytestmark = pytest.mark.slow

TITLE = "ray::ImplicitFunc.train"
"""The process title of a Ray Tune function-trainable actor while it runs a trial."""


def _trial_workers(root: int) -> list[int]:
    """Pids of the descendants of ``root`` (the sweep's driver, which starts its local Ray cluster) whose title
    says they are running a Ray Tune trial; another sweep's workers on the machine are never touched."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines()]
    parent = {int(r[0]): int(r[1]) for r in rows}

    def below_root(pid: int) -> bool:
        while pid > 1:
            if pid == root:
                return True
            pid = parent.get(pid, 1)
        return False

    return [int(r[0]) for r in rows if len(r) == 3 and TITLE in r[2] and below_root(int(r[0]))]


def _sweep_killing_one_worker(multi30k, tmp_path, tiny_supernet, **search):
    """Run a 3-trial sweep (one trial at a time) and SIGKILL the first trial worker seen; returns
    (process, records, log, killed pid)."""
    raw = tiny_spec_dict(multi30k, tmp_path, search={"trials": 3, "max_concurrent": 1, "beam_size": 2,
                                                     "latency_sentences": 2, "method": "random", **search},
                         tracking={"experiment": "worker-kill"})
    spec_file = sweep_with_supernet(raw, tmp_path, tiny_supernet)
    env = nas_env(tmp_path)
    log_path = tmp_path / "sweep.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "nas.cli", "sweep", str(spec_file)], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=tmp_path, text=True)
        killed = None
        deadline = time.time() + 600
        try:
            while killed is None and proc.poll() is None and time.time() < deadline:
                workers = _trial_workers(proc.pid)
                if workers:
                    killed = workers[0]
                    os.kill(killed, signal.SIGKILL)
                time.sleep(0.05)
            proc.wait(timeout=max(deadline - time.time(), 1))
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log_path.read_text()
    assert killed is not None, "no trial worker was seen running:\n" + text[-3000:]
    return proc, read_sweep(spec_file, env), text[-6000:], killed


def test_a_killed_worker_fails_its_trial_everywhere_and_the_sweep_goes_on(multi30k, tmp_path, tiny_supernet):
    proc, records, log, killed = _sweep_killing_one_worker(multi30k, tmp_path, tiny_supernet)
    assert proc.returncode == 0, log
    states = [t.state for t in records.optuna]
    assert len(states) == 3 and sorted(t.number for t in records.optuna) == [0, 1, 2], log
    assert states.count(TrialState.FAIL) == 1 and states.count(TrialState.COMPLETE) == 2, (states, log)
    failed = next(t for t in records.optuna if t.state == TrialState.FAIL)
    assert failed.user_attrs.get("error"), failed.user_attrs  # why it failed is recorded
    ray_status = {t.config["optuna_trial"]: t.status for t in records.ray}
    assert ray_status[failed.number] == "ERROR" and sorted(ray_status.values()) == ["ERROR", "TERMINATED", "TERMINATED"]
    runs = records.trial_runs()
    assert sorted(int(r.data.tags["nas.optuna_trial"]) for r in runs) == [0, 1, 2], log  # one run per trial
    by_trial = {int(r.data.tags["nas.optuna_trial"]): r for r in runs}
    assert by_trial[failed.number].info.status == "FAILED" and by_trial[failed.number].data.tags.get("nas.error")
    assert all(r.info.status == "FINISHED" for n, r in by_trial.items() if n != failed.number)
    assert not [r for r in records.runs if r.info.status == "RUNNING"]
    assert "completed 2, failed 1" in log


def test_a_killed_worker_is_retried_with_max_failures(multi30k, tmp_path, tiny_supernet):
    proc, records, log, killed = _sweep_killing_one_worker(multi30k, tmp_path, tiny_supernet, max_failures=1)
    assert proc.returncode == 0, log
    assert [t.state for t in records.optuna] == [TrialState.COMPLETE] * 3, log
    assert sorted(t.status for t in records.ray) == ["TERMINATED"] * 3
    assert sum(t.num_failures for t in records.ray) == 1
    runs = records.trial_runs()
    assert sorted(int(r.data.tags["nas.optuna_trial"]) for r in runs) == [0, 1, 2], log  # the retry reuses its run
    assert all(r.info.status == "FINISHED" for r in runs)
    assert not [r for r in records.runs if r.info.status == "RUNNING"]
