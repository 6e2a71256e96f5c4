"""The user jobs through ``import nas`` (issue 29): sweep, leaderboard, export, translate, on a tiny sweep
through real Ray Tune, Optuna and MLflow, in a fresh process as a notebook would run them; and the API's
bad-input errors (``NasError``, nothing started)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import nas_env, sweep_with_supernet, tiny_spec_dict

USER_JOBS = r'''
import json, sys
from pathlib import Path
import nas

yaml_path, out = Path(sys.argv[1]), Path(sys.argv[2])
result = nas.sweep(yaml_path, overrides={"search.trials": 2, "search.points_to_evaluate": ["widest", "narrowest"]})
table = nas.leaderboard(result.experiment, metric="bleu", top=5)
exported = nas.export(out / "exported", best=True, experiment=result.experiment)
again = nas.export(out / "by_prefix", run_id=table.run_id.iloc[-1][:8])
translations = nas.translate(exported.path, ["A dog runs .", "Two men ."])
print(json.dumps({"sweep_id": result.sweep_id, "trials": result.trials_completed, "columns": list(table.columns),
                  "rows": len(table), "run_ids": list(table.run_id), "bleu": [float(b) for b in table.bleu],
                  "exported_run": exported.run_id, "exported_path": str(exported.path),
                  "prefix_run": again.run_id, "messages": exported.messages, "translations": translations,
                  "type": type(table).__name__}))
'''


SECRET = "pw-7f3a9c1e5b"


@pytest.mark.slow
def test_the_user_jobs_in_python_sweep_leaderboard_export_translate(multi30k, tiny_supernet, tmp_path, postgres_url):
    """The user jobs, on a sweep whose YAML takes the Optuna storage's password from ``${NAS_DB_PASSWORD}``; the
    secret then appears in no MLflow param, artifact, run file or table (the sweep of
    ``tests/space/test_env_interpolation.py``'s redaction, folded into this one: one Ray sweep for both)."""
    user_host_db = postgres_url.removeprefix("postgresql+psycopg://")
    user, _, host_db = user_host_db.partition("@")  # trust auth on the test server: any password is accepted
    raw = tiny_spec_dict(multi30k, tmp_path, **{
        "tracking": {"experiment": "pyapi",
                     "optuna_storage": f"postgresql+psycopg://{user}:${{NAS_DB_PASSWORD}}@{host_db}"},
        "search": {"trials": 1, "max_concurrent": 2, "beam_size": 2, "latency_sentences": 2}})
    path = sweep_with_supernet(raw, tmp_path, tiny_supernet)
    assert "${NAS_DB_PASSWORD}" in path.read_text()
    env = nas_env(tmp_path, NAS_DB_PASSWORD=SECRET)
    proc = subprocess.run([sys.executable, "-c", USER_JOBS, str(path), str(tmp_path)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["trials"] == 2  # the override reached the sweep (the YAML says 1)
    assert got["type"] == "DataFrame" and got["rows"] == 2
    assert {"run_id", "arch", "bleu", "latency_ms", "retrain_bleu"} <= set(got["columns"])
    assert got["bleu"] == sorted(got["bleu"], reverse=True)  # best first
    assert got["exported_run"] == got["run_ids"][0]  # --best without constraints: the top row
    assert got["prefix_run"] == got["run_ids"][-1]  # an 8-hex prefix resolved to the full id
    assert any("exported" in m for m in got["messages"])
    exported = Path(got["exported_path"])
    assert json.loads((exported / "export.json").read_text())["run_id"] == got["exported_run"]
    assert len(got["translations"]) == 2 and all(isinstance(t, str) for t in got["translations"])
    _secret_is_nowhere(tmp_path, env, proc, user, host_db)


def _secret_is_nowhere(tmp_path: Path, env: dict, proc: subprocess.CompletedProcess, user: str, host_db: str) -> None:
    """The ``${NAS_DB_PASSWORD}`` secret of the sweep is in no output, MLflow param, artifact, run file or table,
    and the storage URL is logged with ``***`` in its place."""
    from mlflow.tracking import MlflowClient

    from nas.space import REDACTED

    assert SECRET not in proc.stdout + proc.stderr
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("pyapi")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 4  # sweep, supernet (reused), 2 trials
    params = {k: v for r in runs for k, v in r.data.params.items()}
    assert not [k for k, v in params.items() if SECRET in v]
    assert params["tracking.optuna_storage"] == f"postgresql+psycopg://{user}:{REDACTED}@{host_db}"
    downloaded = tmp_path / "artifacts"
    for r in runs:
        client.download_artifacts(r.info.run_id, "", str(downloaded / r.info.run_id))
    artifacts = [f for f in downloaded.rglob("*") if f.is_file()]
    assert any(f.name == "tiny.yaml" for f in artifacts)
    run_files = [f for f in (tmp_path / "runs" / "tiny").rglob("*") if f.is_file()]
    leaked = [f for f in artifacts + run_files if SECRET.encode() in f.read_bytes()]
    assert not leaked
    mlflow_db = tmp_path / "mlflow.db"  # every MLflow table: params, tags, metric keys, run and experiment names
    assert mlflow_db.is_file() and SECRET.encode() not in mlflow_db.read_bytes()
    assert REDACTED.encode() in (tmp_path / "runs" / "tiny" / "sweep.json").read_bytes()


def test_export_is_the_package_and_the_user_job():
    import nas
    import nas.export.folder  # importing a submodule binds nas.export to the package: it must stay callable

    assert callable(nas.export) and nas.export.export_trial.__module__ == "nas.export.trial"
    assert {"export", "leaderboard"} <= set(nas.__all__)


@pytest.mark.parametrize("call, message", [
    (lambda nas, tmp: nas.export(tmp / "x"), "exactly one of --best or --run-id"),
    (lambda nas, tmp: nas.export(3, best=True), "export(out_dir): expected a folder path"),
    (lambda nas, tmp: nas.export(tmp / "x", run_id="abc", quantize="int4"), "the one quantization is int8"),
    (lambda nas, tmp: nas.sweep(tmp / "missing.yaml"), "missing.yaml"),
    (lambda nas, tmp: nas.sweep(42), "sweep(path): expected a file path"),
    (lambda nas, tmp: nas.train("search_spaces/quickstart.yaml", overrides=["train.steps=2"]),
     "overrides: expected a dict"),
    (lambda nas, tmp: nas.train("search_spaces/quickstart.yaml", overrides={"train.steps": object()}),
     "is not a YAML value"),
    (lambda nas, tmp: nas.train(nas.load_spec("search_spaces/quickstart.yaml"), overrides={"train.steps": 2}),
     "overrides apply to a YAML path"),
    (lambda nas, tmp: nas.train("search_spaces/quickstart.yaml", overrides={"train.nosuch": 2}), "nosuch"),
    (lambda nas, tmp: nas.leaderboard(top=0), "expected a positive int"),
])
def test_the_api_refuses_bad_input_with_a_nas_error(call, message, tmp_path, monkeypatch):
    import nas

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    with pytest.raises(nas.NasError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        call(nas, tmp_path)
    assert not (tmp_path / "x").exists()
