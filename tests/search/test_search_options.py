"""Search options of the YAML: ``search.constraints`` (Optuna ``trial.set_constraint``), ``points_to_evaluate``
(``study.enqueue_trial``) and the latency source (measured, predicted, both with a drift warning).

The searcher runs on a real Optuna journal study (no Ray needed to call it); the latency options score a real
trained tiny supernet with a real fitted predictor.
"""

from __future__ import annotations

import math
from pathlib import Path

import optuna
import pytest
import torch

from nas.search.searcher import OPTUNA_TRIAL_KEY, DurableOptunaSearch, StudyRef
from nas.search.trials import DefineByRun, feasibility, score_arch
from nas.space.space import SearchSpace
from nas.space import SpecError, parse_constraint, parse_spec
from tests.conftest import tiny_spec_dict

OBJECTIVES = [{"name": "bleu", "goal": "maximize"}, {"name": "latency_ms", "goal": "minimize"}]


def _spec(multi30k: Path, tmp_path: Path, **search):
    return parse_spec(tiny_spec_dict(multi30k, tmp_path, search={"trials": 4, "max_concurrent": 4, "method": "random",
                                                                 "metrics": OBJECTIVES, **search}))


def _searcher(spec, tmp_path: Path) -> DurableOptunaSearch:
    space = SearchSpace.from_spec(spec)
    study = StudyRef("s-1", tmp_path / "optuna.journal")
    searcher = DurableOptunaSearch(DefineByRun(space), study, spec.search,
                                   points=space.point_params(spec.search.points_to_evaluate),
                                   point_names=spec.search.point_names())
    searcher.sync([])
    return searcher


def _result(bleu: float, latency: float) -> dict:
    return {"bleu": bleu, "latency_ms": latency, "chrf": 1.0, "valid_loss": 5.0, "params_m": 0.1}


# ---------------------------------------------------------------- constraints


@pytest.mark.parametrize("expr, value, violation", [
    ("latency_ms <= 40", 35.0, -5.0), ("latency_ms<40", 41.5, 1.5), ("bleu >= 20", 18.0, 2.0), ("bleu>1e1", 12.0, -2.0)])
def test_a_constraint_is_how_far_the_value_is_past_its_bound(expr, value, violation):
    assert parse_constraint(expr).violation(value) == pytest.approx(violation)


@pytest.mark.parametrize("expr", ["params_m <= 1.2345678", "latency_ms < 1234567", "bleu >= 0.1"])
def test_a_constraint_key_keeps_the_exact_bound(expr):
    constraint = parse_constraint(expr)
    assert parse_constraint(constraint.key) == constraint  # the Pareto plot reads the key back


@pytest.mark.parametrize("expr, value, feasible", [
    ("latency_ms < 30", 30.0, False), ("latency_ms <= 30", 30.0, True), ("bleu > 20", 20.0, False),
    ("bleu >= 20", 20.0, True), ("latency_ms < 30", 29.99, True)])
def test_strict_bounds_exclude_the_bound_itself_as_where_filters_do(expr, value, feasible):
    assert (parse_constraint(expr).violation(value) <= 0) is feasible


def test_feasibility_names_the_violated_constraints(multi30k, tmp_path):
    spec = _spec(multi30k, tmp_path, constraints=["latency_ms <= 40", "bleu >= 10"])
    assert feasibility({"latency_ms": 30.0, "bleu": 12.0}, spec) == {"feasible": 1.0}
    assert feasibility({"latency_ms": 50.0, "bleu": 12.0}, spec) == {"feasible": 0.0, "violated": "latency_ms<=40"}
    assert feasibility({"latency_ms": 50.0}, spec) == {"feasible": 0.0, "violated": "latency_ms<=40; bleu>=10"}
    assert feasibility({"latency_ms": 50.0}, _spec(multi30k, tmp_path)) == {}


