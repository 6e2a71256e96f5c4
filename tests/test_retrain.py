"""`nas retrain`: one sub-Transformer trained alone with the YAML's retrain recipe, resumable, tracked in MLflow,
exported by `nas export --run-id`, shown beside the inherited scores by `nas leaderboard`; and its bad input.

Real MLflow (SQLite), a real supernet trained on a slice of Multi30k (the session's ``tiny_supernet``), real
training; the kill test SIGKILLs a `nas retrain` subprocess inside a checkpoint write.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from nas import tracking
from nas.cli import app
from nas.space.arch import Arch, StackArch
from tests.conftest import nas_env, run_nas, sweep_with_supernet, tiny_spec_dict

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RECIPE = {"steps": 6, "checkpoint_every": 2, "average_last": 2, "dropout": 0.1, "lr": 2e-3, "warmup_steps": 2}
TRIAL_ARCH = Arch(StackArch((32, 16), (64, 32), (2, 1)), StackArch((32,), (64,), (2,)))
BASELINE = "enc[32/64 32/64] dec[32/64]"


def _spec_file(multi30k: Path, tmp_path: Path, tiny_supernet, **retrain) -> Path:
    raw = tiny_spec_dict(multi30k, tmp_path)
    raw["retrain"] = {**RECIPE, **retrain}
    raw["search"] = {**raw["search"], "latency_repeats": 2}
    return sweep_with_supernet(raw, tmp_path, tiny_supernet)


@pytest.fixture
def swept(multi30k, tmp_path, tiny_supernet, mlflow_uri):
    """The tiny YAML with its supernet in place, and a sweep in MLflow as `nas sweep` leaves it: a parent run and a
    FINISHED trial of TRIAL_ARCH whose tags name the supernet and data folders."""
    from nas.builders import prepare_sweep_data
    from nas.space import load_spec

    spec_file = _spec_file(multi30k, tmp_path, tiny_supernet)
    spec = load_spec(spec_file)
    data = prepare_sweep_data(spec, progress=False)
    parent = tracking.start_run("tiny", "sweep", role="sweep", tags={"nas.sweep_id": "S1"})
    trial = tracking.start_run("tiny", "trial-0", role="trial", parent_run_id=parent,
                               tags={"nas.supernet_dir": str((spec.run_dir / "supernet").resolve()),
                                     "nas.data_dir": str(Path(data.root).resolve()),
                                     "nas.arch_summary": TRIAL_ARCH.summary(), "nas.arch_id": TRIAL_ARCH.arch_id})
    tracking.log_metrics(trial, {"bleu": 1.5, "chrf": 10.0, "latency_ms": 3.0, "params_m": 0.1})
    tracking.log_json_artifact(trial, TRIAL_ARCH.to_dict(), "arch.json")
    tracking.end_run(trial)
    tracking.end_run(parent)
    return spec_file, spec, parent, trial


def _one_error_line(result) -> str:
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return " ".join(lines[0].split())


def test_retrain_of_a_trial_by_id_prefix_is_a_child_run_linked_to_it_that_export_and_leaderboard_use(swept, tmp_path):
    spec_file, spec, parent, trial = swept
    runner = CliRunner()
    result = runner.invoke(app, ["retrain", str(spec_file), "--run-id", trial[:10], "--out", str(tmp_path / "rt")])
    assert result.exit_code == 0, (result.output, result.exception)

    (run,) = tracking.find_runs("tiny", role="retrain")
    tags, metrics = run.data.tags, run.data.metrics
    assert run.info.status == "FINISHED"
    assert tags["mlflow.parentRunId"] == parent and tags["nas.source_run_id"] == trial
    assert tags["nas.sweep_id"] == "S1" and tags["nas.arch_id"] == TRIAL_ARCH.arch_id
    for name in ("bleu", "chrf", "valid_loss", "latency_ms", "latency_ratio", "params_m", "train_loss"):
        assert name in metrics, name
    assert run.data.params["retrain.steps"] == "6" and run.data.params["retrain.init"] == "scratch"
    artifacts = {Path(a.path).name for a in tracking.get_client().list_artifacts(run.info.run_id, "model")}
    assert {"model.safetensors", "model.json", "arch.json", "spm.model"} <= artifacts

    # the final weights are the mean of the two newest snapshots (steps 4 and 6): average_last 2
    snaps = [load_file(str(tmp_path / "rt" / "snapshots" / f"step_{s:08d}.safetensors")) for s in (4, 6)]
    final = load_file(str(tmp_path / "rt" / "model.safetensors"))
    assert final.keys() == snaps[0].keys()
    for name, tensor in final.items():
        torch.testing.assert_close(tensor, (snaps[0][name] + snaps[1][name]) / 2)
    assert not torch.equal(final[next(iter(final))], snaps[1][next(iter(final))])

    # nas export --run-id <retrain run>: the retrained weights, not a crop of the supernet
    out = tmp_path / "exported"
    result = runner.invoke(app, ["export", "--run-id", run.info.run_id[:12], "--out", str(out)])
    assert result.exit_code == 0, (result.output, result.exception)
    exported = load_file(str(out / "model.safetensors"))
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
    assert Arch.from_dict(json.loads((out / "arch.json").read_text())) == TRIAL_ARCH

    # nas leaderboard: the trial's row carries its retrained BLEU beside the inherited one
    result = runner.invoke(app, ["leaderboard", "--experiment", "tiny", "--format", "json", "--out",
                                 str(tmp_path / "lb.json")])
    assert result.exit_code == 0, result.output
    (row,) = json.loads((tmp_path / "lb.json").read_text())
    assert row["run_id"] == trial and row["bleu"] == 1.5
    assert row["retrain_bleu"] == pytest.approx(metrics["bleu"]) and row["retrain_run_id"] == run.info.run_id
    table = runner.invoke(app, ["leaderboard", "--experiment", "tiny"])
    assert "retrained BLEU" in table.stdout, table.stdout

    # a rerun finds the finished retrain: no second run, no training
    result = runner.invoke(app, ["retrain", str(spec_file), "--run-id", trial, "--out", str(tmp_path / "rt")])
    assert result.exit_code == 0, result.output
    assert len(tracking.find_runs("tiny", role="retrain")) == 1


def test_inherited_init_starts_from_the_supernet_s_crop(swept, tmp_path):
    """One step at a learning rate of 1e-9 moves no weight by more than ~1e-9 (Adam), so the retrained model is
    the supernet's crop of the arch: extract() of the saved supernet is the independent reference."""
    from nas.model.io import load_model
    from nas.model.supernet import extract

    spec_file, spec, _, trial = swept
    result = CliRunner().invoke(app, ["retrain", str(spec_file), "--best", "--out", str(tmp_path / "inh"),
                                      "--set", "retrain.init=inherited", "--set", "retrain.steps=1",
                                      "--set", "retrain.lr=1e-9", "--set", "retrain.average_last=1"])
    assert result.exit_code == 0, (result.output, result.exception)
    crop = extract(load_model(spec.run_dir / "supernet", "supernet"), TRIAL_ARCH).state_dict()
    trained = load_file(str(tmp_path / "inh" / "model.safetensors"))
    assert crop.keys() == trained.keys()
    for name in crop:
        torch.testing.assert_close(trained[name], crop[name], atol=1e-6, rtol=0)
    (run,) = tracking.find_runs("tiny", role="retrain")
    assert run.data.tags["nas.init"] == "inherited" and run.data.tags["nas.source_run_id"] == trial  # --best


