"""``${VAR}`` in the sweep YAML: substituted from the environment at load time, and redacted (``***``) from
every logged param, artifact and file the sweep writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nas.space import REDACTED, SpecError, load_spec
from tests.conftest import nas_env, run_nas, sweep_with_supernet, tiny_spec_dict

SECRET = "pw-7f3a9c1e5b"


def _write(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text("# nas sweep tiny.yaml\n" + yaml.safe_dump(raw))
    return path


def test_env_reference_is_substituted_and_redacted(multi30k, tmp_path, monkeypatch):
    monkeypatch.setenv("NAS_DB_PASSWORD", SECRET)
    monkeypatch.setenv("NAS_EXPERIMENT", "nightly")
    raw = tiny_spec_dict(multi30k, tmp_path, tracking={"experiment": "${NAS_EXPERIMENT}-sweep",
                                                       "optuna_storage": "postgresql://nas:${NAS_DB_PASSWORD}@db/optuna"})
    spec = load_spec(_write(tmp_path, raw), check_files=False)
    assert spec.tracking.optuna_storage == f"postgresql://nas:{SECRET}@db/optuna"
    assert spec.experiment == "nightly-sweep"
    dumped = spec.redact(spec.model_dump(mode="json"))
    assert dumped["tracking"]["optuna_storage"] == f"postgresql://nas:{REDACTED}@db/optuna"
    assert dumped["tracking"]["experiment"] == f"{REDACTED}-sweep"
    assert SECRET not in str(dumped) and dumped["supernet"] == spec.supernet.model_dump(mode="json")


def test_a_short_secret_is_masked_by_key_and_mangles_nothing_else(multi30k, tmp_path, monkeypatch):
    """Failed before: the value ``nas`` was replaced inside every string (``*** sweep``, ``postgresql://***:***``)."""
    monkeypatch.setenv("NAS_PW", "nas")
    raw = tiny_spec_dict(multi30k, tmp_path, tracking={"optuna_storage": "postgresql://nas:${NAS_PW}@db/nas"})
    spec = load_spec(_write(tmp_path, raw), check_files=False)
    params = spec.redact({"yaml": "# nas sweep tiny.yaml", "tracking.optuna_storage": spec.tracking.optuna_storage,
                          "search": {"method": "tpe"}})
    assert params == {"yaml": "# nas sweep tiny.yaml", "tracking.optuna_storage": f"postgresql://nas:{REDACTED}@db/nas",
                      "search": {"method": "tpe"}}
    dumped = spec.redact(spec.model_dump(mode="json"))
    assert dumped["tracking"]["optuna_storage"] == f"postgresql://nas:{REDACTED}@db/nas"
    assert dumped["name"] == spec.name and dumped["supernet"] == spec.supernet.model_dump(mode="json")


def test_a_long_secret_is_masked_inside_free_text_too(multi30k, tmp_path, monkeypatch):
    monkeypatch.setenv("NAS_DB_PASSWORD", SECRET)
    raw = tiny_spec_dict(multi30k, tmp_path, tracking={"optuna_storage": "postgresql://nas:${NAS_DB_PASSWORD}@db/o"})
    spec = load_spec(_write(tmp_path, raw), check_files=False)
    message = spec.redact(f"cannot reach postgresql://nas:{SECRET}@db/o ({SECRET})")
    assert SECRET not in message and message.startswith("cannot reach ") and message.endswith(f"({REDACTED})")
    assert spec.redact({"note": f"pw={SECRET}"}) == {"note": f"pw={REDACTED}"}


def test_locations_from_the_environment_are_logged_as_they_are(multi30k, tmp_path, monkeypatch):
    """``workdir: ${SCRATCH}/runs`` is a place, not a secret: `nas export` reads the run folder back from MLflow."""
    monkeypatch.setenv("NAS_SCRATCH", str(tmp_path / "scratch"))
    raw = tiny_spec_dict(multi30k, tmp_path)
    raw["workdir"] = "${NAS_SCRATCH}/runs"
    spec = load_spec(_write(tmp_path, raw), check_files=False)
    assert spec.redact(spec.model_dump(mode="json"))["workdir"] == str(tmp_path / "scratch" / "runs")


def test_spec_without_env_references_redacts_nothing(multi30k, tmp_path):
    spec = load_spec(_write(tmp_path, tiny_spec_dict(multi30k, tmp_path)), check_files=False)
    assert spec.redact({"a": ["tiny", 1]}) == {"a": ["tiny", 1]}


def test_missing_env_variable_names_key_path_and_variable(multi30k, tmp_path, monkeypatch):
    monkeypatch.delenv("NAS_DB_PASSWORD", raising=False)
    raw = tiny_spec_dict(multi30k, tmp_path, tracking={"optuna_storage": "postgresql://nas:${NAS_DB_PASSWORD}@db/optuna"})
    with pytest.raises(SpecError, match=r"tiny\.yaml: tracking\.optuna_storage: environment variable NAS_DB_PASSWORD "
                                        r"is not set"):
        load_spec(_write(tmp_path, raw), check_files=False)


def test_env_reference_in_a_list_names_the_index(multi30k, tmp_path, monkeypatch):
    monkeypatch.delenv("NAS_NOPE", raising=False)
    raw = tiny_spec_dict(multi30k, tmp_path, space={"layout": {"values": ["sequential", "${NAS_NOPE}"]}})
    with pytest.raises(SpecError, match=r"space\.layout\.values\.1: environment variable NAS_NOPE is not set"):
        load_spec(_write(tmp_path, raw), check_files=False)


@pytest.mark.slow
def test_secret_from_env_is_in_no_mlflow_param_artifact_or_run_file(multi30k, tmp_path, tiny_supernet,
                                                                      postgres_url):
    from mlflow.tracking import MlflowClient

    user_host_db = postgres_url.removeprefix("postgresql+psycopg://")
    user, _, host_db = user_host_db.partition("@")  # trust auth on the test server: any password is accepted
    raw = tiny_spec_dict(multi30k, tmp_path, tracking={
        "experiment": "secret", "optuna_storage": f"postgresql+psycopg://{user}:${{NAS_DB_PASSWORD}}@{host_db}"})
    spec_file = sweep_with_supernet(raw, tmp_path, tiny_supernet)
    assert "${NAS_DB_PASSWORD}" in spec_file.read_text()
    env = nas_env(tmp_path, NAS_DB_PASSWORD=SECRET)
    proc = run_nas(["sweep", str(spec_file)], env, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert SECRET not in proc.stdout + proc.stderr

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("secret")
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
