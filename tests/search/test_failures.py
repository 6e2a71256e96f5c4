"""Failing trials: a trial that raises, reports NaN, runs out of memory or whose Ray worker is killed is recorded as
failed, with its error, in Optuna (FAIL), Ray Tune (ERROR) and MLflow (FAILED + nas.error), and the sweep goes on;
``search.max_failures`` retries a trial (in the same MLflow run) and a retry that succeeds completes it; a sweep
whose every trial failed exits 1 with the errors.

Two real ``nas sweep`` subprocesses (real Ray Tune, Optuna and MLflow) carry every case:

- ``faulty_sweep`` (module-scoped, checked by one test per behaviour): 6 trials, one at a time, with
  ``search.max_failures: 1``. The test SIGKILLs, from outside, the Ray actor process running a trial (its process
  title is ``ray::ImplicitFunc.train`` while it trains; not a fault point): the first two workers it sees (trial 0 and
  its retry, so trial 0 fails) and the third (trial 1, whose retry completes). ``NAS_TEST_FAULT`` (the point
  ``score_trial`` of :mod:`nas.faults`) makes trial 2 raise, trial 3 report a NaN metric and trial 4 run out of
  memory on every attempt (retried once, failed everywhere), and trial 5 raise on its first attempt only
  (``trial5first``: the retry completes).
- the all-failed sweep (exit 1), which cannot share a sweep with trials that complete.

The supernet is trained once per session.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from optuna.trial import TrialState

from tests.conftest import SweepRecords, nas_env, read_sweep, run_nas, sweep_with_supernet, tiny_spec_dict

pytestmark = pytest.mark.slow

TITLE = "ray::ImplicitFunc.train"
"""The process title of a Ray Tune function-trainable actor while it runs a trial."""
KILLED_TWICE, KILLED_ONCE, RETRIED = 0, 1, 5
"""Trials of ``faulty_sweep``: killed on both attempts (fails), killed on its first (retried), raising on its
first (``raise:trial5first``, retried)."""
FAULTS = {2: "NAS_TEST_FAULT=raise: injected failure", 3: "FloatingPointError", 4: "OutOfMemoryError"}
"""Trials of ``faulty_sweep`` failing on every attempt, and what their error says."""
FAULT_ENV = "raise:trial2,nan:trial3,oom:trial4,raise:trial5first"
KILLS = 3
"""Trial workers ``faulty_sweep`` kills: trial 0's two attempts, then trial 1's first."""


@dataclass
class Sweep:
    proc: subprocess.Popen
    records: SweepRecords = field(repr=False)
    log: str = field(repr=False)
    """The end of the driver's output (stdout and stderr)."""
    killed: list[int] = field(default_factory=list)
    """The trial worker pids killed, in order."""

    def optuna(self, number: int):
        return next(t for t in self.records.optuna if t.number == number)

    def ray(self, number: int):
        return next(t for t in self.records.ray if t.config["optuna_trial"] == number)

    def run(self, number: int):
        return next(r for r in self.records.trial_runs() if r.data.tags["nas.optuna_trial"] == str(number))


def _spec(multi30k, work: Path, tiny_supernet, experiment: str, **search) -> Path:
    raw = tiny_spec_dict(multi30k, work, search={"beam_size": 2, "latency_sentences": 2, "method": "random", **search},
                         tracking={"experiment": experiment})
    return sweep_with_supernet(raw, work, tiny_supernet)


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


def _sweep_killing_workers(spec_file: Path, env: dict[str, str], work: Path, kills: int) -> Sweep:
    """Run ``nas sweep`` and SIGKILL the first ``kills`` distinct trial workers it runs, each as soon as it is
    seen."""
    log_path = work / "sweep.log"
    killed: list[int] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "nas.cli", "sweep", str(spec_file)], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=work, text=True)
        deadline = time.time() + 900
        try:
            while len(killed) < kills and proc.poll() is None and time.time() < deadline:
                fresh = [pid for pid in _trial_workers(proc.pid) if pid not in killed]
                if fresh:
                    os.kill(fresh[0], signal.SIGKILL)
                    killed.append(fresh[0])
                time.sleep(0.05)
            proc.wait(timeout=max(deadline - time.time(), 1))
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log_path.read_text()
    assert len(killed) == kills, f"killed {len(killed)} of {kills} trial workers:\n" + text[-3000:]
    return Sweep(proc, read_sweep(spec_file, env), text[-8000:], killed)


@pytest.fixture(scope="module")
def faulty_sweep(multi30k, tiny_supernet, tmp_path_factory) -> Sweep:
    work = tmp_path_factory.mktemp("faulty_sweep")
    spec_file = _spec(multi30k, work, tiny_supernet, "faults", trials=6, max_concurrent=1, max_failures=1)
    return _sweep_killing_workers(spec_file, nas_env(work, NAS_TEST_FAULT=FAULT_ENV), work, KILLS)


