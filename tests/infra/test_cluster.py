"""Cluster settings from the YAML: ``resources.storage_path`` (a shared folder or a URI) for both Ray Tune
stages, ``search.gpu_per_trial`` checked against the cluster, and a sweep on a local 2-node Ray cluster
(``ray.cluster_utils.Cluster``) of 1 CPU per node, whose 1-CPU trials, two at a time, must use both nodes; its
experiment kept in an S3 bucket (the ``s3_storage`` fixture), its driver SIGKILLed mid-search and resumed on the
same cluster, as a cluster user does when the head's driver dies (the sweep of ``test_s3_storage.py``, folded in
here: one Ray cluster for both)."""

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

from nas.search.tune import ray_dir, run_config
from nas.space import SpecError, parse_spec
from tests.conftest import REPO, completed_trials, kill_driver, nas_env, run_nas, sweep_with_supernet, tiny_spec_dict
from tests.infra.conftest import bucket_names, bucket_ray_trials


def _spec(multi30k: Path, tmp_path: Path, **resources):
    return parse_spec(tiny_spec_dict(multi30k, tmp_path, resources={"cpu": 1, **resources}))


def test_ray_experiments_default_to_the_sweep_folder(multi30k, tmp_path):
    spec = _spec(multi30k, tmp_path)
    exp = ray_dir(spec, "tiny-1", "search")
    assert exp == (tmp_path / "runs" / "tiny" / "ray" / "tiny-1-search").resolve()
    config = run_config(exp, [], 0)
    assert (config.storage_path, config.name) == (str(exp.parent), "tiny-1-search")


def test_storage_path_folder_holds_both_stages(multi30k, tmp_path):
    spec = _spec(multi30k, tmp_path, storage_path=str(tmp_path / "shared"))
    assert ray_dir(spec, "tiny-1", "train") == (tmp_path / "shared" / "tiny-1-train").resolve()
    assert ray_dir(spec, "tiny-1", "search") == (tmp_path / "shared" / "tiny-1-search").resolve()


def test_storage_path_uri_is_kept_as_a_uri(multi30k, tmp_path):
    spec = _spec(multi30k, tmp_path, storage_path="s3://bucket/nas/")
    exp = ray_dir(spec, "tiny-1", "search")
    assert exp == "s3://bucket/nas/tiny-1-search"
    config = run_config(exp, [], 0)
    assert (config.storage_path, config.name) == ("s3://bucket/nas", "tiny-1-search")


@pytest.mark.parametrize(("section", "key", "value", "message"), [
    ("search", "gpu_per_trial", -0.25, "greater than or equal to 0"),
    ("resources", "storage_path", " ", "is empty"),
])
def test_bad_cluster_settings_name_the_key(multi30k, tmp_path, section, key, value, message):
    raw = tiny_spec_dict(multi30k, tmp_path)
    raw[section] = {**raw[section], key: value}
    with pytest.raises(SpecError, match=rf"{section}\.{key}: .*{message}"):
        parse_spec(raw, "tiny.yaml")


def test_fractional_gpu_per_trial_is_accepted(multi30k, tmp_path):
    raw = tiny_spec_dict(multi30k, tmp_path)
    raw["search"] = {**raw["search"], "gpu_per_trial": 0.25}
    assert parse_spec(raw).search.gpu_per_trial == 0.25


NODE_BARRIER_ENV = "NAS_TEST_NODE_BARRIER"
"""A folder (one per driver, set in its job's ``runtime_env``): while set on a driver's workers, each of its trials,
before scoring, waits (at most ``NODE_BARRIER_S``) until its trials are scoring on two nodes (see
:func:`hold_scoring_until_two_nodes_score`)."""
NODE_BARRIER_S = 60.0
HOLD_AFTER_ENV = "NAS_TEST_HOLD_AFTER"
"""A number N: while set on a driver's workers, the trials of that driver after the first N to score wait, unscored,
until the driver is killed (Ray then ends its actors) or ``HOLD_S`` pass: the kill always finds trials to resume."""
HOLD_S = 600.0


def _ticket(folder: Path) -> int:
    """The next number in ``folder`` (0, 1, ...), taken atomically among the cluster's workers."""
    folder.mkdir(parents=True, exist_ok=True)
    n = 0
    while True:
        try:
            (folder / str(n)).touch(exist_ok=False)  # O_EXCL: one taker per number
            return n
        except FileExistsError:
            n += 1