def test_constraints_are_set_on_the_optuna_trials_and_best_trials_keep_the_feasible(multi30k, tmp_path):
    spec = _spec(multi30k, tmp_path, constraints=["latency_ms <= 40"])
    searcher = _searcher(spec, tmp_path)
    outcomes = {"a": _result(30.0, 50.0), "b": _result(20.0, 30.0), "c": _result(10.0, 20.0)}
    for trial_id in outcomes:
        assert searcher.suggest(trial_id) is not None
    for trial_id, result in outcomes.items():
        searcher.on_trial_complete(trial_id, result)
    study = searcher.study_ref.load()
    trials = sorted(study.trials, key=lambda t: t.number)
    assert [t.constraints for t in trials] == [{"latency_ms<=40": 10.0}, {"latency_ms<=40": -10.0},
                                               {"latency_ms<=40": -20.0}]
    # "a" has the best BLEU but is too slow: the front of the feasible trials is b and c
    assert sorted(t.number for t in study.best_trials) == [1, 2]


def test_a_missing_constraint_metric_makes_the_trial_infeasible(multi30k, tmp_path):
    spec = _spec(multi30k, tmp_path, constraints=["chrf >= 1"])
    searcher = _searcher(spec, tmp_path)
    searcher.suggest("a")
    searcher.on_trial_complete("a", {"bleu": 3.0, "latency_ms": 2.0})
    (trial,) = searcher.study_ref.load().trials
    assert trial.state == optuna.trial.TrialState.COMPLETE and trial.constraints == {"chrf>=1": math.inf}


# ---------------------------------------------------------------- starting points


def test_points_to_evaluate_are_the_first_trials_and_partial_points_are_completed(multi30k, tmp_path):
    spec = _spec(multi30k, tmp_path, points_to_evaluate=["widest", {"encoder.layers": 1, "encoder.width.0": 16}])
    space = SearchSpace.from_spec(spec)
    searcher = _searcher(spec, tmp_path)
    first, second, third = (searcher.suggest(t) for t in ("a", "b", "c"))
    assert first[OPTUNA_TRIAL_KEY] == 0
    assert space.from_params(first) == space.widest()
    assert second["encoder.layers"] == 1 and second["encoder.width.0"] == 16
    assert space.from_params(second).encoder.width == (16,)  # the rest sampled: a valid arch
    assert third[OPTUNA_TRIAL_KEY] == 2
    study = searcher.study_ref.load()
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.RUNNING] * 3


def test_a_point_enqueued_just_before_a_kill_is_asked_once_by_the_next_driver(multi30k, tmp_path):
    spec = _spec(multi30k, tmp_path, points_to_evaluate=["narrowest", "widest"])
    space = SearchSpace.from_spec(spec)
    study = StudyRef("s-1", tmp_path / "optuna.journal").load(["maximize", "minimize"])
    study.enqueue_trial(space.params_of(space.narrowest()))  # the driver died between enqueue and ask
    searcher = _searcher(spec, tmp_path)
    first, second = searcher.suggest("a"), searcher.suggest("b")
    assert (first[OPTUNA_TRIAL_KEY], second[OPTUNA_TRIAL_KEY]) == (0, 1)
    assert space.from_params(first) == space.narrowest() and space.from_params(second) == space.widest()
    assert len(searcher.study_ref.load().trials) == 2


def test_a_named_arch_is_enqueued_with_its_name_which_its_ray_trial_carries_even_after_a_kill(multi30k, tmp_path):
    """The name is the Optuna trial's user attribute from the enqueue on, so a driver killed between the enqueue and
    the Ray trial still gives the next Ray trial the name (config key ``nas_point``, the MLflow tag ``nas.point``)."""
    from nas.search.searcher import ATTR_POINT, POINT_KEY
    from nas.space.arch import Arch

    mine = "enc[32/64 16/64] dec[16/32 32/32]"
    spec = _spec(multi30k, tmp_path, points_to_evaluate=[{"name": "mine", "arch": mine}, "narrowest", mine])
    space = SearchSpace.from_spec(spec)
    first = _searcher(spec, tmp_path).suggest("a")
    assert first[POINT_KEY] == "mine" and space.from_params(first) == Arch.parse(mine)
    study = StudyRef("s-1", tmp_path / "optuna.journal").load()
    study.enqueue_trial(space.params_of(space.narrowest()), user_attrs={ATTR_POINT: "narrowest"})  # then killed
    searcher = _searcher(spec, tmp_path)
    searcher._known["a"] = 0  # the first Ray trial was restored
    second, third, fourth = searcher.suggest("b"), searcher.suggest("c"), searcher.suggest("d")
    assert (second[OPTUNA_TRIAL_KEY], second[POINT_KEY]) == (1, "narrowest")
    assert (third[POINT_KEY], space.from_params(third)) == ("points_to_evaluate.2", Arch.parse(mine))
    assert POINT_KEY not in fourth  # sampled
    assert [t.user_attrs.get(ATTR_POINT) for t in searcher.study_ref.load().trials] == \
        ["mine", "narrowest", "points_to_evaluate.2", None]


