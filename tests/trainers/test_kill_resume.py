"""``kill -9`` of ``nas train`` in the middle of a three-stage run, then the same command again: the result equals
an uninterrupted run, and the killed run's MLflow records end KILLED."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from mlflow import MlflowClient

from nas.model.io import load_model
from nas.builders import prepare_sweep_data
from nas.space import parse_spec
from tests.conftest import tiny_spec_dict, use_tiny_data
from trainers import train_supernet

STAGES = [{"name": "joint", "steps": 4}, {"name": "word_distill", "steps": 3},
          {"name": "seq_distill", "steps": 4, "max_sentences": 24, "beam_size": 2}]


def _train_cmd(yaml_path, out):
    return [sys.executable, "-m", "nas.cli", "train", str(yaml_path), "--out", str(out)]


@pytest.mark.slow
@pytest.mark.parametrize("kill_after", ["step 3/", "step 9/"], ids=["in_stage1", "in_stage3"])
def test_sigkill_then_rerun_equals_an_uninterrupted_run(multi30k, tiny_data, tmp_path, kill_after):
    raw = use_tiny_data(tiny_spec_dict(multi30k, tmp_path), tiny_data)
    raw["train"] = {k: v for k, v in raw["train"].items() if k != "steps"} | \
        {"stages": STAGES, "max_tokens": 128, "precision": "fp32", "log_every": 1, "checkpoint_every": 2,
         "keep_last": 0, "stage_eval": False}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    spec = parse_spec(raw)
    data = prepare_sweep_data(spec, progress=False)
    train_supernet(spec, data, tmp_path / "straight", progress=False)

    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(_train_cmd(path, tmp_path / "killed"), stderr=subprocess.PIPE, text=True, env=env,
                            cwd=tmp_path)
    deadline = time.time() + 300
    for line in proc.stderr:  # kill -9 as soon as the step is logged: between checkpoints
        if kill_after in line or time.time() > deadline:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    ckpt = torch.load(tmp_path / "killed" / "checkpoint.pt", weights_only=True)
    assert ckpt["state"]["step"] < 11

    done = subprocess.run(_train_cmd(path, tmp_path / "killed"), capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    straight = load_model(tmp_path / "straight", "supernet").state_dict()
    for name, p in load_model(tmp_path / "killed", "supernet").state_dict().items():
        assert torch.allclose(p, straight[name], atol=1e-6), name

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id], "tags.`nas.role` = 'supernet'")
    assert sorted(r.info.status for r in runs) == ["FINISHED", "KILLED"]
    stage_runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id], "tags.`nas.role` = 'stage'")
    assert "RUNNING" not in {r.info.status for r in stage_runs}
