"""Ctrl-C, SIGTERM and SIGKILL on `nas sweep` while the search runs, in a subprocess with real Ray Tune, Optuna and
MLflow: SIGINT to the driver's process group (what a terminal sends), SIGTERM to the driver (`kill PID`).
The sweep stops there with one line naming the way back in (exit 130 or 143), leaves no MLflow run RUNNING,
and the same sweep resumed finishes every trial.

The sweep is a two-level one (``search.method: evolution``) that trains its own supernet, and the same sweep is also
killed at the named kill points of :mod:`nas.faults` (``NAS_TEST_KILL``; the kills of ``benchmarks/bench_resume.py``,
folded in here): inside a supernet checkpoint write (in the Ray worker), once level 1 told Optuna its second batch,
between Optuna's tell and the trial's MLflow run's end, and as an MLflow write starts; resumed after each, it loses,
duplicates and re-scores nothing (the bench's own audit). With it the user's named arch from a point file
(``{file: baselines.yaml}``). A SIGKILL of the driver from outside, at no named point, is
``tests/infra/test_cluster.py``'s; a kill of a trial's Ray actor, ``tests/search/test_failures.py``'s; a kill inside
data preparation, ``tests/data/test_encode.py``'s. Ctrl-C stops a driver that started its own local Ray (a laptop's
sweep); the other runs of the sweep and this module's in-process Tune loops share one running cluster (``--address``),
so the module starts two Ray clusters, not eight (issue 40: the suite's Ray starts).

Before, Ray Tune caught SIGINT inside ``Tuner.fit``, printed its ``Tuner.restore(...)`` advice and returned
as if the stage were done; SIGTERM reached Ray's C++ failure handler, which printed a stack trace and aborted
the driver (exit 134) with its runs left RUNNING.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from nas.space import load_spec
from nas.space.space import SearchSpace
from tests.conftest import (REPO, completed_trials, kill_driver, load_script, nas_cli, nas_env, read_sweep, run_nas,
                            tiny_spec_dict, use_tiny_data)

TRIALS = 7
"""Level 2's trials. Ctrl-C after the first trial completes, SIGTERM after the next, the kill after Optuna's tell
after the next, the kill at an MLflow write at most one more (2 at a time): at least one left at each stop."""
POPULATION, GENERATIONS, BATCH = 4, 4, 2
"""Level 1: generation 0 is two batches, scored at once (``max_concurrent`` 2), so the kill after the second batch
leaves none in flight; ``POPULATION x GENERATIONS`` candidates give level 2 its ``TRIALS`` distinct archs (level 2
takes distinct archs only: 12 candidates gave 10 in one run, so 16 for a margin)."""
MINE = "enc[16/32] dec[32/32 16/32]"
"""The user's own arch, named ``mine`` in a point file beside the sweep YAML."""


def _on_cluster(env: dict) -> dict:
    """``env`` for a driver joining a running cluster (``--address``): the armed ``NAS_TEST_*`` variables reach its
    Ray workers in the job's ``runtime_env`` (``RAY_JOB_CONFIG_JSON_ENV_VAR``, as ``ray job submit`` passes it),
    since a cluster's workers inherit the cluster's environment, not the driver's."""
    armed = {k: v for k, v in env.items() if k.startswith("NAS_TEST_")}
    runtime_env = {"worker_process_setup_hook": "nas.search.ray_session.quiet_worker_exit", "env_vars": armed}
    return {**env, "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": runtime_env})}


def _start(args: list[str], env: dict, cwd: Path, name: str) -> tuple[subprocess.Popen, Path, Path]:
    if "--address" in args:
        env = _on_cluster(env)
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