@pytest.mark.parametrize("yaml_file", sorted(Path("search_spaces").glob("*.yaml")) or
                         sorted((Path(__file__).parents[2] / "search_spaces").glob("*.yaml")), ids=lambda p: p.name)
def test_reference_points_round_trip_through_optuna_params(yaml_file):
    from nas.space import load_spec

    space = SearchSpace.from_spec(load_spec(yaml_file, check_files=False))
    for arch in (space.widest(), space.narrowest(), space.middle()):
        params = space.params_of(arch)
        assert space.check_params(params) is None
        assert space.from_params(params) == arch


def test_a_one_kernel_point_written_as_a_yaml_int_is_its_label():
    from nas.space import load_spec

    space = SearchSpace.from_spec(load_spec(Path(__file__).parents[2] / "search_spaces" / "prime.yaml", check_files=False))
    name = "encoder.kernels.0"
    single = next(label for label in space._labels(name) if label.isdigit())
    assert space.check_params({name: int(single)}) is None
    assert space.point_params([{name: int(single)}]) == [{name: single}]
    assert "is not one of the choices" in space.check_params({name: 4})


def test_a_searcher_pickled_before_points_and_constraints_existed_still_suggests(multi30k, tmp_path):
    import pickle

    searcher = _searcher(_spec(multi30k, tmp_path), tmp_path)
    state = searcher.__getstate__()
    del state["points"], state["constraints"]  # a tuner.pkl from an older version
    old = DurableOptunaSearch.__new__(DurableOptunaSearch)
    old.__setstate__(pickle.loads(pickle.dumps(state)))
    old.sync([])
    assert OPTUNA_TRIAL_KEY in old.suggest("a")


def test_params_of_an_arch_outside_the_space_names_the_choice(multi30k, tmp_path):
    space = SearchSpace.from_spec(_spec(multi30k, tmp_path))
    raw = tiny_spec_dict(multi30k, tmp_path, space={"width": {"values": [8, 32]}})
    raw["supernet"] = {**raw["supernet"], "head_dim": 8}  # 8-channel widths need 8-channel heads
    other = SearchSpace.from_spec(parse_spec(raw))
    with pytest.raises(ValueError, match=r"encoder.width.0=8 is not one of this space's choices \[16, 32\]"):
        space.params_of(other.narrowest())


# ---------------------------------------------------------------- latency: measured, predicted, drift


@pytest.fixture(scope="module")
def scored(multi30k, tiny_supernet, tmp_path_factory):
    """The tiny supernet, its data, an arch, and a predictor fitted on latencies of minutes (far above the real ones)."""
    from nas.eval.latency import LatencyPredictor, workload_of
    from nas.model.io import load_model
    from nas.builders import prepare_sweep_data

    work = tmp_path_factory.mktemp("latency")
    supernet_dir, cache = tiny_supernet
    raw = tiny_spec_dict(multi30k, work, search={"beam_size": 2, "latency_sentences": 2, "valid_sentences": 4})
    raw["data"]["cache_dir"] = str(cache)
    spec = parse_spec(raw)
    data = prepare_sweep_data(spec, progress=False)
    model = load_model(supernet_dir, "supernet")
    space = SearchSpace.from_spec(spec)
    import random

    rng = random.Random(0)
    archs = [space.widest(), space.narrowest()] + [space.sample(rng) for _ in range(14)]
    workload = workload_of(spec.search)
    # a fake: ratios of 10-30x a reference that takes 100 s (no arch measures so)
    samples = [{"arch": a.to_dict(), "workload": workload, "latency_reference_ms": 1e5,
                "latency_ratio": 10 * (1 + sum(a.encoder.width) / 32)} for a in archs]
    predictor = LatencyPredictor(model.model_dim, workload=workload,
                                 reference_arch=space.narrowest().to_json())  # search.latency_reference: narrowest
    predictor.fit(samples, epochs=200)
    path = predictor.save(work / "latency_b1.safetensors")
    return raw, data, model, space.middle(), path


