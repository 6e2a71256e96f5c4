"""``${VAR}`` in the sweep YAML: substituted from the environment at load time, and redacted (``***``) from
every logged param, artifact and file the sweep writes (the real sweep's check:
``tests/infra/test_backends_sweep.py``'s ``test_the_password_is_in_no_*`` tests, on its sweep through ``import nas``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nas.space import REDACTED, SpecError, load_spec
from tests.conftest import tiny_spec_dict

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
