"""End to end through real Ray Tune, Optuna and MLflow on a slice of Multi30k:
sweep -> MLflow runs -> leaderboard -> export -> translate in a fresh process."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, nas_cli, tiny_spec_dict

pytestmark = pytest.mark.slow


def _nas(args: list[str], env: dict, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nas.cli", *args], input=stdin, capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=900)


def _run_sweep(raw: dict, work: Path) -> tuple[dict, str]:
    """Write ``raw`` as a YAML in ``work`` and run ``nas sweep`` on it in a subprocess; returns (env, log)."""
    spec_file = work / f"{raw['tracking']['experiment']}.yaml"
    spec_file.write_text(f"# nas sweep {spec_file.name}\n" + yaml.safe_dump(raw))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}", "PYTHONPATH": str(REPO)}
    proc = _nas(["sweep", str(spec_file)], env, work)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-10000:]
    return env, log


def _params_bound(raw: dict) -> float:
    """A ``params_m`` bound halfway between the tiny space's narrowest and widest sub-Transformers (millions;
    parameter counts do not depend on training, only on the sizes and the tokenizer's vocabulary)."""
    from nas.model.supernet import count_params, extract
    from nas.builders import prepare_sweep_data
    from nas.space.space import SearchSpace
    from nas.space import parse_spec
    from nas.builders import build_supernet

    spec = parse_spec(raw)
    model = build_supernet(spec, prepare_sweep_data(spec, progress=False).vocab_size)  # the sweep reuses the data cache
    space = SearchSpace.from_spec(spec)
    return (count_params(extract(model, space.narrowest())) + count_params(extract(model, space.widest()))) / 2e6


UNIFIED_SPACE = {
    "encoder_layers": {"values": [1, 2]},
    "layout": {"values": ["sequential", "prime"], "per_layer": True},
    "units": {"values": [1, 2], "per_layer": True},
    "width": {"values": [16, 32], "per_layer": True},
    "branches": {"values": [1, 2], "per_layer": True},
    "paths": {"values": [1, 2], "per_layer": True, "when": {"layout": "sequential"}},
    "kernels": {"values": [[], [3], [3, 5]], "per_layer": True, "when": {"layout": "prime"}},
    "unit_dependency": {"values": ["sequential", "independent"], "per_layer": True, "when": {"units": [2]}},
}
"""Every family in one tiny supernet: conditional, string and kernel-set choices."""


@pytest.fixture(scope="module")
def sweep(multi30k, tmp_path_factory):
    """A tiny multi-objective sweep (BLEU up, latency down) of the unified space (every family: branches, paths,
    Prime kernels, units, widths) whose two trials are the starting points widest and narrowest, under a parameter
    budget that only the narrowest meets; its supernet trains data-parallel on 2 Ray Train workers
    (``resources.workers: 2``, gloo)."""
    work = tmp_path_factory.mktemp("e2e")
    raw = tiny_spec_dict(multi30k, work, space=UNIFIED_SPACE, **{
        "supernet": {"model_dim": 32, "heads": 2, "encoder_layers": 2, "decoder_layers": 2, "ffn_width": 64,
                     "branches": 2, "paths": 2, "units": 2, "kernels": [3, 5], "max_positions": 128},
        "search": {"trials": 2, "max_concurrent": 2, "beam_size": 2, "latency_sentences": 2, "method": "tpe",
                   "metrics": [{"name": "bleu", "goal": "maximize"}, {"name": "latency_ms", "goal": "minimize"}],
                   "points_to_evaluate": ["widest", "narrowest"]},
        "tracking": {"experiment": "e2e"},
        "resources": {"cpu": 1, "workers": 2},
    })
    bound = round(_params_bound(raw), 6)
    raw["search"]["constraints"] = [f"params_m <= {bound}"]
    env, log = _run_sweep(raw, work)
    return work, env, raw, log


