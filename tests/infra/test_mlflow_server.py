"""A sweep tracked by a real ``mlflow server`` process: PostgreSQL backend store, proxied artifacts."""

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import nas_env, run_nas, sweep_with_supernet, tiny_spec_dict

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(postgres_url, tmp_path):
    """``mlflow server`` on 127.0.0.1 with its runs in a fresh PostgreSQL database and artifacts proxied to a folder."""
    port = _free_port()
    artifacts = tmp_path / "artifact-store"
    log = open(tmp_path / "mlflow-server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", postgres_url,
                             "--artifacts-destination", artifacts.as_uri(), "--serve-artifacts",
                             "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                             "--allowed-hosts", f"127.0.0.1:{port},localhost:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail("mlflow server did not start:\n" + (tmp_path / "mlflow-server.log").read_text()[-3000:])
        time.sleep(1)
    try:
        yield uri, artifacts
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_sweep_logs_runs_to_postgres_and_artifacts_through_the_server(multi30k, tmp_path, tiny_supernet,
                                                                       mlflow_server):
    uri, artifacts = mlflow_server
    raw = tiny_spec_dict(multi30k, tmp_path, search={"trials": 2, "max_concurrent": 2, "beam_size": 2,
                                                     "latency_sentences": 2, "method": "tpe"},
                         tracking={"experiment": "served"})
    spec_file = sweep_with_supernet(raw, tmp_path, tiny_supernet)
    env = nas_env(tmp_path, MLFLOW_TRACKING_URI=uri)
    proc = run_nas(["sweep", str(spec_file)], env, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()  # all went to the server

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("served")
    runs = client.search_runs([exp.experiment_id])
    roles = sorted(r.data.tags["nas.role"] for r in runs)
    assert roles == ["supernet", "sweep", "trial", "trial"]
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert exp.artifact_location.startswith("mlflow-artifacts:")  # proxied: clients never see the store
    for run in (r for r in runs if r.data.tags["nas.role"] == "trial"):
        arch = json.loads(Path(client.download_artifacts(run.info.run_id, "arch.json", str(tmp_path))).read_text())
        assert "encoder" in arch and "decoder" in arch
    stored = {p.name for p in artifacts.rglob("*") if p.is_file()}
    assert {"arch.json", "tiny.yaml"} <= stored  # the server wrote them into its artifact destination

    board = run_nas(["leaderboard", "--experiment", "served", "--top", "2"], env, tmp_path)
    assert board.returncode == 0 and board.stdout.count("enc[") == 2, board.stdout + board.stderr[-2000:]
