"""Kill a sweep's driver at random moments and resume it each time; then count what survived.

    python benchmarks/bench_resume.py [--trials 12] [--kills 5] [--seed 0] [--work DIR] [--mode points|random]

A tiny sweep (C=32 supernet, 300 Multi30k pairs, 24 validation sentences) runs as `nas sweep FILE` in a
subprocess. The sweep gets SIGKILL ``--kills`` times and is started again each time with the same command;
the last run goes to the end. Ray processes that the killed driver leaves behind (its process group) are
killed too, as a dead machine would lose them.

``--mode points`` (default): each kill lands at a named kill point of :mod:`nas.faults`, armed for that run
with ``NAS_TEST_KILL=POINT:N`` (the process passing it the N-th time SIGKILLs itself, then the bench kills
the rest of the group): ``data_prepare`` (first run, fresh data cache), ``checkpoint_write`` (inside a
supernet checkpoint write), ``mlflow_write`` (as an MLflow write starts) and ``after_tell`` (Optuna told, MLflow
run not yet ended), in that order, then the last three drawn at random; N is drawn small enough to be
reached. Which point each kill hit (and in which process) is read from the points' log.

``--mode random``: each kill lands at a random moment:

- with probability ``--startup-share``, a random time in [--min-s, --max-s] seconds after the start
  (start-up, data preparation, Ray start-up);
- otherwise at a random point of the sweep's own progress (read from the driver's output), half of them
  drawn uniformly over the supernet training steps and half over the trials (before the last one
  completes), the points taken in ascending order, plus up to half a second. Progress points, not
  seconds: a sweep on a fast machine would otherwise finish before its kills.

Prints: where each kill landed, then trials completed, duplicated and lost in Optuna, Ray Tune and
MLflow, the MLflow run states and the Optuna trial states. Goal: all trials completed, 0 duplicated,
0 lost, 0 runs left RUNNING. Exits 1 (``FAIL: ...`` naming each problem, see :func:`audit`) when any is
missed or the last run fails; ``--json FILE`` also writes the counts and where each kill landed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MULTI30K = REPO.parent / "shared" / "data" / "multi30k"
CHECKPOINT_EVERY = 4


def spec_dict(work: Path, trials: int, train_steps: int) -> dict:
    return {
        "name": "resume-bench",
        "data": {"train": {"src": str(MULTI30K / "train.en.gz"), "tgt": str(MULTI30K / "train.de.gz")},
                 "valid": {"src": str(MULTI30K / "val.en.gz"), "tgt": str(MULTI30K / "val.de.gz")},
                 "tokenizer": {"vocab_size": 400}, "max_train_pairs": 300, "max_valid_pairs": 24,
                 "cache_dir": str(work / "data")},
        "supernet": {"model_dim": 32, "heads": 2, "encoder_layers": 2, "decoder_layers": 2, "ffn_width": 64,
                     "branches": 2, "max_positions": 128},
        "space": {"encoder_layers": {"values": [1, 2]}, "decoder_layers": {"values": [1, 2]},
                  "width": {"values": [16, 32], "per_layer": True}, "ffn_width": {"values": [32, 64], "per_layer": True},
                  "branches": {"values": [1, 2], "per_layer": True}},
        "train": {"steps": train_steps, "max_tokens": 512, "warmup_steps": 4, "checkpoint_every": CHECKPOINT_EVERY,
                  "log_every": 4,
                  "eval_beam_size": 2, "lr": 2e-3},
        "search": {"trials": trials, "max_concurrent": 2, "beam_size": 2, "latency_sentences": 2, "method": "tpe",
                   "metrics": [{"name": "bleu", "goal": "maximize"}, {"name": "latency_ms", "goal": "minimize"}]},
        "resources": {"cpu": 1},
        "tracking": {"experiment": "resume-bench"},
        "workdir": str(work / "runs"),
    }


def phase(log: str) -> str:
    """Where the driver was, from its stderr."""
    marks = [("search", "searching"), ("supernet", "training the supernet"), ("supernet", "reusing the trained"),
             ("ray start", "resuming sweep"), ("data", "prepared data"), ("data", "reusing prepared data")]
    last = max(((log.rfind(m), name) for name, m in marks), default=(-1, ""))
    return last[1] if last[0] >= 0 else "start-up"


def completed(spec_file: Path) -> int:
    """COMPLETE trials in the sweep's Optuna journal (0 before the search starts)."""
    import optuna

    run_dir = spec_file.parent / "runs" / "resume-bench"
    if not (run_dir / "sweep.json").is_file() or not (run_dir / "optuna.journal").is_file():
        return 0
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(run_dir / "optuna.journal")))
    try:
        study = optuna.load_study(study_name=json.loads((run_dir / "sweep.json").read_text())["sweep_id"], storage=storage)
    except KeyError:
        return 0
    return sum(t.state.name == "COMPLETE" for t in study.get_trials(deepcopy=False))


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the driver, then whatever it left in its process group (Ray agents outlive it)."""
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def progress(log: str, train_steps: int, done_before: int) -> int:
    """The sweep's progress in this run's output: supernet steps (0..train_steps), then train_steps + trials done."""
    if "searching:" in log or "reusing the trained" in log:
        return train_steps + done_before + len(re.findall(r"^trial \d+ done:", log, re.M))
    return max((int(m) for m in re.findall(r"\bstep (\d+)/\d+\b", log)), default=0)


def run_once(cmd: list[str], env: dict, cwd: Path, log: Path, kill: Callable[[str, float], bool] | None
             ) -> tuple[int | None, str, int]:
    """Run the driver; SIGKILL it (and its process group) as soon as ``kill(output, seconds)`` says so, or a
    kill point killed it. Returns (None, output, pid) for a kill, else (exit code, output, pid)."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        while proc.poll() is None:
            if kill is not None and kill(log.read_text(errors="replace"), time.monotonic() - t0):
                kill_group(proc)
                return None, log.read_text(errors="replace"), proc.pid
            time.sleep(0.1)
        kill_group(proc)  # the driver exited: clean up its group anyway
    if kill is not None and kill(log.read_text(errors="replace"), time.monotonic() - t0):
        return None, log.read_text(errors="replace"), proc.pid  # a kill point in the driver itself
    return proc.returncode, log.read_text(errors="replace"), proc.pid


