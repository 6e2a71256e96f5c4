"""`nas export --register`: an MLflow pyfunc model in a real registry (SQLite), loaded by alias in a
fresh process, translates like `nas translate`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from typer.testing import CliRunner

from nas import tracking
from nas.cli import app
from nas.data import Tokenizer, read_lines
from nas.export.mlflow_model import EXPORT_FILES, pip_requirements
from nas.model import SuperTransformer
from nas.model.io import save_model
from nas.space.arch import Arch, StackArch
from tests.conftest import REPO

EXP = "registry-test"
NAME = "tiny-en-de"


@pytest.fixture(scope="module")
def registered(multi30k, tmp_path_factory):
    """A trial run of a tiny (untrained, seeded) supernet in MLflow, exported twice with --register."""
    work = tmp_path_factory.mktemp("registry")
    data_dir = work / "data"
    data_dir.mkdir()
    lines = read_lines(multi30k / "train.en.gz", limit=500) + read_lines(multi30k / "train.de.gz", limit=500)
    tokenizer = Tokenizer.train(lines, data_dir / "spm", vocab_size=300)
    assert tokenizer.model_path == data_dir / "spm.model"  # where `nas export` looks (tag nas.data_dir)
    valid = read_lines(multi30k / "val.en.gz", limit=3)
    pq.write_table(pa.table({"src_text": valid}), data_dir / "valid.parquet")
    torch.manual_seed(0)
    maxima = Arch(StackArch((32, 32), (64, 64), (2, 2)), StackArch((32, 32), (64, 64), (2, 2)))
    save_model(SuperTransformer(tokenizer.vocab_size, 32, 2, maxima, max_positions=128).eval(), work / "sn", "supernet")
    arch = Arch(StackArch((16,), (32,), (2,)), StackArch((32, 16), (64, 32), (1, 2)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{work / 'mlflow.db'}")
        mp.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        mp.chdir(work)  # artifacts under work/mlruns
        trial = tracking.start_run(EXP, "trial-0", role="trial",
                                   tags={"nas.supernet_dir": str(work / "sn"), "nas.data_dir": str(data_dir),
                                         "nas.beam_size": "2", "nas.sweep_id": "S", "nas.arch_summary": arch.summary()})
        tracking.log_json_artifact(trial, arch.to_dict(), "arch.json")
        tracking.log_metrics(trial, {"bleu": 1.0, "latency_ms": 3.0})
        tracking.end_run(trial)
        runner = CliRunner()
        results = [runner.invoke(app, ["export", "--run-id", trial, "--out", str(work / f"exported{i}"), "--register", NAME])
                   for i in (1, 2)]
        yield work, trial, valid, results, dict(os.environ)


def _fresh_python(code: str, env: dict, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)


def test_register_logs_versions_and_moves_the_champion_alias(registered):
    work, trial, valid, results, env = registered
    for i, result in enumerate(results, 1):
        assert result.exit_code == 0, result.output
        assert f"registered MLflow model '{NAME}' version {i} (alias champion" in result.stdout
        assert f"mlflow.pyfunc.load_model('models:/{NAME}@champion')" in result.stdout
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", env["MLFLOW_TRACKING_URI"])
        client = tracking.get_client()
        champion = client.get_model_version_by_alias(NAME, "champion")
        assert str(champion.version) == "2"
        exports = tracking.find_runs(EXP, role="export")
        assert len(exports) == 2 and {r.info.status for r in exports} == {"FINISHED"}
        assert {r.data.tags["nas.source_run_id"] for r in exports} == {trial}
        assert champion.run_id == exports[0].info.run_id  # newest first
        assert [r.run_id for r in tracking.leaderboard(EXP)] == [trial]  # exports never enter the leaderboard


@pytest.mark.slow  # over 5 s on 2 cores: out of the inner loop (pytest -m "not slow")
def test_champion_loads_in_a_fresh_process_and_translates_like_nas_translate(registered, multi30k):
    work, _, _, _, env = registered
    source = read_lines(multi30k / "test_2016_flickr.en.gz", limit=5)
    code = (
        "import json, sys, mlflow.pyfunc, pandas as pd\n"
        "model = mlflow.pyfunc.load_model(f'models:/{sys.argv[1]}@champion')\n"
        "src = json.loads(sys.argv[2])\n"
        "out = {'list': model.predict(src), 'frame': model.predict(pd.DataFrame({'src': src})),\n"
        "       'beam1': model.predict(src, params={'beam_size': 1})}\n"
        "import nas\n"
        "out['nas_file'] = nas.__file__\n"
        "out['heavy'] = sorted({'ray', 'optuna', 'matplotlib'} & set(sys.modules))\n"
        "print(json.dumps(out))\n"
    )
    elsewhere = work / "client"
    elsewhere.mkdir(exist_ok=True)
    # PYTHONDONTWRITEBYTECODE: MLflow loads a model of a local file store in place, so this process would write
    # __pycache__ into the stored model, which the next test reads back as what the export logged
    clean = {**{k: v for k, v in env.items() if k != "PYTHONPATH"}, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = _fresh_python(code, clean, elsewhere, NAME, json.dumps(source))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    cli = CliRunner().invoke(app, ["translate", str(work / "exported2")], input="\n".join(source) + "\n")
    assert cli.exit_code == 0, cli.output
    expected = cli.stdout.splitlines()
    assert len(expected) == 5 and all(expected)
    assert got["list"] == expected and got["frame"] == expected
    greedy = CliRunner().invoke(app, ["translate", str(work / "exported2"), "--beam", "1"], input="\n".join(source) + "\n")
    assert got["beam1"] == greedy.stdout.splitlines()
    assert got["heavy"] == []
    assert not Path(got["nas_file"]).is_relative_to(REPO)  # the model's own copy of the nas code


def test_logged_model_has_signature_example_artifacts_and_pinned_requirements(registered):
    work, _, valid, _, env = registered
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", env["MLFLOW_TRACKING_URI"])
        import mlflow

        local = Path(mlflow.artifacts.download_artifacts(f"models:/{NAME}@champion", dst_path=str(work / "dl")))
    mlmodel = yaml.safe_load((local / "MLmodel").read_text())
    assert json.loads(mlmodel["signature"]["inputs"]) == [{"type": "string", "required": True}]
    assert json.loads(mlmodel["signature"]["outputs"]) == [{"type": "string", "required": True}]
    assert json.loads(mlmodel["signature"]["params"]) == [
        {"name": "beam_size", "default": 2, "shape": None, "type": "long"}]
    assert json.loads((local / mlmodel["saved_input_example_info"]["artifact_path"]).read_text()) == valid
    assert sorted(p.name for p in (local / "artifacts" / "export").iterdir()) == sorted(EXPORT_FILES)
    requirements = (local / "requirements.txt").read_text().split()
    assert requirements == pip_requirements() and any(r.startswith("torch==") for r in requirements)
    assert not any(r.split("==")[0] in {"ray", "optuna"} for r in requirements)
    code = local / "code"  # the whole nas package, not only its export/ subpackage
    assert (code / "nas" / "export" / "folder.py").is_file() and (code / "nas" / "model" / "supernet.py").is_file()
    assert not list(code.rglob("__pycache__"))


def test_register_refuses_a_blank_name_before_exporting(registered):
    work, trial, _, _, env = registered
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", env["MLFLOW_TRACKING_URI"])
        result = CliRunner().invoke(app, ["export", "--run-id", trial, "--out", str(work / "x"), "--register", " "])
    assert result.exit_code == 2 and "--register needs a model name" in result.stderr
    assert not (work / "x").exists()
