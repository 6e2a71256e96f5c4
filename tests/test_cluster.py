"""Cluster settings from the YAML: ``resources.storage_path`` (a shared folder or a URI) for both Ray Tune
stages, ``search.gpu_per_trial`` checked against the cluster, and a sweep on a local 2-node Ray cluster
(``ray.cluster_utils.Cluster``) whose two concurrent trials can only fit one per node."""

from __future__ import annotations

from pathlib import Path

import pytest

from nas.search.runner import _run_config, ray_dir
from nas.space.spec import SpecError, parse_spec
from tests.conftest import REPO, nas_env, read_sweep, run_nas, sweep_with_supernet, tiny_spec_dict


def _spec(multi30k: Path, tmp_path: Path, **resources):
    return parse_spec(tiny_spec_dict(multi30k, tmp_path, resources={"cpu": 1, **resources}))


def test_ray_experiments_default_to_the_sweep_folder(multi30k, tmp_path):
    spec = _spec(multi30k, tmp_path)
    exp = ray_dir(spec, "tiny-1", "search")
    assert exp == (tmp_path / "runs" / "tiny" / "ray" / "tiny-1-search").resolve()
    config = _run_config(exp, [], 0)
    assert (config.storage_path, config.name) == (str(exp.parent), "tiny-1-search")


def test_storage_path_folder_holds_both_stages(multi30k, tmp_path):
    spec = _spec(multi30k, tmp_path, storage_path=str(tmp_path / "shared"))
    assert ray_dir(spec, "tiny-1", "train") == (tmp_path / "shared" / "tiny-1-train").resolve()
    assert ray_dir(spec, "tiny-1", "search") == (tmp_path / "shared" / "tiny-1-search").resolve()


def test_storage_path_uri_is_kept_as_a_uri(multi30k, tmp_path):
    spec = _spec(multi30k, tmp_path, storage_path="s3://bucket/nas/")
    exp = ray_dir(spec, "tiny-1", "search")
    assert exp == "s3://bucket/nas/tiny-1-search"
    config = _run_config(exp, [], 0)
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


@pytest.mark.slow
def test_sweep_on_a_two_node_cluster_runs_one_trial_per_node(multi30k, tmp_path, tiny_supernet, monkeypatch):
    import ray
    from ray.cluster_utils import Cluster

    from nas.search.runner import _init_ray

    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the nodes' workers import nas
    storage = tmp_path / "shared_ray"
    raw = tiny_spec_dict(multi30k, tmp_path, search={"trials": 2, "max_concurrent": 2, "cpu_per_trial": 1,
                                                     "beam_size": 2, "latency_sentences": 2},
                         resources={"cpu": 1, "storage_path": str(storage)}, tracking={"experiment": "cluster"})
    spec_file = sweep_with_supernet(raw, tmp_path, tiny_supernet)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        gpu_raw = {**raw, "search": {**raw["search"], "gpu_per_trial": 0.5}}
        with pytest.raises(SpecError, match=r"search.gpu_per_trial=0.5 but the Ray cluster has 0 GPUs"):
            _init_ray(parse_spec(gpu_raw), cluster.address)
        assert not ray.is_initialized()

        env = nas_env(tmp_path)
        proc = run_nas(["sweep", str(spec_file), "--address", cluster.address], env, tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        records = read_sweep(spec_file, env)
        assert sorted(t.number for t in records.optuna) == [0, 1]
        assert all(t.state.name == "COMPLETE" for t in records.optuna)
        assert {t.status for t in records.ray} == {"TERMINATED"} and len(records.ray) == 2
        nodes = {t.last_result["node_id"] for t in records.ray}
        assert nodes <= {node.node_id for node in cluster.list_all_nodes()}, nodes
        spans = sorted((r["timestamp"] - r["time_total_s"], r["timestamp"]) for r in (t.last_result for t in records.ray))
        if spans[1][0] < spans[0][1] - 1:  # Ray ran them at once: with 1 CPU per node and per trial, on both nodes
            assert len(nodes) == 2, f"two concurrent trials of 1 CPU on one 1-CPU node: {nodes}"
        assert any(storage.glob("*-search/experiment_state-*.json"))  # resources.storage_path, not <run>/ray
        assert not (tmp_path / "runs" / "tiny" / "ray").exists()
    finally:
        cluster.shutdown()