def point_plan(rng: random.Random, args: argparse.Namespace) -> list[tuple[str, int]]:
    """The named kill points, in order, with the pass N each is armed for (see the module docstring)."""
    checkpoints = max(1, args.train_steps // CHECKPOINT_EVERY - 1)
    first = [("data_prepare", 1), ("checkpoint_write", rng.randint(1, min(2, checkpoints))),
             ("mlflow_write", rng.randint(1, 3)), ("after_tell", rng.randint(1, max(1, min(2, args.trials // 4))))]
    more = [(rng.choice(["mlflow_write", "after_tell"]), rng.randint(1, 2)) for _ in range(max(0, args.kills - 4))]
    return (first + more)[: args.kills]


def kill_plan(rng: random.Random, args: argparse.Namespace) -> list[tuple[str, float]]:
    """The kills, in order: ("time", seconds after the start) or ("progress", point), progress points ascending
    (half of them drawn in supernet training, half in the search); time kills keep their drawn place."""
    end = args.train_steps + args.trials - 1  # the last trial still to run when the kill lands
    kinds = ["time" if rng.random() < args.startup_share else "progress" for _ in range(args.kills)]
    points = sorted(rng.randint(1, args.train_steps) if rng.random() < 0.5 else rng.randint(args.train_steps + 1, end)
                    for kind in kinds if kind == "progress")
    return [("time", rng.uniform(args.min_s, args.max_s)) if kind == "time" else ("progress", points.pop(0))
            for kind in kinds]


def kill_predicate(kind: str, value: float, jitter: float, train_steps: int, done_before: int
                   ) -> tuple[str, Callable[[str, float], bool]]:
    """(description, predicate on (driver output, seconds since its start)) of one planned kill."""
    if kind == "time":
        return f"at {value:4.1f} s", lambda out, secs: secs >= value
    where = f"supernet step {value}" if value <= train_steps else f"{value - train_steps} trials done"
    state = {"hit": None}

    def due(out: str, secs: float) -> bool:
        if state["hit"] is None and progress(out, train_steps, done_before) >= value:
            state["hit"] = secs
        return state["hit"] is not None and secs >= state["hit"] + jitter

    return f"at {where} + {jitter:.2f} s", due


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-s", type=float, default=1.0, help="Earliest start-up kill (s after the start).")
    ap.add_argument("--max-s", type=float, default=8.0, help="Latest start-up kill (s after the start).")
    ap.add_argument("--startup-share", type=float, default=0.2,
                    help="Share of kills at a start-up time instead of a progress point.")
    ap.add_argument("--train-steps", type=int, default=48)
    ap.add_argument("--work", type=Path, default=None, help="Folder to work in (default: a new temporary one).")
    ap.add_argument("--json", type=Path, default=None, help="Also write the counts and the kill log here.")
    ap.add_argument("--mode", choices=("points", "random"), default="points",
                    help="Kill at named kill points (default) or at random moments.")
    args = ap.parse_args()
    work = (args.work or Path(tempfile.mkdtemp(prefix="bench_resume_"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    spec_file = work / "resume-bench.yaml"
    spec_file.write_text("# nas sweep resume-bench.yaml\n" + yaml.safe_dump(spec_dict(work, args.trials, args.train_steps)))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "nas.cli", "sweep", str(spec_file)]
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    points_log = work / "kill_points.log"
    print(f"work folder {work}; {args.trials} trials, {args.kills} SIGKILLs "
          f"{'at named kill points' if args.mode == 'points' else 'at random moments'}")
    plan = point_plan(rng, args) if args.mode == "points" else kill_plan(rng, args)
    kills = attempt = 0
    kill_log: list[dict[str, Any]] = []
    while True:
        attempt += 1
        done_before = completed(spec_file)
        what, due, run_env = "", None, env
        hits_before = len(_lines(points_log))
        if kills < args.kills and args.mode == "points":
            name, n = plan[kills]
            what = f"at kill point {name}, pass {n}"
            run_env = {**env, "NAS_TEST_KILL": f"{name}:{n}", "NAS_TEST_KILL_LOG": str(points_log)}
            due = lambda out, secs, before=hits_before: len(_lines(points_log)) > before
        elif kills < args.kills:
            what, due = kill_predicate(*plan[kills], rng.uniform(0.0, 0.5), args.train_steps, done_before)
        rc, log, pid = run_once(cmd, run_env, work, work / f"driver_{attempt}.log", due)
        if rc is None:
            kills += 1
            hit = _lines(points_log)[hits_before:]
            entry: dict[str, Any] = {"kill": kills, "what": what, "phase": phase(log)}
            where = ""
            if hit:  # "POINT PID", written by the kill point just before it killed its process
                point, hit_pid = hit[0].split()
                entry.update(point=point, pid=int(hit_pid), in_driver=int(hit_pid) == pid)
                where = f" (hit in the {'driver' if entry['in_driver'] else 'Ray worker'} pid {hit_pid})"
            kill_log.append(entry)
            print(f"  kill {kills}: SIGKILL {what}{where}, during {phase(log)}; "
                  f"{completed(spec_file)}/{args.trials} trials complete in Optuna", flush=True)
            continue
        if kills < args.kills:
            print(f"  run {attempt} ended (exit code {rc}) before its kill ({what}), after {kills} kill(s); "
                  f"see {work}/driver_{attempt}.log")
            if rc != 0:
                print(log[-3000:])
            break
        print(f"  run {attempt}: {'finished' if rc == 0 else f'exit code {rc}'} "
              f"({'after' if kills else 'without'} {kills} kill(s) before); total {time.monotonic() - t0:.0f} s")
        if rc != 0:
            print(log[-3000:])
        break
    if rc is None or rc != 0:
        sys.exit(f"FAIL: the last run ended with exit code {rc}; see {work}")
    counts, problems = report(spec_file, env, args.trials)
    summary = {"trials": args.trials, "kills": kills, "planned_kills": args.kills, "seed": args.seed,
               "seconds": time.monotonic() - t0, "kill_log": kill_log, **counts, "problems": problems}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    if problems:
        sys.exit("FAIL: " + "; ".join(problems))
    print(f"OK: {args.trials} trials, {kills} kills: nothing lost, duplicated or left RUNNING")


def audit(trials: int, optuna_trials: list, ray_trials: list, runs: list) -> tuple[dict[str, Any], list[str]]:
    """Counts of completed, duplicated and lost trials in Optuna, Ray Tune and MLflow, and the problems found.

    A problem is a trial lost or duplicated in any of the three, an Optuna trial not COMPLETE, a Ray trial not
    TERMINATED, an MLflow run of the sweep left RUNNING, or a trial run with no ``nas.optuna_trial`` tag.

    Args:
        trials: the sweep's ``search.trials``.
        optuna_trials: the study's ``FrozenTrial`` list (``.state``, ``.params``).
        ray_trials: Ray Tune's trials (``.status``, ``.config``).
        runs: every MLflow run tagged with the sweep id (``.info.status``, ``.data.tags``).
    """
    from nas import tracking

    ray_numbers = Counter(t.config.get("optuna_trial") for t in ray_trials)
    trial_runs = [r for r in runs if r.data.tags.get(tracking.TAG_ROLE) == "trial"]
    run_numbers = Counter(r.data.tags.get(tracking.TAG_OPTUNA_TRIAL) for r in trial_runs)
    finished = {r.data.tags.get(tracking.TAG_OPTUNA_TRIAL) for r in trial_runs if r.info.status == "FINISHED"}
    counts = {
        "completed": {"optuna": sum(t.state.name == "COMPLETE" for t in optuna_trials),
                      "ray": sum(t.status == "TERMINATED" for t in ray_trials), "mlflow": len(finished - {None})},
        "duplicated": {"optuna": max(0, len(optuna_trials) - trials),
                       "ray": sum(n - 1 for n in ray_numbers.values()),
                       "mlflow": sum(n - 1 for k, n in run_numbers.items() if k is not None)},
        "lost": {"optuna": trials - sum(t.state.is_finished() for t in optuna_trials),
                 "ray": trials - len({n for n in ray_numbers if n is not None}),
                 "mlflow": trials - len(set(run_numbers) - {None})},
        "running_runs": sum(r.info.status == "RUNNING" for r in runs),
        "untagged_trial_runs": run_numbers.get(None, 0),
        "optuna_states": dict(Counter(t.state.name for t in optuna_trials)),
        "ray_statuses": dict(Counter(t.status for t in ray_trials)),
        "mlflow_states": dict(Counter(r.info.status for r in runs)),
        "distinct_archs": len(Counter(json.dumps(t.params, sort_keys=True) for t in optuna_trials)),
    }
    problems = [f"{n} trial(s) {what} in {system}" for what in ("duplicated", "lost")
                for system, n in counts[what].items() if n]
    problems += [f"{n} trial(s) {state} in {system}" for system, states, ok in
                 (("optuna", counts["optuna_states"], "COMPLETE"), ("ray", counts["ray_statuses"], "TERMINATED"))
                 for state, n in states.items() if state != ok]
    if counts["running_runs"]:
        problems.append(f"{counts['running_runs']} MLflow run(s) left RUNNING")
    if counts["untagged_trial_runs"]:
        problems.append(f"{counts['untagged_trial_runs']} MLflow trial run(s) without a {tracking.TAG_OPTUNA_TRIAL} tag")
    return counts, problems


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def report(spec_file: Path, env: dict, trials: int) -> tuple[dict[str, Any], list[str]]:
    """Print the audit of the finished sweep (:func:`audit`); returns it."""
    os.environ.update({k: env[k] for k in ("MLFLOW_TRACKING_URI",)})
    os.chdir(spec_file.parent)
    from ray.tune import ExperimentAnalysis

    from nas import tracking
    from nas.search.runner import ray_dir, read_sweep_record, study_ref, sweep_status
    from nas.space import load_spec

    spec = load_spec(spec_file)
    record = read_sweep_record(spec.run_dir.resolve())
    ot = study_ref(spec, record.sweep_id).load().get_trials(deepcopy=False)
    ray_trials = ExperimentAnalysis(str(ray_dir(spec, record.sweep_id, "search"))).trials
    runs = tracking.find_tagged_runs(spec.experiment, {tracking.TAG_SWEEP_ID: record.sweep_id})
    counts, problems = audit(trials, ot, ray_trials, runs)
    print()
    print(f"{'':24} {'optuna':>8} {'ray':>8} {'mlflow':>8}")
    for what in ("completed", "duplicated", "lost"):
        c = counts[what]
        print(f"{'trials ' + what:24} {c['optuna']:>8} {c['ray']:>8} {c['mlflow']:>8}")
    print(f"MLflow run states (all runs of the sweep): {counts['mlflow_states']}; "
          f"by role: {dict(Counter((r.data.tags.get(tracking.TAG_ROLE), r.info.status) for r in runs))}")
    print(f"Optuna trial states: {counts['optuna_states']}; distinct archs sampled {counts['distinct_archs']} "
          f"of {len(ot)}")
    print(f"Ray Tune trial statuses: {counts['ray_statuses']}")
    print("\n".join(sweep_status(spec).lines()))
    return counts, problems


if __name__ == "__main__":
    main()