@pytest.mark.slow  # over 5 s on 2 cores: out of the inner loop (pytest -m "not slow")
def test_a_killed_retrain_resumes_to_the_weights_of_an_uninterrupted_one(multi30k, tmp_path, tiny_supernet):
    """SIGKILL inside the second checkpoint write (step 4 written to a temporary file, not yet renamed), rerun: the
    final weights equal those of a run never killed (dropout 0.1: the RNG state is restored too), and the killed
    MLflow run is ended KILLED beside one FINISHED."""
    spec_file = _spec_file(multi30k, tmp_path, tiny_supernet, average_last=1)
    env = nas_env(tmp_path)
    args = ["retrain", str(spec_file), "--arch", BASELINE]
    log = tmp_path / "kills.log"
    killed = run_nas([*args, "--out", str(tmp_path / "killed")],
                     {**env, "NAS_TEST_KILL": "checkpoint_write:2", "NAS_TEST_KILL_LOG": str(log)}, tmp_path)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert log.read_text().split()[0] == "checkpoint_write"
    left = torch.load(tmp_path / "killed" / "checkpoint.pt", weights_only=True)
    assert left["state"]["step"] == 2  # the step-4 checkpoint died before its rename: the step-2 one is whole
    resumed = run_nas([*args, "--out", str(tmp_path / "killed")], env, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    clean = run_nas([*args, "--out", str(tmp_path / "clean")], env, tmp_path)
    assert clean.returncode == 0, clean.stderr[-2000:]

    a = load_file(str(tmp_path / "killed" / "model.safetensors"))
    b = load_file(str(tmp_path / "clean" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], left["model"][k]) for k in a)  # the resumed run trained steps 3-6

    import mlflow

    client = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])
    (exp,) = [e for e in client.search_experiments() if e.name == "tiny"]
    runs = client.search_runs([exp.experiment_id], "tags.`nas.role` = 'retrain'")
    statuses = sorted(r.info.status for r in runs if r.data.tags["nas.retrain_dir"].endswith("killed"))
    assert statuses == ["FINISHED", "KILLED"]
    assert all("nas.source_run_id" not in r.data.tags and "mlflow.parentRunId" not in r.data.tags for r in runs)


@pytest.mark.parametrize("case", ["unknown", "parent", "ambiguous", "retrain_run", "two_sources", "no_source",
                                  "bad_arch", "unbuildable_arch"])
