"""``build_sampler`` sizes the samplers' start-up to ``search.trials``: Optuna's default of 10 random TPE
trials (enqueued ones included) would leave the quickstart's 8 trials random from start to end."""

from __future__ import annotations

import warnings

import optuna
import pytest

from nas.builders import build_sampler, startup_trials
from nas.space import SearchSpec


def _search(**fields) -> SearchSpec:
    return SearchSpec(**fields)


@pytest.mark.parametrize("trials, points, n_startup", [
    (8, ["narrowest", "middle"], 2), (60, [], 10), (30, [], 10), (9, [], 3), (2, [], 0),
    (12, ["widest", "narrowest", "middle", "widest", "narrowest", "middle"], 6)])
def test_tpe_start_up_is_a_third_of_the_budget_at_most_10_and_at_least_the_points(trials, points, n_startup):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sampler = build_sampler(_search(method="tpe", trials=trials, points_to_evaluate=points))
    assert isinstance(sampler, optuna.samplers.TPESampler)
    assert sampler._n_startup_trials == n_startup


def test_gp_start_up_follows_the_budget_like_tpe():
    sampler = build_sampler(_search(method="gp", trials=8, points_to_evaluate=["middle"]))
    assert sampler._n_startup_trials == 2


@pytest.mark.parametrize("trials, points, population", [
    (8, ["narrowest", "middle"], 2), (9, [], 3), (3, [], 2), (600, [], 50), (90, [], 30)])
def test_nsga2_population_follows_the_budget_and_is_at_least_two(trials, points, population):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sampler = build_sampler(_search(method="nsga2", trials=trials, points_to_evaluate=points))
    assert isinstance(sampler, optuna.samplers.NSGAIISampler)
    assert sampler._population_size == population


@pytest.mark.parametrize("method, trials, points", [
    ("tpe", 2, ["narrowest", "middle"]), ("tpe", 3, ["narrowest", "middle", "widest"]), ("nsga2", 2, []),
    ("gp", 1, ["middle"])])
def test_a_budget_that_cannot_leave_the_start_up_warns_with_both_numbers(method, trials, points):
    n = startup_trials(_search(method=method, trials=trials, points_to_evaluate=points))
    with pytest.warns(UserWarning, match=rf"search\.trials={trials} <= {n} .*raise search\.trials above {n}"):
        build_sampler(_search(method=method, trials=trials, points_to_evaluate=points))


@pytest.mark.parametrize("method", ["tpe", "nsga2", "gp", "random"])
def test_a_budget_past_the_start_up_does_not_warn(method):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_sampler(_search(method=method, trials=8, points_to_evaluate=["narrowest", "middle"]))


def test_evolution_is_not_a_per_trial_sampler():
    with pytest.raises(ValueError, match="method=evolution .*not a per-trial"):
        build_sampler(_search(method="evolution", trials=8))


def test_a_tpe_without_start_up_still_samples_from_its_prior():
    sampler = build_sampler(_search(method="tpe", trials=2, seed=0))  # 2 // 3 = 0 start-up trials
    study = optuna.create_study(sampler=sampler)
    study.optimize(lambda t: (t.suggest_int("x", 0, 20) - 7) ** 2, n_trials=2)
    assert sampler._n_startup_trials == 0 and len(study.trials) == 2
