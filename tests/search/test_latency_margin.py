"""Level 1's latency margin (``search.evolution.latency_margin``): a latency constraint is checked on the predicted
ratio made worse by the predictor's cross-validated error, so the archs level 1 keeps near the budget are still under
it when level 2 measures them. The cross-validated error is checked against a leave-one-out loop written here; the
guard against the constraint's arithmetic on hand-picked numbers; the choice of level 2 on a real Optuna study."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import optuna
import pytest

from nas.eval.latency import LatencyPredictor, cross_validate, fit_predictor_file, workload_of
from nas.search.evolution import (GuardedConstraint, latency_margin, predicted_constraints, select_level2, tell)
from nas.space import SpecError, parse_spec
from nas.space.constraints import parse_constraint
from nas.space.space import SearchSpace
from tests.conftest import tiny_spec_dict


def _spec(constraints=("latency_ratio <= 1.25",), **evolution):
    raw = tiny_spec_dict(Path("/nonexistent"), Path("/tmp"))
    raw["search"] = {**raw["search"], "method": "evolution", "constraints": list(constraints),
                     "evolution": {"predictor_samples": 4, **evolution}}
    return parse_spec(raw, "t")


def _samples(spec, n=12, noise=0.03, seed=0):
    """``n`` archs of the space with a ratio linear in the widths and depth, times ``noise`` relative noise."""
    space = SearchSpace.from_spec(spec)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        arch = space.sample(rng)
        ratio = (1 + 0.01 * sum(arch.encoder.width) + 0.2 * arch.decoder.layers) * (1 + rng.gauss(0.0, noise))
        out.append({"arch": arch.to_dict(), "latency_ratio": ratio, "latency_reference_ms": 10.0,
                    "workload": workload_of(spec.search)})
    return out


def test_cross_validated_error_equals_a_leave_one_out_loop():
    """With as many folds as samples, the fold assignment does not matter: each sample is predicted by a fit on the
    others, which this test does by hand."""
    spec = _spec()
    samples = _samples(spec, n=9)
    workload = workload_of(spec.search)
    rel = []
    for i, held in enumerate(samples):
        fit = LatencyPredictor(spec.supernet.model_dim, workload=workload)
        fit.fit(samples[:i] + samples[i + 1:], holdout=0.0)
        rel.append((fit.predict_ratio(held["arch"]) - held["latency_ratio"]) / held["latency_ratio"])
    cv = cross_validate(LatencyPredictor(spec.supernet.model_dim, workload=workload), samples, folds=len(samples))
    assert cv["cv_samples"] == 9.0
    assert cv["cv_mape"] == pytest.approx(100 * sum(abs(e) for e in rel) / len(rel), rel=1e-6)
    assert cv["cv_bias"] == pytest.approx(100 * sum(rel) / len(rel), rel=1e-6, abs=1e-9)
    assert cv["cv_rmse_rel"] == pytest.approx(100 * math.sqrt(sum(e * e for e in rel) / len(rel)), rel=1e-6)
    # 5 folds score every sample once too: the error is of the same size, not the training error's
    five = cross_validate(LatencyPredictor(spec.supernet.model_dim, workload=workload), samples)
    assert five["cv_samples"] == 9.0 and five["cv_mape"] > 0
    assert cross_validate(LatencyPredictor(spec.supernet.model_dim, workload=workload), samples[:2]) == {}


def test_the_predictor_file_keeps_its_cross_validated_error_and_the_auto_margin_reads_it(tmp_path):
    spec = _spec()
    samples = _samples(spec, n=12)
    path = tmp_path / "latency.safetensors"
    metrics = fit_predictor_file(samples, spec, path)
    expected = cross_validate(LatencyPredictor(spec.supernet.model_dim, workload=workload_of(spec.search)), samples)
    assert {k: metrics[k] for k in expected} == pytest.approx(expected)
    assert LatencyPredictor.load(path).metrics["cv_mape"] == pytest.approx(expected["cv_mape"])
    assert latency_margin(spec, path) == pytest.approx(expected["cv_mape"] / 100)
    assert latency_margin(_spec(latency_margin=0.07), path) == 0.07  # a number wins over the file
    assert latency_margin(_spec(latency_margin=0), path) == 0.0
    assert latency_margin(spec, None) == 0.0
    old = json.loads(path.with_suffix(".json").read_text())  # a predictor fitted before the margin existed
    old["metrics"] = {k: v for k, v in old["metrics"].items() if not k.startswith("cv_")}
    path.with_suffix(".json").write_text(json.dumps(old))
    assert latency_margin(spec, path) == 0.0


def test_a_candidate_predicted_under_the_budget_by_less_than_the_margin_is_infeasible():
    """Budget 1.25: a candidate predicted at 1.20 is feasible on its prediction (HAT's check, and this code's
    before the margin), infeasible with a 10% margin (1.20 x 1.1 = 1.32); one predicted at 1.10 stays feasible
    (1.21). A lower bound is moved the other way."""
    (plain,) = predicted_constraints(_spec())
    assert plain.violation(1.20) == pytest.approx(1.20 - 1.25)  # margin 0: the plain constraint
    (guarded,) = predicted_constraints(_spec(), 0.10)
    assert guarded.key == "latency_ratio<=1.25"  # Optuna's key is the YAML's, margin or not
    assert guarded.violation(1.20) == pytest.approx(1.20 * 1.1 - 1.25) and guarded.violation(1.20) > 0
    assert guarded.violation(1.10) == pytest.approx(1.10 * 1.1 - 1.25) and guarded.violation(1.10) <= 0
    lower = GuardedConstraint(parse_constraint("latency_ms >= 20"), 0.10)
    assert lower.violation(21.0) == pytest.approx(20 - 21.0 * 0.9) and lower.violation(21.0) > 0
    assert lower.violation(23.0) <= 0
    strict = GuardedConstraint(parse_constraint("latency_ratio < 1.1"), 0.10)
    assert strict.violation(1.0) > 0  # 1.0 x 1.1 meets a strict bound exactly: off by the smallest step
    assert predicted_constraints(_spec(["bleu >= 10"]), 0.1) == []  # level 2's constraints are not level 1's
    with pytest.raises(ValueError, match="margin"):
        GuardedConstraint(parse_constraint("latency_ratio <= 1"), 1.0)


def test_level2_skips_the_archs_the_margin_makes_infeasible():
    """On a real Optuna study told through :func:`tell`: with margin 0 the arch predicted at 1.24 is on the feasible
    front and level 2 takes it; with 10% it is infeasible, and level 2 takes the archs predicted well under."""
    def chosen(margin):
        study = optuna.create_study(directions=["minimize", "minimize"])
        constraints = predicted_constraints(_spec(), margin)
        for score, ratio in [(3.0, 1.24), (3.5, 1.05), (4.0, 0.9), (2.5, 1.6)]:
            trial = study.ask()
            trial.suggest_categorical("x", [0])
            tell(study, {"number": trial.number, "score": score, "latency_ratio": ratio,
                         "latency_ms": 10 * ratio}, constraints)
        return [t.values[1] for t in select_level2(study.get_trials(), 2, ["minimize", "minimize"])]

    assert 1.24 in chosen(0.0)
    assert sorted(chosen(0.10)) == [0.9, 1.05]


@pytest.mark.parametrize("margin", [-0.1, 1.0, "half"])
def test_a_bad_margin_names_the_key_and_the_fix(margin):
    with pytest.raises(SpecError, match="latency_margin") as e:
        _spec(latency_margin=margin)
    assert "auto" in str(e.value)