def test_bad_input_is_one_line_and_writes_nothing(swept, tmp_path, planted_ids, case):
    spec_file, spec, parent, trial = swept
    out = tmp_path / "never"
    if case == "ambiguous":  # two real runs whose ids the store was made to start with beef1 / beef2
        planted_ids("beef1", "beef2")
        for name in ("t1", "t2"):
            tracking.end_run(tracking.start_run("tiny", name, role="trial", parent_run_id=parent))
        prefix = "beef"
    if case == "retrain_run":
        other = tracking.start_run("tiny", "rt", role="retrain")
        tracking.end_run(other)
    args = {"unknown": ["--run-id", "0123abcd"], "parent": ["--run-id", parent],
            "ambiguous": ["--run-id", prefix] if case == "ambiguous" else [],
            "retrain_run": ["--run-id", other] if case == "retrain_run" else [],
            "two_sources": ["--run-id", trial, "--arch", BASELINE], "no_source": [],
            "bad_arch": ["--arch", "enc[32] dec[32/64]"], "unbuildable_arch": ["--arch", "enc[30/64] dec[32/64]"]}[case]
    before = len(tracking.find_runs("tiny"))
    line = _one_error_line(CliRunner().invoke(app, ["retrain", str(spec_file), *args, "--out", str(out)]))
    expected = {"unknown": "no MLflow run id starts with '0123abcd'",
                "parent": f"run {parent} is the parent run of sweep S1, not a trial",
                "ambiguous": "pass more characters", "retrain_run": f"run {other}" if case == "retrain_run" else "",
                "two_sources": "pass exactly one of --run-id ID, --best or --arch ARCH",
                "no_source": "pass exactly one of --run-id ID, --best or --arch ARCH",
                "bad_arch": "--arch 'enc[32] dec[32/64]'", "unbuildable_arch": "cannot build this model"}[case]
    assert expected in line, line
    assert not out.exists()
    assert len(tracking.find_runs("tiny")) == before


def test_an_output_folder_holding_another_arch_or_recipe_is_refused(swept, tmp_path):
    spec_file, *_ = swept
    out = tmp_path / "rt"
    runner = CliRunner()
    assert runner.invoke(app, ["retrain", str(spec_file), "--arch", BASELINE, "--out", str(out),
                               "--set", "retrain.steps=2"]).exit_code == 0
    marker = (out / "retrain.json").read_text()
    line = _one_error_line(runner.invoke(app, ["retrain", str(spec_file), "--arch", "enc[32/64] dec[32/64]",
                                               "--out", str(out), "--set", "retrain.steps=2"]))
    assert f"--out {out} holds a retrain of another arch (enc[32/64 32/64] dec[32/64]" in line, line
    line = _one_error_line(runner.invoke(app, ["retrain", str(spec_file), "--arch", BASELINE, "--out", str(out),
                                               "--set", "retrain.steps=3"]))
    assert "another recipe (retrain.steps differ)" in line, line
    assert (out / "retrain.json").read_text() == marker
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    line = _one_error_line(runner.invoke(app, ["retrain", str(spec_file), "--arch", BASELINE,
                                               "--out", str(tmp_path / "other")]))
    assert "holds files and is no retrain folder" in line, line
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["notes.txt"]


def test_the_retrain_section_is_validated_and_defaults_to_the_training_recipe(multi30k, tmp_path):
    from nas.space import SpecError, parse_spec

    raw = tiny_spec_dict(multi30k, tmp_path)
    spec = parse_spec(raw, "x")
    recipe = spec.retrain.resolved(spec)
    assert (recipe["steps"], recipe["lr"], recipe["dropout"], recipe["init"]) == (8, 2e-3, spec.supernet.dropout,
                                                                                 "scratch")
    with pytest.raises(SpecError, match="retrain.init"):
        parse_spec({**raw, "retrain": {"init": "warm"}}, "x")
    with pytest.raises(SpecError, match="retrain.stepz"):
        parse_spec({**raw, "retrain": {"stepz": 3}}, "x")
    assert yaml.safe_dump(raw)  # the dict stays a plain YAML document


def test_the_python_api_retrains_an_arch_and_refuses_bad_input_with_nas_error(swept, tmp_path):
    import nas

    spec_file, *_ = swept
    with pytest.raises(nas.NasError, match="pass exactly one of"):
        nas.retrain(spec_file)
    with pytest.raises(nas.NasError, match="--arch 'enc\\[1/2'"):
        nas.retrain(spec_file, arch="enc[1/2")
    result = nas.retrain(spec_file, arch=BASELINE, out_dir=tmp_path / "api", progress=False)
    assert result.arch == Arch.parse(BASELINE) and result.source_run_id is None
    assert json.loads((tmp_path / "api" / "metrics.json").read_text()) == result.metrics
    run = tracking.get_client().get_run(result.run_id)
    assert run.data.tags["nas.role"] == "retrain" and run.info.status == "FINISHED"
    assert run.data.metrics["bleu"] == pytest.approx(result.metrics["bleu"])