def test_sweep_tracks_parent_supernet_and_trial_runs_in_mlflow(sweep):
    work, env, raw, _ = sweep
    os.environ["MLFLOW_TRACKING_URI"] = env["MLFLOW_TRACKING_URI"]
    try:
        from nas import tracking

        parents = tracking.find_runs("e2e", role="sweep")
        assert len(parents) == 1 and parents[0].info.status == "FINISHED"
        parent = parents[0]
        sweep_id = parent.data.tags["nas.sweep_id"]
        client = tracking.get_client()
        assert "e2e.yaml" in [a.path for a in client.list_artifacts(parent.info.run_id)]
        children = tracking.find_runs("e2e", parent_run_id=parent.info.run_id)
        roles = sorted(r.data.tags["nas.role"] for r in children)
        assert roles == ["supernet", "trial", "trial"]
        supernet = next(r for r in children if r.data.tags["nas.role"] == "supernet")
        assert supernet.info.status == "FINISHED"
        assert {"widest_bleu", "train_loss", "tokens_per_s", "lr"} <= set(supernet.data.metrics)
        for run in (r for r in children if r.data.tags["nas.role"] == "trial"):
            assert run.info.status == "FINISHED" and run.data.tags["nas.sweep_id"] == sweep_id
            assert {"bleu", "chrf", "valid_loss", "params_m", "latency_ms"} <= set(run.data.metrics)
            assert run.data.metrics["latency_ms"] > 0 and 0 < run.data.metrics["params_m"] < 1
            arch = json.loads(Path(client.download_artifacts(run.info.run_id, "arch.json")).read_text())
            assert run.data.params["encoder.layers"] == str(len(arch["encoder"]["width"]))
        (stage,) = tracking.find_runs("e2e", parent_run_id=supernet.info.run_id)  # one training stage
        assert stage.info.run_name == "stage 1 (joint)" and stage.info.status == "FINISHED"
        assert {"loss_widest", "loss_narrowest", "bleu_narrowest", "bleu_middle", "bleu_widest"} <= set(stage.data.metrics)
        assert supernet.data.metrics["stage1_bleu_widest"] == stage.data.metrics["bleu_widest"]
        steps, log_every = raw["train"]["steps"], raw["train"]["log_every"]
        assert [m.step for m in client.get_metric_history(supernet.info.run_id, "loss_widest")] == \
            list(range(log_every, steps + 1, log_every))
        assert (work / "runs" / "tiny" / "supernet" / "supernet.safetensors").is_file()
        assert "pareto.png" in [a.path for a in client.list_artifacts(parent.info.run_id)]
    finally:
        del os.environ["MLFLOW_TRACKING_URI"]


RAY_TRAIN_NOISE = ("TrainController", "PlacementGroupCleaner", "Reporting training result", "TrainingReport(",
                   "core_worker.cc", "Traceback")
"""What Ray Train printed into a sweep with ``resources.workers: 2`` before :mod:`nas.search.ddp` quietened it: its
controller's INFO lines, the placement-group cleaner's warning every second (a traceback with a second Ray on the
host), a line per report of every rank, the preemption watcher's ``core_worker.cc`` error."""


def test_the_sweep_output_is_the_tools_own(sweep):
    """Issue 30: no Ray Tune banners (its configuration table, "Number of trials 9223372036854775807", TensorBoard
    hints, the local cluster's token-authentication warning), no colour codes in a log, and each trial's line whole
    (arch strings are never wrapped). With 2 data-parallel workers: no Ray Train lines (:data:`RAY_TRAIN_NOISE`),
    and each step line of the supernet once (Ray Train's print patch printed each twice)."""
    _, _, raw, log = sweep
    for noise in ("TensorBoard", "Number of trials", "View detailed results", "\x1b[", "Token authentication",
                  *RAY_TRAIN_NOISE):
        assert noise not in log, f"{noise!r} in the sweep's output:\n{log}"
    assert "2 data-parallel workers" in log, log
    steps = [line.split(") ", 1)[-1].split(" loss ")[0] for line in log.splitlines() if " step " in f" {line}"
             and "/" in line and " loss " in line]
    expected = [f"step {n}/{raw['train']['steps']} joint"
                for n in range(raw["train"]["log_every"], raw["train"]["steps"] + 1, raw["train"]["log_every"])]
    assert steps == expected, log
    done = [line for line in log.splitlines() if " done: BLEU" in line]
    assert done and all("enc[" in line and "dec[" in line for line in done), log


def test_optuna_study_in_the_journal_holds_the_completed_trials(sweep):
    import optuna

    work, _, raw, _ = sweep
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(work / "runs" / "tiny" / "optuna.journal")))
    (summary,) = optuna.get_all_study_summaries(storage)
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2
    assert len(study.directions) == 2  # multi-objective: BLEU up, latency down
    assert all("encoder.layers" in t.params for t in study.trials)


