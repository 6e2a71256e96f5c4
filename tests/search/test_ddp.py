"""Data-parallel supernet training: 2 Ray Train workers (gloo on CPU) against one process on the same global batch.

A whole sweep with ``resources.workers: 2`` (its supernet run, the stage run, the step metrics, the supernet file,
and an output free of Ray Train's own lines) is ``tests/test_e2e.py``'s module sweep."""

import json

import pytest
import ray
import torch
from mlflow import MlflowClient

from nas import tracking
from nas.model.io import load_model
from nas.search.ddp import OutOfSyncError, check_in_sync, train_supernet_ddp
from nas.builders import prepare_sweep_data
from nas.space import parse_spec
from tests.conftest import tiny_spec_dict, use_tiny_data
from trainers import train_supernet


def test_workers_with_different_parameters_are_refused():
    same = [{"step": 3, "param_sum": 1.5, "param_sq": 2.0}, {"step": 3, "param_sum": 1.5, "param_sq": 2.0}]
    check_in_sync(same)
    with pytest.raises(OutOfSyncError, match="rank 1 holds other parameters than rank 0 at step 3"):
        check_in_sync([same[0], {**same[1], "param_sq": 2.0000001}])


@pytest.mark.slow
def test_two_gloo_workers_stay_in_sync_and_match_a_single_worker(multi30k, tiny_data, tmp_path, monkeypatch):
    raw = use_tiny_data(tiny_spec_dict(multi30k, tmp_path), tiny_data)
    raw["supernet"] |= {"dropout": 0.0, "attention_dropout": 0.0}  # no randomness inside a forward
    raw["train"] |= {"steps": 5, "max_tokens": 256, "precision": "fp32", "log_every": 1, "checkpoint_every": 5,
                     "keep_last": 0, "drop_branch": 0.0, "sandwich_k": 1, "stage_eval": False}
    raw["resources"] = {"cpu": 1, "workers": 2}
    spec = parse_spec(raw)
    data = prepare_sweep_data(spec, progress=False)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    run = tracking.start_run("ddp", "supernet", role="supernet")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        final = train_supernet_ddp(spec, data, tmp_path / "ddp", storage_path=tmp_path / "ray",
                                   log_file=tmp_path / "reports.jsonl", mlflow_uri=uri, experiment="ddp",
                                   supernet_run_id=run)
    finally:
        ray.shutdown()
    client = MlflowClient(uri)  # rank 0's reports, in the supernet run and its stage run
    assert [m.step for m in client.get_metric_history(run, "loss_widest")] == [1, 2, 3, 4, 5]
    stage = tracking.find_tagged_runs("ddp", {tracking.TAG_PARENT: run})
    assert [(r.info.run_name, r.info.status) for r in stage] == [("stage 1 (joint)", "FINISHED")]
    assert "param_sum" not in client.get_run(run).data.metrics
    reports = [json.loads(line)["ranks"] for line in (tmp_path / "reports.jsonl").read_text().splitlines()]
    steps = [r for r in reports if "train_loss" in r[0]]
    assert [r[0]["step"] for r in steps] == [1, 2, 3, 4, 5]
    for ranks in reports:  # same parameters on both ranks after every step (checked by the sink too)
        assert len(ranks) == 2
        assert ranks[0]["param_sum"] == ranks[1]["param_sum"] and ranks[0]["param_sq"] == ranks[1]["param_sq"]
        assert ranks[0]["step"] == ranks[1]["step"]
    assert "widest_bleu" in final

    single = []
    train_supernet(spec, data, tmp_path / "single", report=single.append, progress=False)
    single = [r for r in single if "train_loss" in r]
    for one, two in zip(single, steps):  # losses of the global batch, each rank holding half the sentences
        for key in ("train_loss", "loss_narrowest", "loss_sampled"):
            assert two[0][key] == pytest.approx(one[key], rel=1e-5), (one["step"], key)
        assert two[0]["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    a = load_model(tmp_path / "ddp", "supernet").state_dict()
    for name, p in load_model(tmp_path / "single", "supernet").state_dict().items():
        q = a[name]
        if name.endswith("attn.b_in"):  # [.., 3 (q, k, v), C]: the key bias has an exactly-zero gradient (softmax
            # is shift invariant), so Adam turns its float noise into lr-sized steps; it doesn't change any output
            assert torch.allclose(q[..., 1, :], p[..., 1, :], atol=5 * 2e-3), name
            q, p = q[..., [0, 2], :], p[..., [0, 2], :]
        assert torch.allclose(q, p, atol=2e-5, rtol=1e-4), name
