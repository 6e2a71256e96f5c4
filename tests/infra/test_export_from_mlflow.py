"""Export from any machine that reaches MLflow: a sweep tracked by a real ``mlflow server`` with proxied artifacts
logs its supernet there, and ``nas export`` run from another folder, with the sweep's folders gone from this
machine, reads it back through the server."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from nas.export import load_export
from nas.model.io import load_model
from nas.model.supernet import extract
from tests.conftest import nas_env, run_nas, sweep_with_supernet, tiny_spec_dict

pytestmark = pytest.mark.slow


def test_export_reads_the_supernet_through_the_mlflow_server_when_the_sweep_folders_are_elsewhere(
        multi30k, tmp_path, tiny_supernet, restartable_mlflow_server):
    server = restartable_mlflow_server
    cluster = tmp_path / "cluster"
    cluster.mkdir()
    raw = tiny_spec_dict(multi30k, cluster, search={"trials": 1, "max_concurrent": 1, "beam_size": 2,
                                                    "latency_sentences": 2}, tracking={"experiment": "remote"})
    spec_file = sweep_with_supernet(raw, cluster, tiny_supernet)
    env = nas_env(tmp_path, MLFLOW_TRACKING_URI=server.uri)
    sweep = run_nas(["sweep", str(spec_file)], env, cwd=cluster)
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]
    assert ("logged supernet.safetensors, supernet.json, sample_counts.json, spm.model, valid.parquet to MLflow run"
            in " ".join(sweep.stderr.split()))
    stored = {p.name for p in server.artifacts.rglob("*") if p.is_file()}
    # on the server; sample_counts.json: how often each (layer, dimension, value) trained (issue 27)
    assert {"supernet.safetensors", "supernet.json", "sample_counts.json", "spm.model", "valid.parquet"} <= stored
    again = run_nas(["sweep", str(spec_file)], env, cwd=cluster)  # a rerun uploads nothing twice
    assert again.returncode == 0 and "logged supernet" not in again.stderr

    supernet_dir = cluster / "runs" / "tiny" / "supernet"
    kept = tmp_path / "kept-supernet"
    shutil.move(supernet_dir, kept)  # the laptop has no nas_runs/: the tagged folder is not on this machine
    laptop = tmp_path / "laptop"
    laptop.mkdir()
    result = run_nas(["export", "--best", "--experiment", "remote", "--out", "exported", "--onnx"], env, cwd=laptop)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "read the supernet from MLflow run" in " ".join(result.stdout.split())
    exported = load_export(laptop / "exported")
    expected = extract(load_model(kept, "supernet"), exported.arch)
    got = exported.model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected.state_dict().items())  # the trained weights, cropped
    assert json.loads((laptop / "exported" / "export.json").read_text())["run_id"]
    assert not list(laptop.glob("nas-export-*")) and sorted(p.name for p in laptop.iterdir()) == ["exported"]


def test_export_names_what_is_missing_when_neither_the_folder_nor_mlflow_holds_the_supernet(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from nas import tracking
    from nas.cli import app
    from nas.space.arch import Arch, StackArch

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    arch = Arch(StackArch((16,), (32,)), StackArch((16,), (32,)))
    parent = tracking.start_run("lost", "s", role="sweep", tags={"nas.sweep_id": "s"})
    trial = tracking.start_run("lost", "t", role="trial", parent_run_id=parent,
                               tags={"nas.supernet_dir": str(tmp_path / "gone"), "nas.data_dir": str(tmp_path / "gone")})
    tracking.log_json_artifact(trial, arch.to_dict(), "arch.json")
    tracking.end_run(trial)
    result = CliRunner().invoke(app, ["export", "--run-id", trial, "--out", str(tmp_path / "x")])
    assert result.exit_code == 2
    message = " ".join(result.stderr.split())
    assert f"is neither in {tmp_path / 'gone'} on this machine nor in the artifacts of its sweep's supernet run" in message
    assert not (tmp_path / "x").exists()