def hold_scoring_until_two_nodes_score() -> None:
    """Ray ``worker_process_setup_hook`` (test-only): a tiny trial scores in well under a second, quicker than
    Ray starts a worker on the second node, so Ray Tune would hand every trial to the first node's reused actor.
    Here each trial, before scoring, marks its node in ``$NAS_TEST_NODE_BARRIER/nodes`` and waits until two nodes
    have: the first trial keeps its node's only CPU meanwhile, so the second must be scheduled on the other.
    With ``$NAS_TEST_HOLD_AFTER`` set, the trials after that many wait first, unscored (see ``HOLD_AFTER_ENV``)."""
    import ray

    import nas.search.trials as trials

    barrier, score_arch = Path(os.environ[NODE_BARRIER_ENV]), trials.score_arch
    hold_after = os.environ.get(HOLD_AFTER_ENV)

    def score_once_two_nodes_score(*args, **kwargs):
        if hold_after is not None and _ticket(barrier / "scoring") >= int(hold_after):
            time.sleep(HOLD_S)
        nodes = barrier / "nodes"
        nodes.mkdir(parents=True, exist_ok=True)
        (nodes / ray.get_runtime_context().get_node_id()).touch()
        deadline = time.monotonic() + NODE_BARRIER_S
        while len(list(nodes.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        return score_arch(*args, **kwargs)

    trials.score_arch = score_once_two_nodes_score


TRIALS = 4


def _job_env(tmp_path: Path, driver: str, **env_vars: str) -> dict[str, str]:
    """Environment of a ``nas sweep`` driver on the cluster: the test hook and its folder
    ``tmp_path/nodes_scoring/<driver>`` (plus ``env_vars``) in its job's ``runtime_env``, as ``ray job submit``
    passes it, so they reach this driver's workers only."""
    runtime_env = {"worker_process_setup_hook": f"{__name__}.hold_scoring_until_two_nodes_score",
                   "env_vars": {NODE_BARRIER_ENV: str(tmp_path / "nodes_scoring" / driver), **env_vars}}
    return nas_env(tmp_path, RAY_JOB_CONFIG_JSON_ENV_VAR=json.dumps({"runtime_env": runtime_env}))


def _wait_for_free_cpus(address: str, cpus: float, timeout_s: float = 60) -> float:
    """The cluster's available CPUs, once they reach ``cpus`` (or ``timeout_s`` passed), read by a driver of its own."""
    import ray

    ray.init(address=address, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        deadline = time.monotonic() + timeout_s
        while (free := ray.available_resources().get("CPU", 0)) < cpus and time.monotonic() < deadline:
            time.sleep(0.5)
        return free
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_sweep_on_a_two_node_cluster_with_s3_storage_killed_mid_search_resumes_on_the_same_cluster(
        multi30k, tmp_path, tiny_supernet, s3_storage, monkeypatch):
    """A sweep joins a 2-node cluster (``--address``) with its experiments in a bucket; its driver is SIGKILLed
    once a trial is complete in Optuna and Ray's experiment state is in the bucket (its later trials held unscored
    meanwhile), and ``nas sweep --resume --address`` on the same cluster restores the experiment from the bucket
    and finishes it. Each node has 1 CPU and each trial takes 1 CPU, so two trials scoring at once (held until they
    do by :func:`hold_scoring_until_two_nodes_score`, per driver) can never share a node: each driver's trials must
    use both nodes. Fails if a driver ignored ``--address`` (a local Ray has one node), a trial took more than 1 CPU,
    the dead driver's actors kept the cluster's CPUs, or the resume started afresh instead of from the bucket."""
    import ray
    from optuna.trial import TrialState
    from ray.cluster_utils import Cluster

    from nas import tracking
    from nas.search.ray_session import init_ray
    from nas.search.runner import read_sweep_record, study_ref
    from nas.space import load_spec

    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the nodes' workers import nas (and the S3 keys: s3_storage)
    raw = tiny_spec_dict(multi30k, tmp_path, search={"trials": TRIALS, "max_concurrent": 2, "cpu_per_trial": 1,
                                                     "beam_size": 2, "latency_sentences": 2},
                         resources={"cpu": 1, "storage_path": s3_storage}, tracking={"experiment": "cluster"})
    spec_file = sweep_with_supernet(raw, tmp_path, tiny_supernet)
    run_dir = tmp_path / "runs" / "tiny"
    barrier = tmp_path / "nodes_scoring"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        gpu_raw = {**raw, "search": {**raw["search"], "gpu_per_trial": 0.5}}
        with pytest.raises(SpecError, match=r"search.gpu_per_trial=0.5 but the Ray cluster has 0 GPUs"):
            init_ray(parse_spec(gpu_raw), cluster.address)
        assert not ray.is_initialized()
        cluster_nodes = {node.node_id for node in cluster.list_all_nodes()}
        assert len(cluster_nodes) == 2

        env = _job_env(tmp_path, "killed", **{HOLD_AFTER_ENV: "2"})  # with the fixture's AWS_* credentials
        log = tmp_path / "killed.log"
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "nas.cli", "sweep", str(spec_file), "--address",
                                     cluster.address], env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            deadline = time.monotonic() + 600
            try:
                exp = None
                while True:  # a trial complete in Optuna, and Ray's experiment state in the bucket
                    assert proc.poll() is None, f"the sweep ended before it could be killed:\n{log.read_text()[-4000:]}"
                    assert time.monotonic() < deadline, "no trial completed and uploaded in 600 s"
                    if exp is None and (record := read_sweep_record(run_dir)) is not None:
                        exp = ray_dir(load_spec(spec_file, check_files=False), record.sweep_id, "search")
                    if exp is not None and completed_trials(run_dir) and (before := bucket_ray_trials(exp)):
                        break
                    time.sleep(0.5)
            finally:
                kill_driver(proc)  # the driver's process group: the cluster's processes are not in it
        assert proc.returncode == -signal.SIGKILL
        spec = load_spec(spec_file, check_files=False)
        sweep_id = read_sweep_record(run_dir).sweep_id
        done_before = {t.number for t in study_ref(spec, sweep_id).load().get_trials()
                       if t.state == TrialState.COMPLETE}
        assert len(done_before) < TRIALS, "killed too late to test resume"
        assert not (run_dir / "ray").exists()  # Ray kept nothing beside the sweep: all of it is in the bucket
        assert {p.name for p in (barrier / "killed" / "nodes").iterdir()} == cluster_nodes  # the hook ran on both
        # Ray ends a dead driver's actors and placement groups: the held trials must not keep the CPUs
        assert _wait_for_free_cpus(cluster.address, 2) == 2, "the killed driver's trials still hold the cluster's CPUs"

        env = _job_env(tmp_path, "resumed")
        resumed = run_nas(["sweep", "--resume", "tiny", "--workdir", "runs", "--address", cluster.address], env,
                          tmp_path)
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
        assert "(restored" in resumed.stderr, resumed.stderr[-3000:]  # Tuner.restore from the bucket, not afresh

        after = bucket_ray_trials(exp)
        assert {t.trial_id for t in before} <= {t.trial_id for t in after}  # the trials Ray had uploaded, restored
        assert Counter(t.config["optuna_trial"] for t in after) == Counter(range(TRIALS))  # one Ray trial each
        assert {t.status for t in after} == {"TERMINATED"} and len(after) == TRIALS
        # node_id is reported where a trial scored (a trial scored before the kill but not seen complete by Ray
        # replays its stored result, without one); the trials the killed driver held were scored after the resume
        by_trial = {t.config["optuna_trial"]: t.last_result["node_id"] for t in after if "node_id" in t.last_result}
        assert set(by_trial.values()) == cluster_nodes, (by_trial, cluster_nodes)
        scored_after = {n: node for n, node in by_trial.items() if n not in done_before}
        assert len(scored_after) >= 2 and set(scored_after.values()) == cluster_nodes, (scored_after, cluster_nodes)
        assert {p.name for p in (barrier / "resumed" / "nodes").iterdir()} == cluster_nodes  # the resumed run's too
        optuna_trials = study_ref(spec, sweep_id).load().get_trials()
        assert sorted(t.number for t in optuna_trials) == list(range(TRIALS))
        assert all(t.state == TrialState.COMPLETE for t in optuna_trials)
        tracking_uri = env["MLFLOW_TRACKING_URI"]
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MLFLOW_TRACKING_URI", tracking_uri)
            runs = tracking.find_tagged_runs(spec.experiment, {tracking.TAG_SWEEP_ID: sweep_id})
        trial_runs = [r for r in runs if r.data.tags.get(tracking.TAG_ROLE) == "trial"]
        assert sorted(int(r.data.tags[tracking.TAG_OPTUNA_TRIAL]) for r in trial_runs) == list(range(TRIALS))
        assert {r.info.status for r in runs} == {"FINISHED"}, Counter(r.info.status for r in runs)
        names = bucket_names(exp)  # resources.storage_path, not <run>/ray
        assert len([n for n in names if n.startswith("experiment_state-") and n.endswith(".json")]) == 2  # 2 drivers
        assert "tuner.pkl" in names and not (run_dir / "ray").exists()
    finally:
        cluster.shutdown()
