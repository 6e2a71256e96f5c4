"""Relative paths of a sweep's saved YAML read against the folder it started in (``nas sweep --resume NAME`` from
another folder), without changing the current folder (issue 29: no ``os.chdir``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from nas.space import SweepSpec
from nas.space.rebase import rebase_paths
from tests.conftest import tiny_spec_dict


def test_every_relative_path_field_is_joined_to_the_base_and_nothing_else(tmp_path):
    raw = {"name": "x", "workdir": "runs", "data": {"train": {"src": "d/train.en.gz", "tgt": "/abs/train.de.gz"},
                                                    "cache_dir": "cache", "tokenizer": {"vocab_size": 400}},
           "train": {"proximal_init": "init/model.safetensors", "steps": 3},
           "search": {"latency_predictor": "~/pred.safetensors", "trials": 2}}
    out = rebase_paths(raw, tmp_path, SweepSpec)
    assert out["workdir"] == str(tmp_path / "runs")
    assert out["data"]["train"] == {"src": str(tmp_path / "d/train.en.gz"), "tgt": "/abs/train.de.gz"}
    assert out["data"]["cache_dir"] == str(tmp_path / "cache")
    assert out["train"] == {"proximal_init": str(tmp_path / "init/model.safetensors"), "steps": 3}
    assert out["search"]["latency_predictor"] == "~/pred.safetensors"  # ~ expands to an absolute path: kept
    assert out["name"] == "x" and out["data"]["tokenizer"] == {"vocab_size": 400}
    assert raw["workdir"] == "runs"  # the input is not changed


def test_a_sweep_resumed_by_name_from_another_folder_reads_its_paths_there(multi30k, tmp_path, monkeypatch):
    from nas.api import sweep_spec
    from nas.search import SPEC_COPY

    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    (start / "m30k").mkdir(parents=True)
    elsewhere.mkdir()
    for name in ("train.en.gz", "train.de.gz", "val.en.gz", "val.de.gz"):
        (start / "m30k" / name).symlink_to(multi30k / name)
    raw = tiny_spec_dict(multi30k, start)
    raw["workdir"], raw["data"]["cache_dir"] = "runs", "cache"
    raw["data"]["train"] = {"src": "m30k/train.en.gz", "tgt": "m30k/train.de.gz"}
    raw["data"]["valid"] = {"src": "m30k/val.en.gz", "tgt": "m30k/val.de.gz"}
    run_dir = start / "runs" / "tiny"
    run_dir.mkdir(parents=True)
    (run_dir / SPEC_COPY).write_text(yaml.safe_dump(raw))
    (run_dir / "sweep.json").write_text(json.dumps({"sweep_id": "tiny-1", "name": "tiny", "created": "now",
                                                    "spec_file": str(start / "tiny.yaml"), "cwd": str(start)}))
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    spec = sweep_spec(None, "tiny", workdir=start / "runs")  # the data files are checked, where they are
    assert Path.cwd() == elsewhere  # the old CLI moved the process to the start folder
    assert spec.data.train.src == start / "m30k" / "train.en.gz" and spec.data.cache_dir == start / "cache"
    assert spec.run_dir == run_dir
    assert os.environ["MLFLOW_TRACKING_URI"] == f"sqlite:///{start / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")
    sweep_spec(None, "tiny", workdir=start / "runs")
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://tracking:5000"  # a URI the user set is kept
