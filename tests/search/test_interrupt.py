"""Ctrl-C, SIGTERM and SIGKILL on `nas sweep` while the search runs, in a subprocess with real Ray Tune, Optuna and
MLflow: SIGINT to the driver's process group (what a terminal sends), SIGTERM to the driver (`kill PID`).
The sweep stops there with one line naming the way back in (exit 130 or 143), leaves no MLflow run RUNNING,
and the same sweep resumed finishes every trial.

Before, Ray Tune caught SIGINT inside ``Tuner.fit``, printed its ``Tuner.restore(...)`` advice and returned
as if the stage were done; SIGTERM reached Ray's C++ failure handler, which printed a stack trace and aborted
the driver (exit 134) with its runs left RUNNING.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from optuna.trial import TrialState

from tests.conftest import (completed_trials, kill_driver, nas_env, read_sweep, run_nas, sweep_with_supernet,
                            tiny_spec_dict)

TRIALS = 7
"""Ctrl-C after the first trial completes, SIGTERM after the next, SIGKILL after the next (2 at a time): at least one
left at each stop."""


def _start(args: list[str], env: dict, cwd: Path, name: str) -> tuple[subprocess.Popen, Path, Path]:
    out_log, err_log = cwd / f"{name}.stdout.log", cwd / f"{name}.stderr.log"
    with open(out_log, "w") as out, open(err_log, "w") as err:  # files: a full pipe would stall the driver
        proc = subprocess.Popen([sys.executable, "-m", "nas.cli", *args], env=env, cwd=cwd, stdout=out, stderr=err,
                                start_new_session=True)
    return proc, out_log, err_log


def _wait_done(proc: subprocess.Popen, err_log: Path, run_dir: Path, done: int, name: str) -> list[int]:
    deadline = time.monotonic() + 600
    while len(found := completed_trials(run_dir)) < done:
        assert proc.poll() is None, f"{name}: the sweep ended before {done} trial(s) completed:\n" + \
            err_log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"{name}: {done} trial(s) not completed in 600 s"
        time.sleep(0.2)
    return found


def _stop_when_done(args: list[str], env: dict, cwd: Path, run_dir: Path, done: int, sig: int, name: str):
    """Run ``nas ARGS`` in a new session; once ``done`` trials are COMPLETE in the journal, send ``sig`` the way a
    user does (Ctrl-C: to the foreground process group; SIGTERM: ``kill PID``). Returns (rc, stdout, stderr)."""
    proc, out_log, err_log = _start(args, env, cwd, name)
    try:
        _wait_done(proc, err_log, run_dir, done, name)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # Ctrl-C: the terminal signals the foreground process group
        else:
            proc.send_signal(sig)  # `kill PID`
        proc.wait(timeout=120)
    finally:  # the driver, if it still runs, and any Ray process left in its group
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return proc.returncode, out_log.read_text(), err_log.read_text()


def _says_stopped_in_one_line(sig: int, rc: int, stdout: str, stderr: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert rc == 128 + sig, f"rc {rc}\n{stdout[-2000:]}\n{stderr[-4000:]}"
    said = "interrupted" if sig == signal.SIGINT else "SIGTERM"
    assert lines[-1].startswith(f"error: {said}: sweep tiny stopped"), stderr[-4000:]
    assert "`nas sweep --resume tiny --workdir " in lines[-1], lines[-1]
    leaked = [w for w in ("Traceback", "Tuner.restore", "SIGTERM received") if w in stderr]  # Ray's C++ handler
    assert not leaked, stderr[-4000:]
    assert "supernet: widest sub-Transformer" not in stdout, "the sweep went on after the stop"


def _left_nothing_running(spec_file: Path, env: dict, done_before: int) -> int:
    """The stopped sweep's records: more trials complete than before the run, fewer than all, no MLflow run
    RUNNING, the parent KILLED. Returns the number complete."""
    stopped = read_sweep(spec_file, env)
    done = len([t for t in stopped.optuna if t.state == TrialState.COMPLETE])
    assert done_before < done < TRIALS, f"{done} of {TRIALS} complete, {done_before} before: stopped too late to test it"
    assert "RUNNING" not in {r.info.status for r in stopped.runs}, [(r.data.tags, r.info.status) for r in stopped.runs]
    (parent,) = stopped.roles("sweep")
    assert parent.info.status == "KILLED"
    return done


@pytest.mark.slow
def test_ctrl_c_sigterm_and_sigkill_stop_the_sweep_in_turn_and_the_same_sweep_resumes_each_time(multi30k, tmp_path,
                                                                                                tiny_supernet):
    """One multi-objective sweep (TPE, 2 trials at a time), stopped three times and resumed after each:

    1. Ctrl-C on the first run (exit 130) and SIGTERM on its resume (exit 143): each stops at a safe point with one
       line naming the way back in, no traceback, and no MLflow run RUNNING (the parent KILLED). (Before, Ray Tune
       swallowed Ctrl-C, and SIGTERM aborted the driver with its runs RUNNING.)
    2. SIGKILL of the next resume's driver and its Ray processes once another trial completed (no safe point: runs
       are left RUNNING); ``--status`` shows the counts; the last resume marks the stale runs KILLED, finishes every
       trial once in Optuna, Ray Tune and MLflow, and re-scores none that had completed.

    (One sweep for the three: the stop and the resume do not depend on which run of a sweep is stopped.)"""
    raw = tiny_spec_dict(multi30k, tmp_path, **{
        "search": {"trials": TRIALS, "max_concurrent": 2, "beam_size": 2, "latency_sentences": 2, "method": "tpe",
                   "metrics": [{"name": "bleu", "goal": "maximize"}, {"name": "latency_ms", "goal": "minimize"}]},
        "tracking": {"experiment": "interrupt"},
    })
    spec_file = sweep_with_supernet(raw, tmp_path, tiny_supernet)  # the session's supernet: the search starts at once
    env = nas_env(tmp_path)
    run_dir = tmp_path / "runs" / "tiny"
    resume = ["sweep", "--resume", "tiny", "--workdir", str(tmp_path / "runs")]

    rc, stdout, stderr = _stop_when_done(["sweep", str(spec_file)], env, tmp_path, run_dir, 1, signal.SIGINT, "ctrl-c")
    _says_stopped_in_one_line(signal.SIGINT, rc, stdout, stderr)
    done = _left_nothing_running(spec_file, env, 0)

    rc, stdout, stderr = _stop_when_done(resume, env, tmp_path, run_dir, done + 1, signal.SIGTERM, "sigterm")
    _says_stopped_in_one_line(signal.SIGTERM, rc, stdout, stderr)
    assert "resuming sweep" in stdout + stderr, stderr[-2000:]
    done = _left_nothing_running(spec_file, env, done)

    proc, _, err_log = _start(resume, env, tmp_path, "sigkill")
    try:
        completed = _wait_done(proc, err_log, run_dir, done + 1, "sigkill")
    finally:
        kill_driver(proc)
    assert proc.returncode == -signal.SIGKILL
    assert (run_dir / "supernet" / "metrics.json").is_file()
    before = read_sweep(spec_file, env)
    assert len([t for t in before.optuna if t.state == TrialState.COMPLETE]) < TRIALS, "killed too late to test resume"
    assert "RUNNING" in {r.info.status for r in before.runs}, "the kill should leave runs RUNNING"
    sweep_id = json.loads((run_dir / "sweep.json").read_text())["sweep_id"]
    results = {n: run_dir / "trials" / sweep_id / f"{n:05d}.json" for n in completed}
    stamps = {n: p.stat().st_mtime_ns for n, p in results.items()}

    status = run_nas(["sweep", "--status", "tiny", "--workdir", "runs"], env, tmp_path)
    assert status.returncode == 0, status.stderr[-3000:]
    assert "optuna" in status.stdout and "COMPLETE" in status.stdout and "RUNNING" in status.stdout

    resumed = run_nas(["sweep", "--resume", "tiny", "--workdir", "runs"], env, tmp_path)  # no FILE: the saved copy
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    assert "(resumed)" in resumed.stdout
    # runs the killed driver left RUNNING (the parent run goes on): ended as KILLED on resume. A kill between two
    # trials can leave only the parent RUNNING, and then there is nothing to mark.
    stale = [r for r in before.runs if r.info.status == "RUNNING" and r.data.tags.get("nas.role") != "sweep"]
    if stale:
        assert f"marked {len(stale)} MLflow run(s) left RUNNING" in resumed.stderr, resumed.stderr[-3000:]
    else:
        assert "marked" not in resumed.stderr, resumed.stderr[-3000:]

    after = read_sweep(spec_file, env)
    assert len(after.optuna) == TRIALS and all(t.state == TrialState.COMPLETE for t in after.optuna)
    assert Counter(t.config["optuna_trial"] for t in after.ray) == Counter(range(TRIALS))  # one Ray trial each
    assert {t.status for t in after.ray} == {"TERMINATED"}
    runs = after.trial_runs()
    assert sorted(int(r.data.tags["nas.optuna_trial"]) for r in runs) == list(range(TRIALS)), "duplicate MLflow runs"
    assert {r.info.status for r in after.runs} == {"FINISHED"}, Counter(r.info.status for r in after.runs)
    assert all({"bleu", "latency_ms"} <= set(r.data.metrics) for r in runs)
    (parent,) = after.roles("sweep")
    assert parent.data.tags["nas.resumes"] == "3" and len(after.roles("supernet")) == 1
    for n, path in results.items():  # completed before the kill: reported again from its file, not re-scored
        assert path.stat().st_mtime_ns == stamps[n]
    optuna_values = {t.number: t.values for t in after.optuna}
    for r in runs:
        n = int(r.data.tags["nas.optuna_trial"])
        assert r.data.metrics["bleu"] == pytest.approx(optuna_values[n][0])  # Optuna and MLflow agree

    status = run_nas(["sweep", "--status", "tiny", "--workdir", "runs"], env, tmp_path)
    assert f"COMPLETE {TRIALS}" in status.stdout and f"TERMINATED {TRIALS}" in status.stdout
    assert f"FINISHED {TRIALS}; duplicates 0" in status.stdout


def _count(config):
    from ray import tune

    for i in range(1000):
        tune.report({"i": i})


class _SignalOnResult:
    """A Tune callback that sends this process a signal from inside ``on_trial_result`` (where the MLflow callback
    writes) and records whether its own code after the signal ran."""

    def __new__(cls, sig: int):
        from ray import tune

        class SignalOnResult(tune.Callback):
            sent = finished = False

            def on_trial_result(self, iteration, trials, trial, result, **info):
                if not self.sent:
                    self.sent = True
                    os.kill(os.getpid(), sig)
                    time.sleep(0.2)  # the handler runs here, in this frame
                    self.finished = True

        return SignalOnResult()


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray cluster for both signals' Tune loops (started once, shut down after the module). Two CPUs: the
    stopped loop's trial actor keeps its CPU until the cluster shuts down (a sweep shuts Ray down after a stop)."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_signal_inside_a_tune_callback_is_raised_at_the_next_step_not_inside_it(sig, tmp_path, local_ray):
    """The deferral itself, on a real Ray Tune loop: the signal lands inside a callback's write, which finishes;
    ``SweepStopped`` comes out of ``fit`` with the signal's number, and the previous handlers are back after."""
    from ray import tune

    from nas.search.failures import SweepStopped
    from nas.search.stop import fit, handle_stop_signals
    from nas.search.tune import run_config

    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    restore = handle_stop_signals()
    sender = _SignalOnResult(sig)
    try:
        tuner = tune.Tuner(_count, tune_config=tune.TuneConfig(num_samples=1),
                           run_config=run_config(tmp_path / "exp", [sender], 0))
        with pytest.raises(SweepStopped) as stopped:
            fit(tuner)
    finally:
        restore()
        del os.environ["TUNE_DISABLE_SIGINT_HANDLER"]
    assert stopped.value.signum == sig
    assert sender.sent and sender.finished, "the signal raised inside the callback"
    assert {s: signal.getsignal(s) for s in before} == before