def test_starting_points_and_the_params_constraint_reach_optuna_and_mlflow(sweep):
    """points_to_evaluate: trial 0 is the widest, trial 1 the narrowest; the constraint ``params_m <= bound`` is
    set on each Optuna trial as ``params_m - bound`` (trial.set_constraint), so ``study.best_trials`` holds only
    the narrowest; MLflow has ``feasible`` on each trial run and the parent's Pareto plot counts the feasible."""
    import optuna

    from nas.space.space import SearchSpace
    from nas.space import parse_spec

    work, env, raw, _ = sweep
    spec = parse_spec(raw)
    space = SearchSpace.from_spec(spec)
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(work / "runs" / "tiny" / "optuna.journal")))
    (summary,) = optuna.get_all_study_summaries(storage)
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    widest, narrowest = sorted(study.trials, key=lambda t: t.number)
    assert widest.params == space.params_of(space.widest())
    assert narrowest.params == space.params_of(space.narrowest())
    (constraint,) = spec.search.parsed_constraints()
    os.environ["MLFLOW_TRACKING_URI"] = env["MLFLOW_TRACKING_URI"]
    try:
        from nas import tracking

        runs = {int(r.data.tags["nas.optuna_trial"]): r for r in tracking.find_runs("e2e", role="trial")}
        for trial, feasible in ((widest, False), (narrowest, True)):
            params_m = runs[trial.number].data.metrics["params_m"]
            assert trial.constraints == {constraint.key: pytest.approx(params_m - constraint.bound)}
            assert runs[trial.number].data.metrics["feasible"] == float(feasible)
        assert [t.number for t in study.best_trials] == [narrowest.number]
        (parent,) = tracking.find_runs("e2e", role="sweep")
        assert tracking.sweep_constraints(parent) == (constraint,)
        scan = tracking.pareto_scan("e2e", tracking.sweep_objectives(parent), keep_points=True)
        assert [r.run_id for r in scan.front] == [runs[narrowest.number].info.run_id] and scan.infeasible == 1
    finally:
        del os.environ["MLFLOW_TRACKING_URI"]


def test_leaderboard_ranks_trials_and_writes_files(sweep):
    work, env, _, _ = sweep
    proc = nas_cli(["leaderboard", "--experiment", "e2e", "--format", "json", "--out", str(work / "lb.json"),
                    "--include-infeasible"], env, work)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((work / "lb.json").read_text())
    assert len(rows) == 2 and rows[0]["bleu"] >= rows[1]["bleu"]
    assert sorted(r["feasible"] for r in rows) == [False, True]  # the widest breaks the params_m budget
    proc = nas_cli(["leaderboard", "--experiment", "e2e", "--format", "json", "--out", str(work / "lb.json")], env,
                   work)
    assert proc.returncode == 0 and "feasible trials only" in proc.stdout, proc.stderr
    assert [r["feasible"] for r in json.loads((work / "lb.json").read_text())] == [True]
    proc = nas_cli(["leaderboard", "--experiment", "e2e", "--metric", "latency_ms", "--top", "1"], env, work)
    assert proc.returncode == 0 and "latency" in proc.stdout
    proc = nas_cli(["leaderboard", "--experiment", "no-such-experiment"], env, work)
    assert proc.returncode == 2 and "no-such-experiment" in proc.stderr


def test_export_best_then_translate_in_a_fresh_process(sweep, multi30k):
    work, env, _, _ = sweep
    proc = nas_cli(["export", "--best", "--experiment", "e2e", "--out", str(work / "exported")], env, work)
    assert proc.returncode == 0, proc.stderr
    assert "meets its sweep's search.constraints" in proc.stdout  # the narrowest: the widest breaks the budget
    source = "\n".join(__import__("nas.data", fromlist=["read_lines"]).read_lines(
        multi30k / "test_2016_flickr.en.gz", limit=5)) + "\n"
    clean_env = {k: v for k, v in env.items() if k != "MLFLOW_TRACKING_URI"}
    code = ("import sys; from nas.cli import app; app(['translate', sys.argv[1]], standalone_mode=False)\n"
            "assert not {'ray', 'mlflow', 'nas.search'} & set(sys.modules), 'translate must not load the sweep stack'")
    proc = subprocess.run([sys.executable, "-c", code, str(work / "exported")], input=source, capture_output=True,
                          text=True, env=clean_env, cwd=work, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 5


def test_unified_archs_reach_the_trials_and_the_arch_files(sweep):
    """The unified space's choices (layouts, units, branches, paths, kernels) reach the trials: the arch.json of each
    trial run is the arch its Optuna parameters describe, and the two differ in the families."""
    import optuna

    from nas.space import parse_spec
    from nas.space.arch import Arch
    from nas.space.space import SearchSpace

    work, env, raw, _ = sweep
    space = SearchSpace.from_spec(parse_spec(raw))
    archs = [Arch.from_json(f.read_text()) for f in (work / "mlruns").rglob("arch.json")]
    assert len(archs) == 2
    assert sorted(a.arch_id for a in archs) == sorted(a.arch_id for a in (space.widest(), space.narrowest()))
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(work / "runs" / "tiny" / "optuna.journal")))
    (summary,) = optuna.get_all_study_summaries(storage)
    params = [t.params for t in optuna.load_study(study_name=summary.study_name, storage=storage).trials]
    families = {k.split(".")[1] for p in params for k in p if k.count(".") == 2}  # e.g. encoder.layout.0
    assert {"layout", "units", "branches", "paths", "width"} <= families, params  # the families are Optuna parameters