def test_a_sweep_with_failing_and_killed_trials_goes_on_and_records_each_trial_once(faulty_sweep):
    s = faulty_sweep
    assert s.proc.returncode == 0, s.log
    assert sorted(t.number for t in s.records.optuna) == list(range(6)), s.log
    states = {t.number: t.state for t in s.records.optuna}
    assert states == {0: TrialState.FAIL, 1: TrialState.COMPLETE, 2: TrialState.FAIL, 3: TrialState.FAIL,
                      4: TrialState.FAIL, 5: TrialState.COMPLETE}, s.log
    ray_status = {t.config["optuna_trial"]: t.status for t in s.records.ray}
    assert ray_status == {0: "ERROR", 1: "TERMINATED", 2: "ERROR", 3: "ERROR", 4: "ERROR", 5: "TERMINATED"}, s.log
    runs = s.records.trial_runs()
    assert sorted(int(r.data.tags["nas.optuna_trial"]) for r in runs) == list(range(6)), s.log  # retries reuse it
    assert {n: s.run(n).info.status for n in range(6)} == {0: "FAILED", 1: "FINISHED", 2: "FAILED", 3: "FAILED",
                                                           4: "FAILED", 5: "FINISHED"}
    assert not [r for r in s.records.runs if r.info.status == "RUNNING"]
    assert [r.info.status for r in s.records.roles("sweep")] == ["FINISHED"]
    assert "completed 2, failed 4" in s.log


def test_raising_nan_and_out_of_memory_trials_are_failed_everywhere_after_their_retry(faulty_sweep):
    """``always`` faults (``trialN``) under ``max_failures: 1``: retried once, then failed everywhere."""
    s = faulty_sweep
    for n, text in FAULTS.items():
        assert s.optuna(n).state == TrialState.FAIL, (n, s.log)
        assert text in s.optuna(n).user_attrs["error"], s.optuna(n).user_attrs
        assert s.ray(n).status == "ERROR" and s.ray(n).num_failures == 2, (n, s.ray(n).num_failures, s.log)
        assert s.run(n).info.status == "FAILED" and text in s.run(n).data.tags["nas.error"], s.run(n).data.tags
        assert s.run(n).data.tags["nas.retries"] == "1" and text in s.run(n).data.tags["nas.last_error"]
    assert "valid_loss=nan" in s.optuna(3).user_attrs["error"]  # the metric named
    assert "lower search.max_concurrent" in s.optuna(4).user_attrs["error"]  # the fix named


def test_a_killed_worker_fails_its_trial_everywhere_and_the_sweep_goes_on(faulty_sweep):
    """Trial 0's worker is killed on both its attempts (``max_failures: 1``)."""
    s = faulty_sweep
    failed = s.optuna(KILLED_TWICE)
    assert failed.state == TrialState.FAIL, s.log
    error = failed.user_attrs.get("error", "")
    assert "died" in error and "NAS_TEST_FAULT" not in error, failed.user_attrs  # why it failed: Ray's actor death
    assert s.ray(KILLED_TWICE).status == "ERROR" and s.ray(KILLED_TWICE).num_failures == 2, s.log
    run = s.run(KILLED_TWICE)
    assert run.info.status == "FAILED" and run.data.tags.get("nas.error") and run.data.tags["nas.retries"] == "1"
    assert all(s.optuna(n).state == TrialState.COMPLETE for n in (KILLED_ONCE, RETRIED)), s.log  # the sweep went on


def test_a_killed_worker_is_retried_with_max_failures(faulty_sweep):
    s = faulty_sweep
    assert s.optuna(KILLED_ONCE).state == TrialState.COMPLETE, s.log
    assert s.ray(KILLED_ONCE).status == "TERMINATED" and s.ray(KILLED_ONCE).num_failures == 1, s.log
    run = s.run(KILLED_ONCE)  # the retry reuses its run
    assert run.info.status == "FINISHED" and run.data.tags["nas.retries"] == "1" and "nas.error" not in run.data.tags
    assert run.data.metrics["bleu"] >= 0


def test_max_failures_retries_a_trial_until_it_succeeds(faulty_sweep):
    """``raise:trial5first``: trial 5 raises on its first attempt only."""
    s = faulty_sweep
    assert s.optuna(RETRIED).state == TrialState.COMPLETE, s.log
    assert s.ray(RETRIED).status == "TERMINATED" and s.ray(RETRIED).num_failures == 1, s.log
    run = s.run(RETRIED)  # the retry reuses its run
    assert run.info.status == "FINISHED" and run.data.tags["nas.retries"] == "1"
    assert "injected failure" in run.data.tags["nas.last_error"]
    assert "nas.error" not in run.data.tags and run.data.metrics["bleu"] >= 0


def test_sweep_whose_every_trial_failed_exits_1_with_the_errors(multi30k, tmp_path, tiny_supernet):
    """Also the control for the retried trial: ``raise:first`` does fail every trial when max_failures is 0."""
    spec_file = _spec(multi30k, tmp_path, tiny_supernet, "faults", trials=2, max_concurrent=2)
    env = nas_env(tmp_path, NAS_TEST_FAULT="raise:first")
    proc = run_nas(["sweep", str(spec_file)], env, tmp_path)
    records, log = read_sweep(spec_file, env), proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.returncode == 1, log
    summary = proc.stderr[proc.stderr.find("error: all 2 search trials"):]  # the CLI's one message, at the end
    assert summary and 'cli.py", line' not in proc.stderr, log  # ended by the CLI, not by a driver traceback
    assert "trial 0: RuntimeError: NAS_TEST_FAULT=raise: injected failure in Optuna trial 0" in summary
    assert "trial 1: RuntimeError: NAS_TEST_FAULT=raise: injected failure in Optuna trial 1" in summary
    assert [t.state for t in records.optuna] == [TrialState.FAIL] * 2
    assert sorted(t.status for t in records.ray) == ["ERROR", "ERROR"]
    assert sorted(r.info.status for r in records.trial_runs()) == ["FAILED", "FAILED"]
    assert [r.info.status for r in records.roles("sweep")] == ["FAILED"]