def _killed_at(point: str, args: list[str], env: dict, cwd: Path, kills_log: Path, name: str) -> tuple[str, int, str]:
    """Run ``nas ARGS`` in a new session with the kill point ``point`` (``NAME:N``) armed; once the point logged its
    kill (in the driver, or in a Ray worker, after which the driver would go on), SIGKILL the driver and what it
    left in its process group, as a dead machine would lose them. Returns (point logged, its pid, stderr)."""
    before = len(kills_log.read_text().splitlines()) if kills_log.is_file() else 0
    proc, _, err_log = _start(args, {**env, "NAS_TEST_KILL": point, "NAS_TEST_KILL_LOG": str(kills_log)}, cwd, name)
    deadline = time.monotonic() + 600
    try:
        while len(kills_log.read_text().splitlines() if kills_log.is_file() else []) <= before:
            assert proc.poll() is None, f"{name}: the sweep ended before its kill at {point}:\n" + \
                err_log.read_text()[-4000:]
            assert time.monotonic() < deadline, f"{name}: no kill at {point} in 600 s"
            time.sleep(0.1)
    finally:
        kill_driver(proc)
    hit, pid = kills_log.read_text().splitlines()[before].split()
    return hit, int(pid), err_log.read_text()


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


@pytest.fixture(scope="module")
def ray_head():
    """One running one-node Ray cluster for the module (what ``ray start --head`` leaves), its address: the sweep's
    drivers join it (``--address``) and this process's Tune loops below connect to it (:func:`joined_ray`), so that
    they share one Ray instead of starting one each. Four CPUs: each stopped loop's trial actor keeps its CPU until
    its driver disconnects (a sweep disconnects after a stop), and the generations run two trials at a time."""
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(REPO))  # the cluster's workers import nas and this module (the Tune loops)
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4})
        try:
            yield cluster.address
        finally:
            cluster.shutdown()