def test_latency_fit_on_the_trained_supernet_reports_holdout_error(sweep):
    work, env, _, _ = sweep
    proc = _nas(["latency", "fit", str(work / "e2e.yaml"), "--samples", "10", "--threads", "1",
                 "--out", str(work / "lat.safetensors")], env, work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MAPE" in proc.stdout and "RMSE" in proc.stdout
    from nas.eval.latency import LatencyPredictor
    from nas.space.arch import Arch

    predictor = LatencyPredictor.load(work / "lat.safetensors")
    cv = predictor.metrics["cv_mape"]  # level 1's margin: printed, and kept in the file for the sweep to read
    assert f"5-fold cross-validated MAPE {cv:.1f}%" in " ".join(proc.stdout.split())
    samples = json.loads((work / "lat.samples.json").read_text())
    assert len(samples) >= 8 and all(s["latency_ms"] > 0 and s["latency_ratio"] > 0 for s in samples)
    assert predictor.predict(Arch.from_dict(samples[0]["arch"])) > 0
    assert predictor.predict_ratio(Arch.from_dict(samples[0]["arch"])) > 0
    # the fixed workload of the YAML (beam = search.beam_size), and the reference's time: the median of the samples'
    # interleaved timings of it (each sample timed the reference beside itself)
    assert predictor.workload == {"src_tokens": 30, "tgt_tokens": 30, "beam": 2, "batch": 1}
    assert predictor.reference_ms == statistics.median(s["latency_reference_ms"] for s in samples)


def test_export_onnx_from_the_leaderboard_translates_with_onnxruntime_only(sweep):
    work, env, _, _ = sweep
    proc = nas_cli(["export", "--best", "--experiment", "e2e", "--out", str(work / "onnx_export"), "--onnx"], env,
                   work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "max |logit diff|" in proc.stdout
    assert {"encoder.onnx", "decoder_step.onnx", "translate_onnx.py", "model.safetensors"} <= \
        {p.name for p in (work / "onnx_export").iterdir()}
    script = ("import runpy, sys; folder, path = sys.argv[1:3]; sys.argv = [path, '--dir', folder]; "
              "runpy.run_path(path, run_name='__main__'); "
              "assert not {'torch', 'nas'} & set(sys.modules), 'the ONNX client must not load torch or nas'")
    proc = subprocess.run([sys.executable, "-c", script, str(work / "onnx_export"),
                           str(work / "onnx_export" / "translate_onnx.py")],
                          input="A man is riding a bike .\nTwo dogs play .\n", capture_output=True, text=True,
                          cwd=work, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(proc.stdout.splitlines()) == 2


def test_the_finished_sweep_run_again_starts_nothing_and_shows_its_results(sweep):
    """A finished sweep run again with the same YAML starts no Ray cluster (no new session folder under the
    session's ``RAY_TMPDIR``), adds and changes no MLflow run, and prints its leaderboard and counts."""
    work, env, _, _ = sweep
    ray_root = Path(os.environ["RAY_TMPDIR"]) / "ray"
    sessions = lambda: {p for p in ray_root.glob("session_*") if not p.is_symlink()}  # noqa: E731
    from mlflow import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("e2e").experiment_id
    runs = lambda: sorted((r.info.run_id, r.info.status, r.info.end_time) for r in client.search_runs([experiment]))  # noqa: E731
    before, runs_before = sessions(), runs()
    proc = _nas(["sweep", str(work / "e2e.yaml")], env, work)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "finished before: nothing left to run" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert "trials completed 2, failed 0 (resumed)" in " ".join(proc.stdout.split()), proc.stdout[-3000:]
    assert sessions() == before, "Ray was started"
    assert runs() == runs_before
