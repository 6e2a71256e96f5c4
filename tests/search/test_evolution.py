"""The two-level search (``search.method: evolution``): fixed-length genes, level 2's choice from level 1's
front (checked against Optuna's own non-dominated sort and crowding distance), and level 1 resumed after a
kill (real Ray Tune, Optuna journal and MLflow SQLite in subprocesses)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from nas.search.evolution import (crowding_distance, front_size, gene_choices, level1_directions, nondominated_fronts,
                                  select_level2, suggest_genes)
from nas.space import load_spec, parse_spec
from nas.space.space import SearchSpace
from tests.conftest import nas_env, read_sweep, run_nas, sweep_with_supernet, tiny_spec_dict

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


# --------------------------------------------------------------------------- level 1 resumes after a kill

POPULATION, GENERATIONS, BATCH = 4, 2, 2


MINE = "enc[16/32] dec[32/32 16/32]"
"""The user's own arch, named ``mine`` in a point file beside the sweep YAML."""


@pytest.mark.slow
def test_level1_killed_after_a_batch_resumes_to_its_full_budget(multi30k, tmp_path, tiny_supernet):
    """Also the user's named arch from a point file (``{file: baselines.yaml}``): level 1 opens with it, level 2
    scores it as its first trial whatever level 1 finds, tagged ``nas.point`` in MLflow, and the leaderboard names
    it; the resumed sweep reads it from the sweep's saved YAML."""
    (tmp_path / "baselines.yaml").write_text(f'mine: "{MINE}"\n', encoding="utf-8")
    raw = tiny_spec_dict(multi30k, tmp_path, **{
        "search": {"trials": 2, "max_concurrent": 1, "beam_size": 2, "method": "evolution", "seed": 0,
                   "metrics": [{"name": "bleu", "goal": "maximize"}, {"name": "latency_ratio", "goal": "minimize"}],
                   "latency_workload": {"src_tokens": 6, "tgt_tokens": 4}, "latency_repeats": 2,
                   "points_to_evaluate": [{"file": "baselines.yaml"}],
                   "evolution": {"population": POPULATION, "generations": GENERATIONS, "batch_size": BATCH,
                                 "subset_sentences": 6, "predictor_samples": 4}},
        "tracking": {"experiment": "evo"},
    })
    spec_file = sweep_with_supernet(raw, tmp_path, tiny_supernet)
    env = nas_env(tmp_path, NAS_TEST_KILL="level1_batch:2", NAS_TEST_KILL_LOG=str(tmp_path / "kills.log"))
    killed = subprocess.run([sys.executable, "-m", "nas.cli", "sweep", str(spec_file)], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=900, start_new_session=True)
    assert killed.returncode == -9, killed.stdout[-3000:] + killed.stderr[-6000:]
    assert "level1_batch" in (tmp_path / "kills.log").read_text()
    spec = load_spec(spec_file, check_files=False)  # reads the point file, as nas sweep does
    sweep_id = json.loads((spec.run_dir / "sweep.json").read_text())["sweep_id"]
    batches = spec.run_dir / "level1" / sweep_id / "batches"
    stamps = {p.name: p.stat().st_mtime_ns for p in batches.glob("*.json")}
    assert len(stamps) == 2, sorted(stamps)  # two batches scored and told before the kill

    env.pop("NAS_TEST_KILL")
    resumed = run_nas(["sweep", "--resume", "tiny", "--workdir", str(tmp_path / "runs")], env, tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    level1 = optuna.load_study(study_name=sweep_id + "-level1", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(spec.run_dir / "optuna.journal"))))
    states = [t.state for t in level1.get_trials()]
    assert states.count(TrialState.COMPLETE) == POPULATION * GENERATIONS
    for name, stamp in stamps.items():  # scored before the kill: not scored again
        assert (batches / name).stat().st_mtime_ns == stamp
    generations = {t.system_attrs.get("NSGAIISampler:generation") for t in level1.get_trials()
                   if t.state == TrialState.COMPLETE}
    assert generations >= {0, 1}
    after = read_sweep(spec_file, env)
    assert [t.state for t in after.optuna] == [TrialState.COMPLETE] * 2  # level 2: search.trials archs
    level1_archs = {t.user_attrs["arch_summary"] for t in level1.get_trials() if t.state == TrialState.COMPLETE}
    space = SearchSpace.from_spec(spec)
    assert {space.from_params(t.params).summary() for t in after.optuna} <= level1_archs  # chosen from level 1
    (parent,) = after.roles("sweep")
    assert parent.data.metrics["level1_candidates"] == POPULATION * GENERATIONS
    os.environ["MLFLOW_TRACKING_URI"] = env["MLFLOW_TRACKING_URI"]
    from nas import tracking

    artifacts = {a.path for a in tracking.get_client().list_artifacts(parent.info.run_id, "level1")}
    assert {"level1/generation_000.json", "level1/generation_001.json"} <= artifacts
    table = json.loads(Path(tracking.get_client().download_artifacts(parent.info.run_id, "level1/generation_000.json",
                                                                     str(tmp_path))).read_text())
    assert len(table["data"]) == POPULATION, table  # one row per candidate of the generation, logged once
    history = tracking.get_client().get_metric_history(parent.info.run_id, "candidates_evaluated")
    assert max(m.value for m in history) == POPULATION * GENERATIONS
    status = run_nas(["sweep", "--status", "tiny", "--workdir", str(tmp_path / "runs")], env, tmp_path)
    assert f"level 1 COMPLETE {POPULATION * GENERATIONS}" in status.stdout, status.stdout
    # the named point
    first = min(after.optuna, key=lambda t: t.number)
    assert space.from_params(first.params).summary() == MINE and first.user_attrs["point"] == "mine"
    assert space.from_params(min(level1.get_trials(), key=lambda t: t.number).params).summary() == MINE
    tagged = {r.data.tags.get("nas.point"): r.data.tags["nas.arch_summary"] for r in after.trial_runs()}
    assert tagged == {"mine": MINE, None: tagged[None]} and tagged[None] != MINE, tagged
    board = run_nas(["leaderboard", "--experiment", "evo", "--include-infeasible"], {**env, "COLUMNS": "250"},
                    tmp_path)
    assert board.returncode == 0, board.stderr
    assert "point" in board.stdout and "mine" in board.stdout, board.stdout


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