def test_predicted_latency_is_the_predictor_s_and_nothing_is_timed(scored):
    from nas.eval.latency import LatencyPredictor

    raw, data, model, arch, path = scored
    spec = parse_spec({**raw, "search": {**raw["search"], "latency": "predicted", "latency_predictor": str(path)}})
    metrics = score_arch(model, arch, spec, data)
    predictor = LatencyPredictor.load(path)
    assert metrics["latency_ratio"] == pytest.approx(predictor.predict_ratio(arch)) and metrics["latency_ratio"] > 5
    assert "latency_pred_ms" not in metrics and metrics["latency_ms"] > 5e4  # the fake predictor says minutes
    assert metrics["latency_reference_ms"] == predictor.reference_ms == 1e5  # what its samples measured for it
    assert metrics["latency_ms"] == pytest.approx(metrics["latency_ratio"] * predictor.reference_ms)


def test_measured_latency_with_a_predictor_warns_when_they_differ_by_more_than_20_percent(scored):
    raw, data, model, arch, path = scored
    spec = parse_spec({**raw, "search": {**raw["search"], "latency_predictor": str(path)}})
    with pytest.warns(UserWarning, match=r"latency predictor drift: predicted .* x the reference, measured .* x the "
                                         r"reference"):
        metrics = score_arch(model, arch, spec, data)
    assert 0 < metrics["latency_ms"] < metrics["latency_pred_ms"]
    assert 0 < metrics["latency_ratio"] < metrics["latency_ratio_pred"]
    assert metrics["latency_drift"] == pytest.approx(abs(metrics["latency_ratio_pred"] - metrics["latency_ratio"])
                                                     / metrics["latency_ratio"])
    assert metrics["latency_drift"] > 0.2


def test_a_predictor_for_another_model_dim_is_refused_before_anything_runs(scored, tmp_path):
    import yaml

    from nas.space import SpecError, load_spec

    raw, _, _, _, path = scored
    other = {**raw, "supernet": {**raw["supernet"], "model_dim": 64, "ffn_width": 128, "head_dim": 16},
             "search": {**raw["search"], "latency": "predicted", "latency_predictor": str(path)}}
    file = tmp_path / "other.yaml"
    file.write_text(yaml.safe_dump(other))
    with pytest.raises(SpecError, match=r"search.latency_predictor: .* was fitted for model_dim 32, but "
                                        r"supernet.model_dim is 64"):
        load_spec(file)


def test_a_relative_predictor_path_is_made_absolute_and_only_sweeps_require_it(multi30k, tmp_path, monkeypatch):
    import yaml

    from nas.space import SpecError, load_spec

    monkeypatch.chdir(tmp_path)
    raw = tiny_spec_dict(multi30k, tmp_path, search={"latency": "predicted", "latency_predictor": "pred/b1.safetensors"})
    file = tmp_path / "sweep.yaml"
    file.write_text(yaml.safe_dump(raw))
    spec = load_spec(file, check_predictor=False)  # what `nas latency fit` loads: the file it will write
    assert spec.search.latency_predictor == tmp_path / "pred" / "b1.safetensors"  # Ray trials run elsewhere
    with pytest.raises(SpecError, match=r"search.latency_predictor: file not found: .*b1.safetensors"):
        load_spec(file)


# ---------------------------------------------------------------- the feasible front


