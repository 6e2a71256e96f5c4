"""The spec layer is light: reading a sweep YAML, even one that names a latency predictor, loads no torch, Ray,
Optuna or MLflow (checked in a fresh interpreter, since this test process has imported them already)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import yaml

from nas.space.predictor_file import FEATURE_NAMES, PREDICTOR_FORMAT
from tests.conftest import MULTI30K, REPO, tiny_spec_dict

HEAVY = ("torch", "ray", "optuna", "mlflow")


def write_predictor(path, model_dim: int, beam_size: int) -> None:
    """A predictor's two files as ``nas latency fit`` writes them (weights: an empty safetensors file)."""
    header = b"{}"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    n = len(FEATURE_NAMES)
    path.with_suffix(".json").write_text(json.dumps({
        "format": PREDICTOR_FORMAT, "feature_names": list(FEATURE_NAMES), "feature_mean": [0.0] * n,
        "feature_std": [1.0] * n, "target": "log_latency_ratio", "target_mean": 0.0, "target_std": 1.0,
        "model_dim": model_dim, "hidden": 8, "hidden_layers": 1, "batch_size": 1, "beam_size": beam_size,
        "workload": {"src_tokens": 30, "tgt_tokens": 30, "beam": beam_size, "batch": 1},
        "reference_ms": 20.0, "device": "cpu", "metrics": {}}), encoding="utf-8")


def heavy_modules_after(code: str) -> list[str]:
    """The heavy modules in ``sys.modules`` after running ``code`` in a fresh interpreter from the repository."""
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_load_spec_naming_a_latency_predictor_imports_no_torch_ray_optuna_or_mlflow(tmp_path):
    raw = tiny_spec_dict(MULTI30K, tmp_path)
    pred = tmp_path / "pred.safetensors"
    raw["search"] = {**raw.get("search", {}), "latency": "predicted", "latency_predictor": str(pred)}
    write_predictor(pred, raw["supernet"]["model_dim"], raw["search"].get("beam_size", 4))
    file = tmp_path / "sweep.yaml"
    file.write_text(yaml.safe_dump(raw), encoding="utf-8")
    code = (f"import nas.space\nspec = nas.space.load_spec({str(file)!r})\n"
            f"assert spec.search.latency_predictor is not None")
    assert heavy_modules_after(code) == []


def test_a_wrong_predictor_is_still_refused_by_load_spec(tmp_path):
    """The torch-free reader keeps the check: a predictor fitted for another model_dim is a SpecError."""
    import pytest

    from nas.space import SpecError, load_spec

    raw = tiny_spec_dict(MULTI30K, tmp_path)
    pred = tmp_path / "pred.safetensors"
    raw["search"] = {**raw.get("search", {}), "latency": "predicted", "latency_predictor": str(pred)}
    write_predictor(pred, raw["supernet"]["model_dim"] * 2, raw["search"].get("beam_size", 4))
    file = tmp_path / "sweep.yaml"
    file.write_text(yaml.safe_dump(raw), encoding="utf-8")
    with pytest.raises(SpecError, match="search.latency_predictor: .* was fitted for model_dim"):
        load_spec(file)
    write_predictor(pred, raw["supernet"]["model_dim"], raw["search"].get("beam_size", 4))
    pred.write_bytes(b"\x01")  # a truncated weights file beside a good sidecar
    with pytest.raises(SpecError, match="is not a latency predictor"):
        load_spec(file)


def test_spec_errors_are_nas_errors():
    from nas.errors import NasError
    from nas.space import SpecError

    assert issubclass(SpecError, NasError)


def test_import_nas_space_and_its_modules_loads_nothing_heavy():
    code = "import nas.space, nas.space.arch, nas.space.schema, nas.space.loader, nas.space.constraints"
    assert heavy_modules_after(code) == []
