"""The MLflow server stops for 30 s mid-sweep: the sweep's writes wait it out, and it finishes with every run complete.

A real ``mlflow server`` (SQLite backend store and proxied artifacts in ``tmp_path``) tracks a real ``nas sweep``
on the session's tiny supernet. Once the first trial's run exists the server's process group is terminated, left
down for 30 s, then started again on the same port with the same store. Optuna, Ray Tune and MLflow are read
back and checked with ``benchmarks/bench_resume.py``'s ``audit``.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time

import pytest
from mlflow import MlflowClient

from tests.conftest import REPO, nas_env, read_sweep, sweep_with_supernet, tiny_spec_dict
from tests.infra.conftest import stop_group

pytestmark = pytest.mark.slow

OUTAGE_S = 30.0
"""How long the server stays down (s)."""
TRIALS = 5


def _audit():
    spec = importlib.util.spec_from_file_location("bench_resume", REPO / "benchmarks" / "bench_resume.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.audit


def _wait_for_first_trial_run(client: MlflowClient, sweep: subprocess.Popen, timeout_s: float = 600) -> None:
    """Poll the server until the sweep has created a trial run (fails if the sweep exits first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert sweep.poll() is None, f"the sweep exited ({sweep.returncode}) before its first trial run"
        exp = client.get_experiment_by_name("outage")
        if exp is not None and client.search_runs([exp.experiment_id], "tags.`nas.role` = 'trial'", max_results=1):
            return
        time.sleep(0.5)
    pytest.fail(f"no trial run within {timeout_s} s")


def test_sweep_waits_out_a_30s_mlflow_server_outage_and_finishes_every_run(multi30k, tmp_path, tiny_supernet,
                                                                             restartable_mlflow_server):
    server = restartable_mlflow_server
    raw = tiny_spec_dict(multi30k, tmp_path, search={"trials": TRIALS, "max_concurrent": 1, "beam_size": 2,
                                                     "latency_sentences": 2, "method": "random"},
                         tracking={"experiment": "outage"})
    spec_file = sweep_with_supernet(raw, tmp_path, tiny_supernet)
    env = nas_env(tmp_path, MLFLOW_TRACKING_URI=server.uri)
    for key in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        env.pop(key, None)  # the sweep runs with MLflow's and nas's own retry settings
    out_path, err_path = tmp_path / "sweep.out", tmp_path / "sweep.err"
    t0 = time.monotonic()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        sweep = subprocess.Popen([sys.executable, "-m", "nas.cli", "sweep", str(spec_file)], stdout=out, stderr=err,
                                 env=env, cwd=tmp_path, start_new_session=True)
    try:
        _wait_for_first_trial_run(MlflowClient(server.uri), sweep)
        server.stop()
        down_ms = time.time() * 1000
        assert not server.healthy()
        time.sleep(OUTAGE_S)
        running_at_restart = sweep.poll() is None
        server.start()
        up_ms = time.time() * 1000
        outage_s = (up_ms - down_ms) / 1000
        returncode = sweep.wait(timeout=900)
    finally:
        stop_group(sweep, grace_s=10)  # the driver, and any Ray process it left behind
    wall_s = time.monotonic() - t0
    log = (f"outage {outage_s:.0f} s, sweep {wall_s:.0f} s\n--- stdout\n{out_path.read_text()[-3000:]}\n"
           f"--- stderr\n{err_path.read_text()[-8000:]}")
    print(log)
    assert running_at_restart, "the sweep ended during the outage: it was not mid-sweep\n" + log
    assert returncode == 0, log

    records = read_sweep(spec_file, env)
    counts, problems = _audit()(TRIALS, records.optuna, records.ray, records.runs)
    assert not problems, f"{problems}\n{counts}\n{log}"
    assert [t.state.name for t in records.optuna] == ["COMPLETE"] * TRIALS
    trial_runs = sorted(records.trial_runs(), key=lambda r: int(r.data.tags["nas.optuna_trial"]))
    assert [r.data.tags["nas.optuna_trial"] for r in trial_runs] == [str(n) for n in range(TRIALS)]
    for run in trial_runs:
        assert run.info.status == "FINISHED", run.info
        assert run.data.metrics["bleu"] >= 0 and run.data.metrics["latency_ms"] > 0, run.data.metrics
        assert run.data.params and run.data.tags.get("nas.arch_summary"), (run.data.params, run.data.tags)
    client = MlflowClient(server.uri)
    during = [m for r in trial_runs for m in client.get_metric_history(r.info.run_id, "bleu")
              if down_ms <= m.timestamp <= up_ms]
    # Whether a write was in flight at the stop depends on timing: a metric stamped inside the outage, or the
    # driver's MLflow callback held up by it (Ray's "took N s" warning), shows it; neither is guaranteed when the
    # first write after the stop waits out the client's backoff (seen: the next request 26 s after the restart).
    # The sweep ran across the outage either way (running_at_restart), which is what a user meets.
    blocked = [float(s) for s in re.findall(r"callbacks\.on_trial_result` operation took ([\d.]+) s", err_path.read_text())]
    print(f"metrics stamped inside the outage: {len(during)}; MLflow callback held up: {max(blocked, default=0):.0f} s")
    assert {r.info.status for r in records.runs} == {"FINISHED"}
    assert [r.info.status for r in records.roles("sweep")] == ["FINISHED"]
