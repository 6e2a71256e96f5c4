"""Cluster settings from the YAML: ``resources.storage_path`` (a shared folder or a URI) for both Ray Tune
stages, ``search.gpu_per_trial`` checked against the cluster, and a sweep on a local 2-node Ray cluster
(``ray.cluster_utils.Cluster``) of 1 CPU per node, whose 1-CPU trials, two at a time, must use both nodes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from nas.search.tune import ray_dir, run_config
from nas.space import SpecError, parse_spec
from tests.conftest import REPO, nas_env, read_sweep, run_nas, sweep_with_supernet, tiny_spec_dict


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
"""A folder: while set on the cluster's nodes, each trial's scoring waits (at most ``NODE_BARRIER_S``) until
trials are scoring on two nodes (see :func:`hold_scoring_until_two_nodes_score`)."""
NODE_BARRIER_S = 60.0


def hold_scoring_until_two_nodes_score() -> None:
    """Ray ``worker_process_setup_hook`` (test-only): a tiny trial scores in well under a second, quicker than
    Ray starts a worker on the second node, so Ray Tune would hand every trial to the first node's reused actor.
    Here each trial, before scoring, marks its node in ``$NAS_TEST_NODE_BARRIER`` and waits until two nodes
    have: the first trial keeps its node's only CPU meanwhile, so the second must be scheduled on the other."""
    import ray

    import nas.search.trials as trials

    barrier, score_arch = Path(os.environ[NODE_BARRIER_ENV]), trials.score_arch

    def score_once_two_nodes_score(*args, **kwargs):
        barrier.mkdir(parents=True, exist_ok=True)
        (barrier / ray.get_runtime_context().get_node_id()).touch()
        deadline = time.monotonic() + NODE_BARRIER_S
        while len(list(barrier.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        return score_arch(*args, **kwargs)

    trials.score_arch = score_once_two_nodes_score


@pytest.mark.slow
def test_sweep_on_a_two_node_cluster_scores_trials_on_both_nodes(multi30k, tmp_path, tiny_supernet, monkeypatch):
    """Each node has 1 CPU and each trial takes 1 CPU, so two trials scoring at once (held until they do by
    :func:`hold_scoring_until_two_nodes_score`) can never share a node: the trials' ``node_id`` must name both
    nodes. Fails if the sweep ignored ``--address`` (a local Ray has one node) or a trial took more than 1 CPU."""
    import ray
    from ray.cluster_utils import Cluster

    from nas.search.ray_session import init_ray

    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the nodes' workers import nas
    monkeypatch.setenv(NODE_BARRIER_ENV, str(tmp_path / "nodes_scoring"))  # the nodes' workers inherit both
    storage = tmp_path / "shared_ray"
    raw = tiny_spec_dict(multi30k, tmp_path, search={"trials": 4, "max_concurrent": 2, "cpu_per_trial": 1,
                                                     "beam_size": 2, "latency_sentences": 2},
                         resources={"cpu": 1, "storage_path": str(storage)}, tracking={"experiment": "cluster"})
    spec_file = sweep_with_supernet(raw, tmp_path, tiny_supernet)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        gpu_raw = {**raw, "search": {**raw["search"], "gpu_per_trial": 0.5}}
        with pytest.raises(SpecError, match=r"search.gpu_per_trial=0.5 but the Ray cluster has 0 GPUs"):
            init_ray(parse_spec(gpu_raw), cluster.address)
        assert not ray.is_initialized()

        hook = {"runtime_env": {"worker_process_setup_hook": f"{__name__}.hold_scoring_until_two_nodes_score"}}
        env = nas_env(tmp_path, RAY_JOB_CONFIG_JSON_ENV_VAR=json.dumps(hook))  # as `ray job submit` passes it
        proc = run_nas(["sweep", str(spec_file), "--address", cluster.address], env, tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        records = read_sweep(spec_file, env)
        assert sorted(t.number for t in records.optuna) == [0, 1, 2, 3]
        assert all(t.state.name == "COMPLETE" for t in records.optuna)
        assert {t.status for t in records.ray} == {"TERMINATED"} and len(records.ray) == 4
        by_trial = {t.config["optuna_trial"]: t.last_result["node_id"] for t in records.ray}
        cluster_nodes = {node.node_id for node in cluster.list_all_nodes()}
        assert len(cluster_nodes) == 2 and set(by_trial.values()) == cluster_nodes, (by_trial, cluster_nodes)
        assert {p.name for p in (tmp_path / "nodes_scoring").iterdir()} == cluster_nodes  # the hook ran on both
        assert any(storage.glob("*-search/experiment_state-*.json"))  # resources.storage_path, not <run>/ray
        assert not (tmp_path / "runs" / "tiny" / "ray").exists()
    finally:
        cluster.shutdown()