@pytest.mark.slow
def test_kills_ctrl_c_and_sigterm_stop_the_sweep_in_turn_and_the_same_sweep_resumes_each_time(multi30k, tmp_path,
                                                                                              tiny_data, monkeypatch,
                                                                                              ray_head):
    """One two-level sweep (``search.method: evolution``; level 2 2 trials at a time), stopped six times and resumed
    after each:

    1. SIGKILL inside the supernet's second checkpoint write (``checkpoint_write:2``, in the Ray worker training
       it; the driver and its group killed after); the next run trains on from the first checkpoint, left whole,
       and finishes the supernet.
    2. SIGKILL of that run by the kill point ``level1_batch:2`` once level 1 told its second batch; the resume
       finishes level 1 to ``population x generations`` candidates over at least two NSGA-II generations, scores
       neither stored batch again, logs each generation's table to the parent run once, and level 2 scores archs
       chosen from level 1.
    3. Ctrl-C on that resume (exit 130) and SIGTERM on the next (exit 143): each stops at a safe point with one
       line naming the way back in, no traceback, and no MLflow run RUNNING (the parent KILLED). (Before, Ray Tune
       swallowed Ctrl-C, and SIGTERM aborted the driver with its runs RUNNING.)
    4. SIGKILL of the next resume's driver between Optuna's tell and the trial's MLflow run's end (``after_tell:1``;
       no safe point: runs are left RUNNING; ``--status`` shows the counts), then of the next as an MLflow write
       starts (``mlflow_write:2``); the last resume marks the stale runs KILLED, finishes every trial once in Optuna,
       Ray Tune and MLflow (``benchmarks/bench_resume.py``'s audit finds no loss, duplicate or RUNNING run), and
       re-scores none that had completed.
    5. The user's named arch from a point file (``{file: baselines.yaml}``): level 1 opens with it, level 2 scores
       it as its first trial whatever level 1 finds, tagged ``nas.point`` in MLflow, and the leaderboard names it;
       the resumes read it from the sweep's saved YAML.

    (One sweep for all: the stop and the resume do not depend on which run of a sweep is stopped.) Ctrl-C stops a
    driver that started its own local Ray (the laptop's way: the signal reaches Ray's processes too); the other six
    runs join one running cluster (``--address``, the cluster user's way: a dead driver's Ray workers are ended by
    the cluster), so the test starts two Ray clusters, not seven, and the sweep moves between the two."""
    (tmp_path / "baselines.yaml").write_text(f'mine: "{MINE}"\n', encoding="utf-8")
    raw = use_tiny_data(tiny_spec_dict(multi30k, tmp_path, **{
        "search": {"trials": TRIALS, "max_concurrent": 2, "beam_size": 2, "method": "evolution", "seed": 0,
                   "metrics": [{"name": "bleu", "goal": "maximize"}, {"name": "latency_ratio", "goal": "minimize"}],
                   "latency_workload": {"src_tokens": 6, "tgt_tokens": 4}, "latency_repeats": 2,
                   "points_to_evaluate": [{"file": "baselines.yaml"}],
                   "evolution": {"population": POPULATION, "generations": GENERATIONS, "batch_size": BATCH,
                                 "subset_sentences": 6, "predictor_samples": 4}},
        "tracking": {"experiment": "interrupt"},
    }), tiny_data)  # the session's data: the sweep trains its own supernet, as a new sweep does
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text("# nas sweep tiny.yaml\n" + yaml.safe_dump(raw))
    env = nas_env(tmp_path)
    run_dir = tmp_path / "runs" / "tiny"
    kills_log = tmp_path / "kills.log"
    local_resume = ["sweep", "--resume", "tiny", "--workdir", str(tmp_path / "runs")]
    resume = [*local_resume, "--address", ray_head]

    # 1. a kill inside the supernet's second checkpoint write (step 8 of 8), in the Ray worker that trains it
    point, pid, stderr = _killed_at("checkpoint_write:2", ["sweep", str(spec_file), "--address", ray_head], env,
                                    tmp_path, kills_log, "checkpoint")
    assert point == "checkpoint_write" and f"pid={pid})" in stderr + (tmp_path / "checkpoint.stdout.log").read_text()
    assert not (run_dir / "supernet" / "metrics.json").exists(), "killed after the supernet was done"

    # 2. its rerun trains on from the checkpoint, finishes the supernet, then level 1 is killed after its second batch
    kill_env = _on_cluster({**env, "NAS_TEST_KILL": "level1_batch:2", "NAS_TEST_KILL_LOG": str(kills_log)})
    killed = subprocess.Popen([sys.executable, "-m", "nas.cli", "sweep", str(spec_file), "--address", ray_head],
                              env=kill_env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        killed_out, killed_err = killed.communicate(timeout=900)
    finally:  # the Ray processes the killed driver left in its group
        try:
            os.killpg(killed.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        killed.wait()
    assert killed.returncode == -9, killed_out[-3000:] + killed_err[-6000:]
    assert kills_log.read_text().splitlines()[-1].split()[0] == "level1_batch"
    assert (run_dir / "supernet" / "metrics.json").is_file(), "the supernet was not finished after its kill"
    assert "resuming sweep" in killed_out + killed_err
    # trained on from the step-4 checkpoint the kill left whole: steps 6 and 8 logged, not 2
    logged = killed_out + killed_err
    assert re.search(r"\bstep 6/8\b", logged) and not re.search(r"\bstep 2/8\b", logged), logged[-4000:]
    spec = load_spec(spec_file, check_files=False)  # reads the point file, as nas sweep does
    sweep_id = json.loads((spec.run_dir / "sweep.json").read_text())["sweep_id"]
    batches = spec.run_dir / "level1" / sweep_id / "batches"
    batch_stamps = {p.name: p.stat().st_mtime_ns for p in batches.glob("*.json")}
    assert len(batch_stamps) == 2, sorted(batch_stamps)  # two batches scored and told before the kill

    # 3. its resume finishes level 1, then Ctrl-C once a level-2 trial completed; SIGTERM on the next resume
    rc, stdout, stderr = _stop_when_done(local_resume, env, tmp_path, run_dir, 1, signal.SIGINT, "ctrl-c")
    _says_stopped_in_one_line(signal.SIGINT, rc, stdout, stderr)
    done = _left_nothing_running(spec_file, env, 0)

    rc, stdout, stderr = _stop_when_done(resume, env, tmp_path, run_dir, done + 1, signal.SIGTERM, "sigterm")
    _says_stopped_in_one_line(signal.SIGTERM, rc, stdout, stderr)
    assert "resuming sweep" in stdout + stderr, stderr[-2000:]
    done = _left_nothing_running(spec_file, env, done)

    # 4. a kill between Optuna's tell and the MLflow run's end, --status, a kill at an MLflow write, the last resume
    point, pid, _ = _killed_at("after_tell:1", resume, env, tmp_path, kills_log, "after_tell")
    assert point == "after_tell"
    after_tell = read_sweep(spec_file, env)
    told = [t for t in after_tell.optuna if t.state == TrialState.COMPLETE]
    assert done < len(told) < TRIALS, f"{len(told)} of {TRIALS} complete, {done} before: stopped too late to test it"
    assert "RUNNING" in {r.info.status for r in after_tell.trial_runs()}, "the kill should leave the told trial's " \
        "MLflow run RUNNING"
    status = nas_cli(["sweep", "--status", "tiny", "--workdir", "runs"], env, tmp_path)
    assert status.returncode == 0, status.stderr[-3000:]
    assert "optuna" in status.stdout and "COMPLETE" in status.stdout and "RUNNING" in status.stdout

    point, pid, _ = _killed_at("mlflow_write:2", resume, env, tmp_path, kills_log, "mlflow_write")
    assert point == "mlflow_write"
    before = read_sweep(spec_file, env)
    assert len([t for t in before.optuna if t.state == TrialState.COMPLETE]) < TRIALS, "killed too late to test resume"
    assert "RUNNING" in {r.info.status for r in before.runs}, "the kills should leave runs RUNNING"
    completed = completed_trials(run_dir)
    results = {n: run_dir / "trials" / sweep_id / f"{n:05d}.json" for n in completed}
    stamps = {n: p.stat().st_mtime_ns for n, p in results.items() if p.is_file()}
    assert len(stamps) >= len(told), (sorted(stamps), len(told))

    resumed = run_nas(["sweep", "--resume", "tiny", "--workdir", "runs", "--address", ray_head], _on_cluster(env),
                      tmp_path)  # no FILE: the saved copy
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    assert "(resumed)" in resumed.stdout
    # runs the killed drivers left RUNNING (the parent run goes on): ended as KILLED on resume. A kill between two
    # trials can leave only the parent RUNNING, and then there is nothing to mark.
    stale = [r for r in before.runs if r.info.status == "RUNNING" and r.data.tags.get("nas.role") != "sweep"]
    if stale:
        assert f"marked {len(stale)} MLflow run(s) left RUNNING" in resumed.stderr, resumed.stderr[-3000:]
    else:
        assert "marked" not in resumed.stderr, resumed.stderr[-3000:]

    after = read_sweep(spec_file, env)
    counts, problems = load_script("benchmarks/bench_resume.py").audit(TRIALS, after.optuna, after.ray, after.runs)
    assert problems == [] and counts["completed"] == {"optuna": TRIALS, "ray": TRIALS, "mlflow": TRIALS}, counts
    assert len(after.optuna) == TRIALS and all(t.state == TrialState.COMPLETE for t in after.optuna)
    assert [t.state for t in after.optuna] == [TrialState.COMPLETE] * TRIALS  # level 2: search.trials archs
    assert Counter(t.config["optuna_trial"] for t in after.ray) == Counter(range(TRIALS))  # one Ray trial each
    assert {t.status for t in after.ray} == {"TERMINATED"}
    runs = after.trial_runs()
    assert sorted(int(r.data.tags["nas.optuna_trial"]) for r in runs) == list(range(TRIALS)), "duplicate MLflow runs"
    assert {r.info.status for r in after.runs} == {"FINISHED"}, Counter(r.info.status for r in after.runs)
    assert all({"bleu", "latency_ratio", "latency_ms"} <= set(r.data.metrics) for r in runs)
    (parent,) = after.roles("sweep")
    assert parent.data.tags["nas.resumes"] == "6" and len(after.roles("supernet")) == 1
    for n, stamp in stamps.items():  # completed before the kills: reported again from its file, not re-scored
        assert results[n].stat().st_mtime_ns == stamp
    optuna_values = {t.number: t.values for t in after.optuna}
    for r in runs:
        n = int(r.data.tags["nas.optuna_trial"])
        assert r.data.metrics["bleu"] == pytest.approx(optuna_values[n][0])  # Optuna and MLflow agree

    status = nas_cli(["sweep", "--status", "tiny", "--workdir", "runs"], env, tmp_path)
    assert f"COMPLETE {TRIALS}" in status.stdout and f"TERMINATED {TRIALS}" in status.stdout
    assert f"FINISHED {TRIALS}; duplicates 0" in status.stdout
    assert [line.split()[0] for line in kills_log.read_text().splitlines()] == [
        "checkpoint_write", "level1_batch", "after_tell", "mlflow_write"]

    # 2 (continued). level 1, resumed after its kill, ran to its full budget
    level1 = optuna.load_study(study_name=sweep_id + "-level1", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(spec.run_dir / "optuna.journal"))))
    states = [t.state for t in level1.get_trials()]
    assert states.count(TrialState.COMPLETE) == POPULATION * GENERATIONS
    for name, stamp in batch_stamps.items():  # scored before the kill: not scored again
        assert (batches / name).stat().st_mtime_ns == stamp
    generations = {t.system_attrs.get("NSGAIISampler:generation") for t in level1.get_trials()
                   if t.state == TrialState.COMPLETE}
    assert generations >= {0, 1}
    level1_archs = {t.user_attrs["arch_summary"] for t in level1.get_trials() if t.state == TrialState.COMPLETE}
    space = SearchSpace.from_spec(spec)
    assert {space.from_params(t.params).summary() for t in after.optuna} <= level1_archs, \
        f"not all chosen from level 1 ({len(level1_archs)} distinct archs for {TRIALS} trials)"
    assert parent.data.metrics["level1_candidates"] == POPULATION * GENERATIONS
    monkeypatch.setenv("MLFLOW_TRACKING_URI", env["MLFLOW_TRACKING_URI"])
    from nas import tracking

    artifacts = {a.path for a in tracking.get_client().list_artifacts(parent.info.run_id, "level1")}
    assert {"level1/generation_000.json", "level1/generation_001.json"} <= artifacts
    table = json.loads(Path(tracking.get_client().download_artifacts(parent.info.run_id, "level1/generation_000.json",
                                                                     str(tmp_path))).read_text())
    assert len(table["data"]) == POPULATION, table  # one row per candidate of the generation, logged once
    history = tracking.get_client().get_metric_history(parent.info.run_id, "candidates_evaluated")
    assert max(m.value for m in history) == POPULATION * GENERATIONS
    assert f"level 1 COMPLETE {POPULATION * GENERATIONS}" in status.stdout, status.stdout

    # 5. the named point
    first = min(after.optuna, key=lambda t: t.number)
    assert space.from_params(first.params).summary() == MINE and first.user_attrs["point"] == "mine"
    assert space.from_params(min(level1.get_trials(), key=lambda t: t.number).params).summary() == MINE
    tagged = {r.data.tags.get("nas.point"): r.data.tags["nas.arch_summary"] for r in after.trial_runs()}
    assert tagged == {"mine": MINE, None: tagged[None]} and tagged[None] != MINE, tagged
    unnamed = [r.data.tags["nas.arch_summary"] for r in after.trial_runs() if r.data.tags.get("nas.point") is None]
    assert len(unnamed) == TRIALS - 1 and MINE not in unnamed, unnamed  # scored once, as the named point
    board = nas_cli(["leaderboard", "--experiment", "interrupt", "--include-infeasible"], {**env, "COLUMNS": "250"},
                    tmp_path)
    assert board.returncode == 0, board.stderr
    assert "point" in board.stdout and "mine" in board.stdout, board.stdout


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
def joined_ray(ray_head):
    """This process joined to the module's cluster (:func:`ray_head`) for both signals' Tune loops and the
    generations' test below, disconnected after the module."""
    import ray

    ray.init(address=ray_head, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_signal_inside_a_tune_callback_is_raised_at_the_next_step_not_inside_it(sig, tmp_path, joined_ray):
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


class _Generations:
    """A Ray Tune searcher with level 1's barrier (:class:`nas.search.level1.Level1Search`): ``width`` trials a
    generation, the next generation asked only once the previous one completed."""

    def __new__(cls, generations: int, width: int):
        from ray.tune.search import Searcher

        class Generations(Searcher):
            def __init__(self):
                super().__init__(metric=None, mode=None)
                self.asked, self.open = 0, set()

            def set_search_properties(self, metric, mode, config, **spec):
                return True

            def suggest(self, trial_id):
                if self.asked >= generations * width:
                    return Searcher.FINISHED if not self.open else None
                if self.asked % width == 0 and self.open:
                    return None  # the generation is asked in full: wait for it
                self.asked += 1
                self.open.add(trial_id)
                return {"n": self.asked}

            def on_trial_complete(self, trial_id, result=None, error=False):
                self.open.discard(trial_id)

        return Generations()


def _sleep_and_report(config):
    from ray import tune

    start = time.time()
    time.sleep(5.0 if config["n"] <= 2 else 1.0)  # the first generation: time for both workers to start
    tune.report({"pid": os.getpid(), "start": start, "end": time.time(), "n": config["n"]})


def _generations(tmp_path: Path, name: str, keep: int | None) -> list[list[dict]]:
    """3 generations of 2 trials (1 CPU each, ``reuse_actors``; 5 s each in the first generation, 1 s after), inside ``keep_idle_actors(keep)`` unless
    None; each generation's results in order."""
    from contextlib import nullcontext

    from ray import tune

    from nas.search.tune import keep_idle_actors

    tuner = tune.Tuner(tune.with_resources(_sleep_and_report, {"cpu": 1}),
                       tune_config=tune.TuneConfig(search_alg=_Generations(3, 2), num_samples=-1, reuse_actors=True),
                       run_config=tune.RunConfig(name=name, storage_path=str(tmp_path), verbose=0))
    with keep_idle_actors(keep) if keep else nullcontext():
        results = sorted((r.metrics for r in tuner.fit()), key=lambda m: m["n"])
    return [results[i:i + 2] for i in range(0, 6, 2)]


def _overlap(generation: list[dict]) -> bool:
    first, second = sorted(generation, key=lambda m: m["start"])
    return second["start"] < first["end"]


@pytest.mark.slow
def test_generations_keep_their_two_workers_and_run_side_by_side_with_keep_idle_actors(tmp_path, joined_ray):
    """Level 1's barrier on a real Ray Tune loop. Ray Tune alone keeps one idle actor at a generation's end: the next
    generation starts a new worker process (a new pid: torch imported and the supernet loaded again) or runs its two
    trials one after the other. Inside ``keep_idle_actors(2)`` the same two processes score every generation, two
    trials at a time."""
    kept = _generations(tmp_path, "kept", 2)
    assert len({m["pid"] for g in kept for m in g}) == 2, kept
    assert all(_overlap(g) for g in kept), kept
    ray_alone = _generations(tmp_path, "ray_alone", None)
    assert len({m["pid"] for g in ray_alone for m in g}) > 2 or not all(_overlap(g) for g in ray_alone), ray_alone
