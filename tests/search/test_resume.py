"""Resume: what a resume refuses, and the searcher's restore rules on a real Optuna journal with real Ray ``Trial``
objects standing for a restored experiment. `nas sweep` SIGKILLed between Optuna's tell and the trial's MLflow
run's end and as an MLflow write starts, then resumed (real Ray Tune, Optuna journal and MLflow SQLite in
subprocesses): in ``tests/search/test_interrupt.py::test_kills_ctrl_c_and_sigterm_stop_the_sweep_in_turn_and_the_same_sweep_resumes_each_time``,
the same sweep's fifth and sixth stops.
"""

from __future__ import annotations

import json

import pytest
import yaml
from optuna.trial import TrialState

from tests.conftest import nas_cli, nas_env, tiny_spec_dict


def test_resume_of_an_unknown_sweep_and_changed_settings_exit_2(multi30k, tmp_path, monkeypatch):
    raw = tiny_spec_dict(multi30k, tmp_path)
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text("# nas sweep tiny.yaml\n" + yaml.safe_dump(raw))
    env = nas_env(tmp_path)
    proc = nas_cli(["sweep", str(spec_file), "--resume", "tiny"], env, tmp_path)
    assert proc.returncode == 2 and "no sweep named 'tiny' to resume" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "runs" / "tiny" / "sweep.json").exists()
    proc = nas_cli(["sweep", "--resume", "nope", "--workdir", "runs"], env, tmp_path)
    assert proc.returncode == 2 and "no sweep named 'nope'" in proc.stderr
    proc = nas_cli(["sweep", "--status", "nope", "--workdir", "runs"], env, tmp_path)
    assert proc.returncode == 2 and "no sweep named 'nope'" in proc.stderr

    from nas.search.runner import _sweep_record, _write_record
    from nas.space import SpecError, load_spec

    monkeypatch.chdir(tmp_path)
    spec = load_spec(spec_file)
    record, resumed = _sweep_record(spec, spec_file, must_exist=False)
    assert not resumed and not (tmp_path / "runs" / "tiny" / "sweep.json").exists()
    _write_record(spec, spec_file, record)
    assert json.loads((tmp_path / "runs" / "tiny" / "sweep.json").read_text())["sweep_id"] == record.sweep_id
    again, resumed = _sweep_record(spec, spec_file, must_exist=True)
    assert resumed and again == record
    raw["search"]["trials"] = 5
    spec_file.write_text(yaml.safe_dump(raw))
    with pytest.raises(SpecError, match=r"search.trials: 2 when the sweep started, now 5"):
        _sweep_record(load_spec(spec_file), spec_file, must_exist=False)


# --------------------------------------------------------------------------- the searcher's restore rules


def _searcher(multi30k, tmp_path, trials=3, max_concurrent=5):
    import pickle

    from nas.search.searcher import DurableOptunaSearch, StudyRef
    from nas.search.trials import DefineByRun
    from nas.space.space import SearchSpace
    from nas.space import parse_spec

    spec = parse_spec(tiny_spec_dict(multi30k, tmp_path, search={"trials": trials, "max_concurrent": max_concurrent,
                                                                  "method": "random"}))
    searcher = DurableOptunaSearch(DefineByRun(SearchSpace.from_spec(spec)),
                                   StudyRef("s", tmp_path / "optuna.journal"), spec.search)
    restart = lambda: pickle.loads(pickle.dumps(searcher))  # noqa: E731 -- what Tuner.restore unpickles from tuner.pkl
    return searcher, restart, SearchSpace.from_spec(spec)


def _ray_trial(trial_id: str, config: dict, status: str, last_result: dict | None = None):
    from ray.tune.experiment import Trial

    trial = Trial("score_trial", config=config, trial_id=trial_id, stub=True)
    if status != Trial.PENDING:
        trial.set_status(status)
    if last_result is not None:
        trial.run_metadata.last_result = last_result
    return trial


def test_searcher_gives_an_orphan_optuna_trial_to_the_next_ray_trial(multi30k, tmp_path):
    searcher, restart, space = _searcher(multi30k, tmp_path)
    with pytest.raises(RuntimeError, match="OptunaSync"):
        searcher.suggest("r0")
    searcher.sync([])
    first, second = searcher.suggest("r0"), searcher.suggest("r1")
    # killed: Ray persisted r0 only; Optuna trial 1 (r1's) has no Ray trial
    resumed = restart()
    resumed.sync([_ray_trial("r0", first, "PENDING")])
    taken = resumed.suggest("r2")
    assert taken == second and taken["optuna_trial"] == 1  # same params, not sampled again
    third = resumed.suggest("r3")
    assert third["optuna_trial"] == 2
    assert resumed.suggest("r4") == "FINISHED"
    assert len(resumed.study.get_trials()) == 3
    space.from_params({k: v for k, v in taken.items() if k != "optuna_trial"})  # a complete arch


