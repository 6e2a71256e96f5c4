"""The ASHA fine-tune stage: which trials are chosen (real in-memory Optuna studies with constraints), and one
sweep end to end through real Ray Tune (ASHAScheduler), Optuna and MLflow, run twice."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState, create_trial

from nas.search.finetune import select_candidates
from nas.space import parse_spec
from tests.conftest import nas_env, read_sweep, run_nas, sweep_with_supernet, tiny_spec_dict

LATENCY = "latency_ms<=40"


def _spec(multi30k: Path, tmp_path: Path, metrics: list[tuple[str, str]], top_k: int):
    raw = tiny_spec_dict(multi30k, tmp_path, search={
        "trials": 8, "metrics": [{"name": n, "goal": g} for n, g in metrics], "constraints": ["latency_ms <= 40"],
        "finetune": {"top_k": top_k, "steps": 8, "eval_every": 2}})
    return parse_spec(raw, "test")


def _study(metrics: list[tuple[str, str]], trials: list[tuple[list[float], float | None]]) -> optuna.Study:
    """An in-memory study: each trial COMPLETE with ``values`` and, unless None, constraint ``latency_ms<=40``
    set to ``violation`` (<= 0: feasible); then one FAIL trial."""
    study = optuna.create_study(directions=[g for _, g in metrics])
    for values, violation in trials:
        trial = create_trial(values=values)
        if violation is not None:
            trial.set_constraint(LATENCY, violation)
        study.add_trial(trial)
    study.add_trial(create_trial(state=TrialState.FAIL))
    return study


BLEU_LATENCY = [("bleu", "maximize"), ("latency_ms", "minimize")]
TRIALS = [([20.0, 50.0], 10.0),   # 0: best BLEU but too slow: infeasible
          ([15.0, 30.0], -10.0),  # 1: front
          ([10.0, 10.0], -30.0),  # 2: front
          ([14.0, 35.0], -5.0),   # 3: dominated by 1
          ([12.0, 36.0], -4.0),   # 4: dominated by 1 and 3
          ([5.0, 5.0], -35.0)]    # 5: front


def test_feasible_front_comes_first_by_first_metric_then_best_remaining(multi30k, tmp_path):
    study = _study(BLEU_LATENCY, TRIALS)
    chosen = select_candidates(study, _spec(multi30k, tmp_path, BLEU_LATENCY, top_k=5))
    assert [t.number for t in chosen] == [1, 2, 5, 3, 4]
    assert 0 not in {t.number for t in study.best_trials}  # Optuna leaves the infeasible trial off the front


def test_top_k_cuts_the_front_itself(multi30k, tmp_path):
    study = _study(BLEU_LATENCY, TRIALS)
    assert [t.number for t in select_candidates(study, _spec(multi30k, tmp_path, BLEU_LATENCY, top_k=2))] == [1, 2]
    assert [t.number for t in select_candidates(study, _spec(multi30k, tmp_path, BLEU_LATENCY, top_k=1))] == [1]


def test_a_minimised_first_metric_ranks_lowest_first(multi30k, tmp_path):
    metrics = [("latency_ms", "minimize"), ("bleu", "maximize")]
    study = _study(metrics, [([lat, bleu], v) for (bleu, lat), v in TRIALS])
    chosen = select_candidates(study, _spec(multi30k, tmp_path, metrics, top_k=4))
    assert [t.number for t in chosen] == [5, 2, 1, 3]


def test_single_objective_takes_the_best_feasible_trials(multi30k, tmp_path):
    metrics = [("valid_loss", "minimize")]
    study = _study(metrics, [([3.0], 1.0), ([4.0], -1.0), ([3.5], None), ([5.0], -2.0)])
    chosen = select_candidates(study, _spec(multi30k, tmp_path, metrics, top_k=2))
    assert [t.number for t in chosen] == [2, 1]  # trial 2 set no constraint: feasible


def test_falls_back_to_all_complete_trials_when_none_is_feasible(multi30k, tmp_path, capsys):
    study = _study(BLEU_LATENCY, [([20.0, 50.0], 10.0), ([15.0, 45.0], 5.0), ([10.0, 60.0], 20.0),
                                  ([12.0, 48.0], 8.0)])
    assert study.best_trials == []
    chosen = select_candidates(study, _spec(multi30k, tmp_path, BLEU_LATENCY, top_k=3))
    assert [t.number for t in chosen] == [0, 1, 3]  # the front of all (0, 1), then the best remaining by BLEU
    assert "none of the 4 complete trials satisfies search.constraints" in capsys.readouterr().err


def test_no_complete_trial_gives_no_candidate(multi30k, tmp_path):
    assert select_candidates(_study(BLEU_LATENCY, []), _spec(multi30k, tmp_path, BLEU_LATENCY, top_k=3)) == []


def test_a_stored_result_is_replayed_and_one_of_another_sweep_is_not(multi30k, tmp_path, monkeypatch):
    import dataclasses

    from ray import tune

    import nas.search.finetune as finetune
    from nas.atomic import atomic_write_text
    from nas.search.searcher import OPTUNA_TRIAL_KEY
    from nas.search.trials import SweepContext
    from nas.space.space import SearchSpace

    spec = _spec(multi30k, tmp_path, [("bleu", "maximize")], top_k=1)
    space = SearchSpace.from_spec(spec)
    arch = space.widest()
    config = {OPTUNA_TRIAL_KEY: 7, finetune.ARCH_KEY: space.params_of(arch)}
    ctx = SweepContext(spec=spec, data=None, supernet_dir=tmp_path / "supernet", results_dir=tmp_path / "trials" / "s1")
    result = {"valid_loss": 4.5, "step": 8, "bleu": 3.0, "inherited_valid_loss": 5.0, finetune.DONE_KEY: True}
    atomic_write_text(finetune.finetune_dir(spec) / "00007.json",
                      json.dumps({"settings": finetune._settings(ctx, arch), "history": [], "result": result}))
    reports: list[dict] = []
    monkeypatch.setattr(tune, "report", reports.append)

    def load_supernet(directory: str):
        raise LookupError(f"would train: loads {directory}")

    monkeypatch.setattr(finetune, "load_supernet", load_supernet)
    finetune.finetune_trial(config, ctx=ctx)
    assert reports == [result]
    with pytest.raises(LookupError, match="would train"):  # a file another sweep in this folder left
        finetune.finetune_trial(config, ctx=dataclasses.replace(ctx, results_dir=tmp_path / "trials" / "s2"))
    with pytest.raises(LookupError, match="would train"):  # other fine-tune settings
        changed = spec.model_copy(update={"search": spec.search.model_copy(update={
            "finetune": spec.search.finetune.model_copy(update={"steps": 16})})})
        finetune.finetune_trial(config, ctx=dataclasses.replace(ctx, spec=changed))
    assert len(reports) == 1


# --------------------------------------------------------------------------- end to end


def _asha_stops(histories: list[list[float]], grace: int, rf: int, max_t: int) -> list[int | None]:
    """Ray's ASHA (one bracket) replayed on trials run one at a time: for each, the evaluation at which it is
    stopped below max_t, or None. ``histories``: each trial's validation losses, one per evaluation."""
    import numpy as np

    rungs = [grace * rf**k for k in range(100) if grace * rf**k < max_t]
    recorded: dict[int, list[float]] = {r: [] for r in rungs}
    stops: list[int | None] = []
    for losses in histories:
        stop = None
        for it, loss in enumerate(losses[:max_t], start=1):
            if it >= max_t:
                break
            reward = -loss
            for rung in sorted(rungs, reverse=True):  # the highest rung reached and not yet recorded
                if it == rung:
                    before = recorded[rung]
                    if before and reward < np.nanpercentile(before, (1 - 1 / rf) * 100):
                        stop = it
                    before.append(reward)
                    break
            if stop is not None:
                break
        stops.append(stop)
    return stops