def test_the_front_is_taken_over_the_feasible_points_only():
    from nas.tracking.plots import pareto_png
    from nas.tracking import Objective, ParetoScan

    objectives = (Objective("bleu", True), Objective("latency_ms", False))
    points = [(10.0, 20.0), (8.0, 30.0), (5.0, 20.0)]  # the first dominates both others, but breaks the budget
    scan = ParetoScan(rows=[], front=[], scanned=3, points=points, objectives=objectives, feasible=[False, True, True])
    assert scan.front_flags() == [False, True, True]
    unconstrained = ParetoScan(rows=[], front=[], scanned=3, points=points, objectives=objectives,
                               feasible=[True, True, True])
    assert unconstrained.front_flags() == [True, False, False]
    png = pareto_png(points, scan.front_flags(), objectives, feasible=scan.feasible)
    assert png.startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="3 points but 2 feasibility flags"):
        pareto_png(points, scan.front_flags(), objectives, feasible=[True, False])


def test_latency_device_cuda_needs_a_gpu_per_trial():
    from nas.space.schema import SearchSpec

    with pytest.raises(ValueError, match=r"latency_device: cuda needs gpu_per_trial > 0"):
        SearchSpec(latency_device="cuda")
    assert SearchSpec(latency_device="cuda", gpu_per_trial=0.5).latency_device == "cuda"


def test_latency_device_names_where_latency_is_timed_and_refuses_cuda_without_one():
    from nas.errors import NasError
    from nas.eval.latency import latency_device

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 1)
    assert latency_device("trial", gpu) == gpu and latency_device("trial", cpu) == cpu
    assert latency_device("cpu", gpu) == cpu and latency_device("cuda", gpu) == gpu
    with pytest.raises(NasError, match=r"search.latency_device: cuda, but this trial scores on cpu"):
        latency_device("cuda", cpu)


def test_score_arch_times_latency_on_the_named_device(scored, monkeypatch):
    import nas.eval.latency.ratio as ratio

    raw, data, model, arch, _ = scored
    seen = []
    real = ratio.interleaved_timings

    def spy(sub, arch, ref_model, reference, **kw):
        seen.append((next(sub.parameters()).device, next(ref_model.parameters()).device))
        return real(sub, arch, ref_model, reference, **kw)

    monkeypatch.setattr(ratio, "interleaved_timings", spy)
    spec = parse_spec({**raw, "search": {**raw["search"], "latency_device": "cpu", "latency_repeats": 1}})
    assert score_arch(model, arch, spec, data)["latency_ms"] > 0
    assert seen == [(torch.device("cpu"), torch.device("cpu"))]  # the arch and the reference, interleaved


@pytest.mark.slow  # over 5 s on 2 cores: out of the inner loop (pytest -m "not slow")
def test_latency_engine_onnxruntime_times_the_trial_on_the_exported_translator(scored, translator_steps):
    """``search.latency_engine: onnxruntime``: a trial's latency comes from the ONNX translator (its decoder steps are
    counted there), with the runner factory the API hands down; without one the trial says how to start it."""
    from nas.api import latency_runner
    from nas.errors import NasError

    raw, data, model, arch, _ = scored
    spec = parse_spec({**raw, "search": {**raw["search"], "latency_engine": "onnxruntime", "latency_repeats": 2,
                                         "latency_workload": {"src_tokens": 6, "tgt_tokens": 3}}})
    metrics = score_arch(model, arch, spec, data, latency_runner=latency_runner(spec))
    assert metrics["latency_ms"] > 0 and metrics["latency_ratio"] > 0
    assert len(translator_steps) == 3 * (2 * 2 + 2 + 3)  # tgt_tokens x (2 warm-up runs of each, 2 candidate, 3 reference runs)
    with pytest.raises(NasError, match="latency_engine: onnxruntime needs the ONNX engine"):
        score_arch(model, arch, spec, data)
    assert latency_runner(parse_spec(raw)) is None  # torch: PyTorch's own beam search


def test_latency_engine_onnxruntime_on_a_gpu_trial_is_refused_naming_the_fix(multi30k, tmp_path):
    raw = tiny_spec_dict(multi30k, tmp_path, search={"latency_engine": "onnxruntime", "gpu_per_trial": 1})
    with pytest.raises(SpecError, match="latency_engine: onnxruntime times on the CPU.*set latency_device: cpu"):
        parse_spec(raw)