def test_searcher_replays_trials_that_finished_after_rays_last_checkpoint(multi30k, tmp_path):
    searcher, restart, _ = _searcher(multi30k, tmp_path, trials=3)
    searcher.sync([])
    first, second = searcher.suggest("r0"), searcher.suggest("r1")
    searcher.on_trial_complete("r0", error=True)
    searcher.fail("r0", "RuntimeError: boom")
    searcher.on_trial_complete("r1", {"bleu": 2.0})
    resumed = restart()
    resumed.sync([])  # killed before Ray's first checkpoint: Ray knows neither trial
    replay_fail, replay_done = resumed.suggest("x0"), resumed.suggest("x1")
    assert replay_fail == {**first, "optuna_finished": "FAIL", "optuna_error": "RuntimeError: boom"}
    assert replay_done == {**second, "optuna_finished": "COMPLETE"}
    resumed.on_trial_complete("x1", {"bleu": 2.0})
    resumed.on_trial_complete("x0", error=True)
    resumed.fail("x0", "RuntimeError: replayed")
    assert resumed.study.get_trials()[0].user_attrs["error"] == "RuntimeError: boom"  # told once, not again
    assert resumed.suggest("x2")["optuna_trial"] == 2 and resumed.suggest("x3") == "FINISHED"


def test_searcher_completes_the_params_of_a_trial_a_kill_cut_short(multi30k, tmp_path):
    searcher, restart, space = _searcher(multi30k, tmp_path, trials=1)
    searcher.sync([])
    trial = searcher.study.ask()
    trial.suggest_categorical("encoder.layers", [1, 2])  # killed inside the define-by-run space
    resumed = restart()
    resumed.sync([])
    config = resumed.suggest("r0")
    assert config["optuna_trial"] == 0 and config["encoder.layers"] == trial.params["encoder.layers"]
    space.from_params({k: v for k, v in config.items() if k != "optuna_trial"})
    assert resumed.suggest("r1") == "FINISHED" and len(resumed.study.get_trials()) == 1


def test_searcher_tells_optuna_once_and_adopts_what_ray_finished_before_the_kill(multi30k, tmp_path):
    from optuna.trial import TrialState

    searcher, restart, _ = _searcher(multi30k, tmp_path, trials=3)
    searcher.sync([])
    configs = [searcher.suggest(f"r{i}") for i in range(3)]
    searcher.on_trial_complete("r0", {"bleu": 1.5})
    searcher.on_trial_complete("r0", {"bleu": 9.0})  # a completion repeated after a restore is ignored
    assert searcher.study.get_trials()[0].values == [1.5]
    # killed before Optuna heard of r1 (completed) and r2 (errored); Ray's restored state knows both
    resumed = restart()
    resumed.sync([_ray_trial("r0", configs[0], "TERMINATED", {"bleu": 1.5}),
                  _ray_trial("r1", configs[1], "TERMINATED", {"bleu": 2.5}), _ray_trial("r2", configs[2], "ERROR")])
    trials = resumed.study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.FAIL]
    assert trials[1].values == [2.5] and "Ray trial logs" in trials[2].user_attrs["error"]  # (no error file here)
    assert resumed.suggest("r3") == "FINISHED"


def test_searcher_records_errors_caps_concurrency_and_fails_non_finite_objectives(multi30k, tmp_path):
    from optuna.trial import TrialState

    searcher, _, _ = _searcher(multi30k, tmp_path, trials=4, max_concurrent=2)
    searcher.sync([])
    searcher.suggest("r0"), searcher.suggest("r1")
    assert searcher.suggest("r2") is None  # 2 live trials: wait
    searcher.on_trial_complete("r0", error=True)
    searcher.fail("r0", "RuntimeError: boom (error.txt)")
    searcher.on_trial_complete("r1", {"bleu": float("nan")})
    searcher.suggest("r2")
    searcher.on_trial_complete("r2", error=True)
    searcher.flush()  # no message came
    trials = searcher.study.get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL] * 3
    assert trials[0].user_attrs["error"] == "RuntimeError: boom (error.txt)"
    assert "bleu=nan" in trials[1].user_attrs["error"] and "Ray trial logs" in trials[2].user_attrs["error"]


def test_ray_state_files_cut_short_by_a_kill_are_set_aside_before_restore(tmp_path):
    import pickle

    from ray import cloudpickle

    from nas.search.tune import restorable

    exp = tmp_path / "sweep-search"
    exp.mkdir()
    (exp / "tuner.pkl").write_bytes(pickle.dumps({"ok": 1}))
    older, newer = "2026-01-01_00-00-00", "2026-01-01_00-10-00"
    (exp / f"experiment_state-{older}.json").write_text('{"trial_data": []}')
    (exp / f"experiment_state-{newer}.json").write_text('{"trial_da')  # the kill cut Ray's copy short
    for session in (older, newer):
        (exp / f"search_gen_state-{session}.json").write_bytes(cloudpickle.dumps({"counter": 1}))
    assert restorable(exp)
    names = sorted(p.name for p in exp.iterdir())
    assert f"experiment_state-{newer}.json.corrupt" in names
    assert f"search_gen_state-{newer}.json.ahead" in names  # it would go with the lost trial list
    assert f"experiment_state-{older}.json" in names and f"search_gen_state-{older}.json" in names

    (exp / f"search_gen_state-{older}.json").write_bytes(b"\x80\x05trunc")
    assert not restorable(exp) and not exp.exists()  # no searcher state: a fresh experiment, set aside
    assert len(list(tmp_path.glob("sweep-search.unrestorable-*"))) == 1

    exp.mkdir()
    (exp / "tuner.pkl").write_bytes(pickle.dumps({"ok": 1})[:5])  # killed while Tuner() wrote it
    assert not restorable(exp)
