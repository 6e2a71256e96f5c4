"""Kill a sweep's driver at random moments and resume it each time; then count what survived.

    python benchmarks/bench_resume.py [--trials 12] [--kills 5] [--seed 0] [--work DIR]

A tiny sweep (C=32 supernet, 300 Multi30k pairs, 24 validation sentences) runs as `nas sweep FILE` in a
subprocess. The driver gets SIGKILL at ``--kills`` random moments (uniform in [--min-s, --max-s] seconds
after each start: during start-up, data preparation, supernet training or the search) and is started
again each time with the same command; the last run goes to the end. Ray processes that the killed
driver leaves behind (its process group) are killed too, as a dead machine would lose them.

Prints: where each kill landed, then trials completed, duplicated and lost in Optuna, Ray Tune and
MLflow, the MLflow run states and the Optuna trial states. Goal: all trials completed, 0 duplicated,
0 lost, 0 runs left RUNNING.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MULTI30K = REPO.parent / "shared" / "data" / "multi30k"


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
        "train": {"steps": train_steps, "max_tokens": 512, "warmup_steps": 4, "checkpoint_every": 4, "log_every": 4,
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


def run_once(cmd: list[str], env: dict, cwd: Path, log: Path, kill_after_s: float | None) -> tuple[int | None, str]:
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=kill_after_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return None, log.read_text()
        kill_group(proc)  # the driver exited: clean up its group anyway
    return proc.returncode, log.read_text()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-s", type=float, default=5.0)
    ap.add_argument("--max-s", type=float, default=45.0)
    ap.add_argument("--train-steps", type=int, default=24)
    ap.add_argument("--work", type=Path, default=None, help="Folder to work in (default: a new temporary one).")
    args = ap.parse_args()
    work = (args.work or Path(tempfile.mkdtemp(prefix="bench_resume_"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    spec_file = work / "resume-bench.yaml"
    spec_file.write_text("# nas sweep resume-bench.yaml\n" + yaml.safe_dump(spec_dict(work, args.trials, args.train_steps)))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "nas.cli", "sweep", str(spec_file)]
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    print(f"work folder {work}; {args.trials} trials, {args.kills} SIGKILLs at random moments")
    kills = 0
    attempt = 0
    while True:
        attempt += 1
        delay = rng.uniform(args.min_s, args.max_s) if kills < args.kills else None
        rc, log = run_once(cmd, env, work, work / f"driver_{attempt}.log", delay)
        if rc is None:
            kills += 1
            print(f"  kill {kills}: SIGKILL after {delay:5.1f} s, during {phase(log)}; "
                  f"{completed(spec_file)}/{args.trials} trials complete in Optuna", flush=True)
            continue
        if kills < args.kills:
            print(f"  run {attempt} ended (exit code {rc}) before its kill, after {kills} kill(s); lower --max-s "
                  f"or raise --trials; see {work}/driver_{attempt}.log")
            if rc != 0:
                print(log[-3000:])
            break
        print(f"  run {attempt}: {'finished' if rc == 0 else f'exit code {rc}'} "
              f"({'after' if kills else 'without'} {kills} kill(s) before); total {time.monotonic() - t0:.0f} s")
        if rc != 0:
            print(log[-3000:])
        break
    report(spec_file, env, args.trials)


def report(spec_file: Path, env: dict, trials: int) -> None:
    os.environ.update({k: env[k] for k in ("MLFLOW_TRACKING_URI",)})
    os.chdir(spec_file.parent)
    from ray.tune import ExperimentAnalysis

    from nas import tracking
    from nas.search.runner import ray_dir, read_sweep_record, study_ref, sweep_status
    from nas.space.spec import load_spec

    spec = load_spec(spec_file)
    record = read_sweep_record(spec.run_dir.resolve())
    study = study_ref(spec, record.sweep_id).load()
    ot = study.get_trials(deepcopy=False)
    optuna_states = Counter(t.state.name for t in ot)
    ray_trials = ExperimentAnalysis(str(ray_dir(spec, record.sweep_id, "search"))).trials
    ray_numbers = Counter(t.config.get("optuna_trial") for t in ray_trials)
    runs = tracking.find_tagged_runs(spec.experiment, {tracking.TAG_SWEEP_ID: record.sweep_id})
    trial_runs = [r for r in runs if r.data.tags.get(tracking.TAG_ROLE) == "trial"]
    run_numbers = Counter(r.data.tags.get(tracking.TAG_OPTUNA_TRIAL) for r in trial_runs)
    finished_numbers = {r.data.tags.get(tracking.TAG_OPTUNA_TRIAL) for r in trial_runs if r.info.status == "FINISHED"}
    complete = [t for t in ot if t.state.name == "COMPLETE"]
    archs = Counter(json.dumps(t.params, sort_keys=True) for t in ot)
    print()
    print(f"{'':24} {'optuna':>8} {'ray':>8} {'mlflow':>8}")
    print(f"{'trials completed':24} {len(complete):>8} {sum(t.status == 'TERMINATED' for t in ray_trials):>8} "
          f"{len(finished_numbers):>8}")
    print(f"{'trials duplicated':24} {max(0, len(ot) - trials):>8} {sum(n - 1 for n in ray_numbers.values()):>8} "
          f"{sum(n - 1 for n in run_numbers.values()):>8}")
    print(f"{'trials lost':24} {trials - sum(t.state.is_finished() for t in ot):>8} "
          f"{trials - len({n for n in ray_numbers if n is not None})!s:>8} {trials - len(run_numbers):>8}")
    print(f"MLflow run states (all runs of the sweep): {dict(Counter(r.info.status for r in runs))}; "
          f"by role: {dict(Counter((r.data.tags.get(tracking.TAG_ROLE), r.info.status) for r in runs))}")
    print(f"Optuna trial states: {dict(optuna_states)}; distinct archs sampled {len(archs)} of {len(ot)}")
    print(f"Ray Tune trial statuses: {dict(Counter(t.status for t in ray_trials))}")
    print("\n".join(sweep_status(spec).lines()))


if __name__ == "__main__":
    main()