@pytest.mark.slow
def test_sweep_fine_tunes_top_k_under_asha_and_a_rerun_replays(multi30k, tmp_path, tiny_supernet):
    import mlflow

    from nas.eval.scores import valid_loss
    from nas.model.io import load_model
    from nas.builders import prepare_sweep_data
    from nas.space.arch import Arch
    from nas.space import load_spec

    steps, every = 8, 2
    raw = tiny_spec_dict(multi30k, tmp_path, **{
        "search": {"trials": 4, "max_concurrent": 1, "beam_size": 2, "latency_sentences": 2, "method": "random",
                   "metrics": [{"name": "valid_loss", "goal": "minimize"}],
                   "finetune": {"top_k": 3, "steps": steps, "eval_every": every, "grace_period": 1,
                                "reduction_factor": 2, "lr": 1e-3, "warmup_steps": 2}},
        "tracking": {"experiment": "finetune"}})
    spec_file = sweep_with_supernet(raw, tmp_path, tiny_supernet)
    env = nas_env(tmp_path)
    proc = run_nas(["sweep", str(spec_file)], env, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    records = read_sweep(spec_file, env)
    client = mlflow.MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])

    # the three trials with the lowest inherited valid loss, in that order, each with one FINISHED run
    complete = sorted((t for t in records.optuna if t.state == TrialState.COMPLETE), key=lambda t: (t.values[0], t.number))
    expected = [t.number for t in complete[:3]]
    (parent,) = records.roles("sweep")
    runs = sorted(records.roles("finetune"), key=lambda r: r.info.start_time)
    assert [int(r.data.tags["nas.optuna_trial"]) for r in runs] == expected
    assert all(r.info.status == "FINISHED" and r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in runs)

    # ASHA's decisions are exactly those its rule gives on the reported losses (trials ran one at a time)
    histories = [[m.value for m in sorted(client.get_metric_history(r.info.run_id, "valid_loss"), key=lambda m: m.step)]
                 for r in runs]
    stops = _asha_stops(histories, grace=1, rf=2, max_t=steps // every)
    assert stops[0] is None  # the first has no one to lose against
    assert any(s is not None for s in stops), f"ASHA stopped none: {histories}"
    for run, history, stop in zip(runs, histories, stops):
        tag = run.data.tags.get("nas.finetune_stopped")
        if stop is None:
            assert tag is None and len(history) == steps // every and "bleu" in run.data.metrics
        else:
            assert tag == str(stop * every) and len(history) == stop and "bleu" not in run.data.metrics
    summary = json.loads(Path(client.download_artifacts(parent.info.run_id, "finetune.json", str(tmp_path))).read_text())
    assert [r["optuna_trial"] for r in summary] == expected
    assert [r["stopped_at_step"] for r in summary] == [None if s is None else s * every for s in stops]
    assert parent.data.metrics["finetune_completed"] + parent.data.metrics["finetune_stopped"] == 3

    # the saved weights are the reported ones; fine-tuning lowered the validation loss of every full-length trial
    spec = load_spec(spec_file, check_files=False)
    data = prepare_sweep_data(spec, progress=False)
    src, tgt = data.load_split("valid")
    run_dir = tmp_path / "runs" / "tiny"
    trial_runs = {int(r.data.tags["nas.optuna_trial"]): r for r in records.trial_runs()}
    for run, stop in zip(runs, stops):
        number = int(run.data.tags["nas.optuna_trial"])
        folder = run_dir / "finetune" / f"{number:05d}"
        arch = Arch.from_json((folder / "arch.json").read_text())
        loss = valid_loss(load_model(folder), src, tgt, arch, max_tokens=spec.train.max_tokens)
        assert loss == pytest.approx(run.data.metrics["valid_loss"], abs=1e-4)
        assert run.data.metrics["inherited_valid_loss"] == pytest.approx(
            trial_runs[number].data.metrics["valid_loss"], abs=1e-6)
        if stop is None:
            assert loss < run.data.metrics["inherited_valid_loss"] - 1e-3
            assert json.loads((run_dir / "finetune" / f"{number:05d}.json").read_text())["result"]["finetune_done"]
        else:
            assert not (run_dir / "finetune" / f"{number:05d}.json").exists()

    # run again after a kill between the fine-tune stage's end and the sweep's (the parent run left unfinished; a
    # finished sweep would start nothing): the finished stage is restored, nothing is trained, no run is added
    files = sorted(p for p in (run_dir / "finetune").rglob("*") if p.is_file())
    mtimes = {p: p.stat().st_mtime_ns for p in files}
    (parent,) = read_sweep(spec_file, env).roles("sweep")
    from mlflow import MlflowClient

    MlflowClient(env["MLFLOW_TRACKING_URI"]).set_terminated(parent.info.run_id, "KILLED")
    proc = run_nas(["sweep", str(spec_file)], env, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "(restored)" in proc.stderr and "fine-tune " not in proc.stderr.replace("fine-tuned", "")
    assert {p: p.stat().st_mtime_ns for p in files} == mtimes
    again = sorted(read_sweep(spec_file, env).roles("finetune"), key=lambda r: r.info.start_time)
    assert [(r.info.run_id, r.info.status, r.data.tags.get("nas.finetune_stopped")) for r in again] == \
        [(r.info.run_id, r.info.status, r.data.tags.get("nas.finetune_stopped")) for r in runs]
