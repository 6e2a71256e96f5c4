"""The two-level search (``search.method: evolution``): fixed-length genes, level 2's choice from level 1's
front (checked against Optuna's own non-dominated sort and crowding distance), and level 1's generations asked in
full. Level 1 resumed after a kill (the kill point ``NAS_TEST_KILL=level1_batch:2``) and the user's named arch from a
point file are checked on a real sweep in ``tests/search/test_interrupt.py``
(``test_kills_ctrl_c_and_sigterm_stop_the_sweep_in_turn_and_the_same_sweep_resumes_each_time``), whose evolution
sweep is killed in level 1 before its stops in level 2: one sweep, one Ray cluster fewer."""

from __future__ import annotations

import random
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from nas.search.evolution import (crowding_distance, front_size, gene_choices, level1_directions, nondominated_fronts,
                                  select_level2, suggest_genes)
from nas.space import parse_spec
from nas.space.space import SearchSpace
from tests.conftest import tiny_spec_dict

QUICKSTART = Path(__file__).resolve().parents[2] / "search_spaces" / "quickstart.yaml"


def _quickstart_space() -> SearchSpace:
    from nas.space import load_spec

    return SearchSpace.from_spec(load_spec(QUICKSTART, check_files=False))


def test_genes_have_a_fixed_length_and_genes_past_the_depth_are_inert():
    space = _quickstart_space()
    genes = gene_choices(space)
    # 2 depth genes + 3 per-layer dimensions x 3 layers x 2 stacks, whatever depth a candidate picks
    assert len(genes) == 2 + 3 * 3 * 2
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        trial = study.ask()
        arch = suggest_genes(space, trial, genes)
        assert set(trial.params) == set(genes)  # every gene asked, so NSGA-II sees one fixed search space
        params = dict(trial.params)
        if params["encoder.layers"] == 2:  # flip the third encoder layer's genes: the arch must not change
            for name in ("encoder.width.2", "encoder.ffn_width.2", "encoder.branches.2"):
                params[name] = [v for v in genes[name] if v != params[name]][0]
            assert space.from_params(params) == arch
        assert space.from_params(space.params_of(arch)) == arch  # level 2's define-by-run parameters
        study.tell(trial, 0.0)


def _reference_fronts(points):
    """Optuna's own non-dominated sort (minimization), as lists of indices by rank."""
    import numpy as np
    from optuna.study._multi_objective import _fast_non_domination_rank

    ranks = _fast_non_domination_rank(np.asarray(points, dtype=float))
    return [sorted(int(i) for i in np.flatnonzero(ranks == r)) for r in range(int(ranks.max()) + 1)]


def test_nondominated_fronts_match_optunas_sort():
    rng = random.Random(0)
    for _ in range(20):
        points = [[rng.choice(range(6)), rng.choice(range(6))] for _ in range(25)]
        assert [sorted(f) for f in nondominated_fronts(points)] == _reference_fronts(points)


def _frozen(study, values, violation):
    trial = study.ask()
    trial.suggest_categorical("x", [0])
    trial.set_constraint("latency_ratio<=1", violation)
    trial.set_user_attr("arch_summary", f"arch{trial.number}")
    study.tell(trial, values)


def test_crowding_distance_matches_optuna():
    from optuna.samplers.nsgaii._elite_population_selection_strategy import _calc_crowding_distance

    study = optuna.create_study(directions=["minimize", "minimize"])
    rng = random.Random(1)
    for _ in range(12):  # one front: x + y = 10
        x = rng.uniform(0, 10)
        _frozen(study, [x, 10 - x], 0.0)
    trials = study.get_trials()
    expected = _calc_crowding_distance(trials)
    ours = crowding_distance([t.values for t in trials])
    assert ours == pytest.approx([expected[t.number] for t in trials])


def test_level2_takes_the_feasible_front_by_crowding_then_tops_up():
    study = optuna.create_study(directions=["minimize", "minimize"])
    front = [[1.0, 9.0], [2.0, 7.0], [2.1, 6.9], [5.0, 5.0], [9.0, 1.0]]
    for v in front:
        _frozen(study, v, 0.0)
    _frozen(study, [3.0, 8.0], 0.0)  # second front
    _frozen(study, [0.1, 0.1], 0.5)  # dominates all, but infeasible
    trials = study.get_trials()
    chosen = select_level2(trials, 3, ["minimize", "minimize"])
    # the two ends (infinite distance), then the most isolated inner point of the front
    assert [t.values for t in chosen] == [[1.0, 9.0], [9.0, 1.0], [5.0, 5.0]]
    everything = select_level2(trials, 7, ["minimize", "minimize"])
    assert {tuple(t.values) for t in everything[:5]} == {tuple(v) for v in front}
    assert everything[5].values == [3.0, 8.0] and everything[6].values == [0.1, 0.1]  # next front, then infeasible
    assert front_size(trials, ["minimize", "minimize"]) == 5  # feasible first front only


def test_level2_maximized_score_is_ranked_the_right_way():
    study = optuna.create_study(directions=["maximize", "minimize"])
    for v in ([20.0, 1.0], [25.0, 2.0], [19.0, 1.5]):  # the third is dominated when BLEU is maximized
        _frozen(study, v, 0.0)
    chosen = select_level2(study.get_trials(), 2, ["maximize", "minimize"])
    assert sorted(t.values[0] for t in chosen) == [20.0, 25.0]


def test_level1_directions_follow_the_score():
    raw = tiny_spec_dict(Path("/nonexistent"), Path("/tmp"))
    raw["search"] = {**raw["search"], "method": "evolution", "evolution": {"score": "greedy_bleu"}}
    assert level1_directions(parse_spec(raw, "t")) == ["maximize", "minimize"]


def test_level1_asks_no_more_than_a_generation_before_it_completes():
    from types import SimpleNamespace

    from nas.search.level1 import Level1Search

    study = optuna.create_study(directions=["minimize", "minimize"],
                                sampler=optuna.samplers.NSGAIISampler(population_size=4, seed=0))
    room = lambda: Level1Search._room(SimpleNamespace(population=4), study.get_trials(deepcopy=False))  # noqa: E731

    def ask():
        trial = study.ask()
        trial.suggest_categorical("x", [0, 1, 2])
        return trial

    assert room() == 4
    first = [ask() for _ in range(4)]
    assert room() == 0  # generation 0 is asked in full: wait, do not overflow it
    for t in first[:3]:
        study.tell(t, [1.0, 1.0])
    assert room() == 0
    study.tell(first[3], state=TrialState.FAIL)
    assert room() == 1  # a failed candidate leaves room in its generation
    study.tell(ask(), [2.0, 0.5])
    assert room() == 4  # generation 0 complete: the next ask opens generation 1
    ask()
    assert room() == 3
    key = optuna.samplers.NSGAIISampler._get_generation_key()
    assert [t.system_attrs[key] for t in study.get_trials()] == [0, 0, 0, 0, 0, 1]
