"""``search.method: evolution``: HAT's two-level search on Ray Tune, Optuna and MLflow.

HAT (Wang et al. 2020, "HAT: Hardware-Aware Transformers", ACL, sec. 3.3-3.4) searches thousands of
SubTransformers with an evolutionary algorithm whose fitness is the inherited-weight validation loss and
whose latency budget is a hard filter on a predictor's latency, then trains the best one. Here:

- **Predictor.** Unless ``search.latency_predictor`` names a file, ``search.evolution.predictor_samples`` archs
  (the widest, the narrowest, then random ones) are timed on the fixed workload (``search.latency_workload``)
  in one Ray Tune trial on the search trials' device, and a :class:`~nas.eval.latency.LatencyPredictor` is
  fitted on them in the driver (``<workdir>/<name>/level1/<sweep id>/predictor.safetensors``; reused when the
  sweep resumes).
- **Level 1.** An Optuna study beside the sweep's (``<sweep id>-level1``, same storage) driven through
  ask/tell by Optuna's NSGA-II sampler (Deb et al. 2002), whose population, mutation and crossover play
  HAT's evolution: objectives are the level-1 score (``search.evolution.score`` on the first
  ``subset_sentences`` validation sentences, inherited weights) and the predicted ``latency_ratio``; the
  YAML's constraints on predicted quantities (``latency_ms``, ``latency_ratio``) are set with
  ``Trial.set_constraint``, so infeasible candidates are dominated by every feasible one (NSGA-II's
  constrained domination) rather than redrawn as in HAT. Genes have a fixed length, sized for the deepest
  stack (HAT's encoding): a layer's genes past the chosen depth are inert. Candidates are scored
  ``search.evolution.batch_size`` at a time inside Ray Tune trials (:func:`score_batch`), at most
  ``search.max_concurrent`` batches at once, so Ray's overhead is paid once a batch.
- **Resume.** Every scored batch is stored (``<optuna number>.json`` under the sweep's ``trials`` folder,
  atomically) before it is reported; a driver that starts again tells Optuna the stored batches that it
  never heard of, fails the candidates that no stored batch holds (asked, never scored), and asks on until
  the study holds ``population x generations`` completed candidates. NSGA-II keeps its generations in the
  study, so the search goes on where it stopped.
- **Level 2.** :func:`select_level2` takes ``search.trials`` candidates of level 1's feasible Pareto front
  (by crowding distance when it is larger, topped up from the next fronts when smaller); the sweep then
  scores them as ordinary trials (beam BLEU, chrF, measured ``latency_ms``; :mod:`nas.search.trials`).
- **Tracking.** Level 1 writes no run per candidate: the sweep's parent run gets one table artifact per
  generation (``level1/generation_NNN.json``) and the metrics ``candidates_evaluated``,
  ``level1_feasible``, ``level1_front_size`` and ``level1_best_score`` (step: the generation).
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState
from ray import tune
from ray.tune.search import Searcher
from rich.console import Console

from nas import faults
from nas.io import atomic_write_text
from nas.search.searcher import StudyRef
from nas.space import SweepSpec
from nas.space.space import INACTIVE, ORDER, SearchSpace, _label

__all__ = ["LEVEL1_SUFFIX", "Level1Result", "gene_choices", "suggest_genes", "level1_ref", "level1_directions",
           "level1_counts", "run_level1", "score_batch", "select_level2", "nondominated_fronts", "crowding_distance"]

console = Console(stderr=True)

LEVEL1_SUFFIX = "-level1"
"""Level 1's study is the sweep's study name plus this suffix, in the same storage."""
ATTR_SCORE = "level1_score"
ATTR_LATENCY = "latency_ms"
ATTR_RATIO = "latency_ratio"
ATTR_ARCH = "arch_summary"
PREDICTED_METRICS = ("latency_ms", "latency_ratio")
"""Constraints level 1 can evaluate (on the predictor's values); the others wait for level 2."""


# --------------------------------------------------------------------------- genes


def gene_choices(space: SearchSpace) -> dict[str, list[Any]]:
    """Every Optuna parameter of ``space`` with its labels, sized for the deepest stack (HAT's fixed-length
    genes): ``encoder.width.2`` exists even where the encoder chooses 2 layers, and conditional choices
    (``kernels`` only ``when: {layout: prime}``) are genes everywhere. Single-value choices are no genes.
    :meth:`SearchSpace.from_params` reads the genes an arch needs and ignores the inert ones."""
    genes: dict[str, list[Any]] = {}
    if len(space.model_widths) > 1:
        genes["model_width"] = list(space.model_widths)
    for stack in ("encoder", "decoder"):
        if len(space.layers[stack]) > 1:
            genes[f"{stack}.layers"] = list(space.layers[stack])
        deepest = max(space.layers[stack])
        for name in ORDER:
            values = space.dims[name]
            if name in space.tie or len(values) < 2:
                continue
            labels = [_label(v) for v in values]
            if space.per_layer[name]:
                for i in range(deepest):
                    genes[f"{stack}.{name}.{i}"] = labels
            else:
                genes[f"{stack}.{name}"] = labels
    return genes


def suggest_genes(space: SearchSpace, trial: optuna.Trial, genes: dict[str, list[Any]] | None = None):
    """Ask ``trial`` for every gene of :func:`gene_choices` (a fixed search space, as NSGA-II's crossover needs)
    and return the arch they encode."""
    genes = gene_choices(space) if genes is None else genes
    params = {name: trial.suggest_categorical(name, labels) for name, labels in genes.items()}
    return space.from_params(params)


# --------------------------------------------------------------------------- study


def level1_ref(ref: StudyRef) -> StudyRef:
    """Level 1's study: the sweep's study name plus :data:`LEVEL1_SUFFIX`, in the same storage."""
    return StudyRef(study_name=ref.study_name + LEVEL1_SUFFIX, journal=ref.journal, storage_url=ref.storage_url)


def level1_directions(spec: SweepSpec) -> list[str]:
    """Level 1's objectives: the score (loss minimized, BLEU maximized), then the predicted ``latency_ratio``."""
    score = spec.search.evolution.score
    return ["minimize" if score == "valid_loss" else "maximize", "minimize"]


def _sampler(spec: SweepSpec, seed_offset: int = 0) -> optuna.samplers.NSGAIISampler:
    ev, seed = spec.search.evolution, spec.search.seed
    return optuna.samplers.NSGAIISampler(population_size=ev.population, mutation_prob=ev.mutation_prob,
                                         crossover_prob=ev.crossover_prob,
                                         seed=None if seed is None else seed + seed_offset)


def level1_counts(ref: StudyRef) -> dict[str, int]:
    """Level 1's candidates by state (``COMPLETE``, ``FAIL``, ``RUNNING``), empty when it has not started."""
    try:
        study = level1_ref(ref).load()
    except KeyError:
        return {}
    return dict(Counter(t.state.name for t in study.get_trials(deepcopy=False)))


def _constraints(spec: SweepSpec):
    return [c for c in spec.search.parsed_constraints() if c.metric in PREDICTED_METRICS]


# --------------------------------------------------------------------------- Ray Tune: the batches


@dataclass(frozen=True)
class Level1Context:
    """What a level-1 batch needs (small and picklable)."""

    ctx: Any
    """The sweep's :class:`~nas.search.trials.SweepContext`."""
    predictor: Path
    batch_dir: Path
    """Where scored batches are stored (``<first optuna number>.json``)."""


@functools.lru_cache(maxsize=2)
def _validation_set(data_root: str, data, sentences: int):
    from nas.eval.validation import ValidationSet

    return ValidationSet.load(data, sentences)


def _score_one(model, arch, spec: SweepSpec, vset) -> float:
    from nas.eval.validation import validation_scores

    if spec.search.evolution.score == "valid_loss":
        return validation_scores(model, arch, vset, beam_size=None, loss=True,
                                 max_tokens=spec.train.max_tokens)["valid_loss"]
    return validation_scores(model, arch, vset, beam_size=1, loss=False)["bleu"]


def score_batch(config: dict[str, Any], *, l1: Level1Context) -> None:
    """Ray Tune trainable: score a batch of level-1 candidates with inherited weights and the predictor.

    ``config["level1_batch"]`` is a JSON list of ``[optuna number, params]``. Reports ``level1_results``, a
    JSON list of ``{number, score, latency_ms, latency_ratio, arch_summary}``, after storing it as
    ``<first number>.json`` (a batch stored before a kill is reported from its file, not scored again).
    """
    import torch

    from nas.search.trials import load_supernet, predictor_for

    spec = l1.ctx.spec
    batch = json.loads(config["level1_batch"])
    path = l1.batch_dir / f"{int(batch[0][0]):05d}.json"
    if path.is_file():
        tune.report({"level1_results": path.read_text(encoding="utf-8")})
        return
    torch.set_num_threads(max(1, int(spec.search.cpu_per_trial)))
    model = load_supernet(str(l1.ctx.supernet_dir))
    if spec.search.gpu_per_trial > 0 and torch.cuda.is_available():
        model.to("cuda")
    space = SearchSpace.from_spec(spec)
    vset = _validation_set(str(l1.ctx.data.root), l1.ctx.data, spec.search.evolution.subset_sentences)
    predictor = predictor_for(str(l1.predictor))
    archs = [space.from_params(params) for _, params in batch]
    predicted = predictor.predict_many(archs)
    results = []
    for (number, _), arch, ms in zip(batch, archs, predicted):
        score = _score_one(model, arch, spec, vset)
        results.append({"number": int(number), "score": float(score), "latency_ms": float(ms),
                        "latency_ratio": float(ms / predictor.reference_ms), "arch_summary": arch.summary()})
    text = json.dumps(results)
    atomic_write_text(path, text)
    tune.report({"level1_results": text})


class Level1Search(Searcher):
    """Ray Tune searcher that asks level 1's NSGA-II study for batches of candidates and tells it the scores.

    The study is the only state: nothing is pickled that a kill could make stale (see the module docstring).
    """

    def __init__(self, spec: SweepSpec, ref: StudyRef, batch_dir: Path, on_generation=None) -> None:
        super().__init__(metric=None, mode=None)
        self.spec, self.ref, self.batch_dir = spec, ref, batch_dir
        self.space = SearchSpace.from_spec(spec)
        self.genes = gene_choices(self.space)
        ev = spec.search.evolution
        self.total, self.batch_size, self.population = ev.population * ev.generations, ev.batch_size, ev.population
        self.constraints = _constraints(spec)
        self.on_generation = on_generation
        self._study: optuna.Study | None = None
        self._batches: dict[str, list[int]] = {}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_study"], state["on_generation"] = None, None
        return state

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return True

    @property
    def study(self) -> optuna.Study:
        if self._study is None:
            study = self.ref.load(level1_directions(self.spec))
            study.sampler = _sampler(self.spec, seed_offset=len(study.get_trials(deepcopy=False)))
            self._study = study
        return self._study

    def _open(self) -> int:
        return sum(len(v) for v in self._batches.values())

    def suggest(self, trial_id: str) -> dict | str | None:
        if len(self._batches) >= self.spec.search.max_concurrent:
            return None
        trials = self.study.get_trials(deepcopy=False)
        done = sum(t.state == TrialState.COMPLETE for t in trials)
        remaining = self.total - done - self._open()
        if remaining <= 0:
            return Searcher.FINISHED if not self._batches else None
        batch = []
        for _ in range(min(self.batch_size, remaining)):
            trial = self.study.ask()
            arch = suggest_genes(self.space, trial, self.genes)
            trial.set_user_attr(ATTR_ARCH, arch.summary())
            batch.append([trial.number, dict(trial.params)])
        self._batches[trial_id] = [n for n, _ in batch]
        return {"level1_batch": json.dumps(batch)}

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        numbers = self._batches.pop(trial_id, [])
        rows = json.loads(result["level1_results"]) if result and "level1_results" in result else None
        if rows is None:
            for n in numbers:
                _fail(self.study, n, "its level-1 batch failed; see the Ray trial logs")
            return
        for row in rows:
            tell(self.study, row, self.constraints)
        faults.kill_point("level1_batch")  # tests only: a kill after a batch was told
        if self.on_generation is not None:
            self.on_generation(self.study)


def tell(study: optuna.Study, row: dict[str, Any], constraints) -> None:
    """Tell level 1's study one scored candidate (at most once): its constraint violations, then
    ``[score, latency_ratio]``."""
    frozen = study._storage.get_trial(study._storage.get_trial_id_from_study_id_trial_number(
        study._study_id, int(row["number"])))
    if frozen.state not in (TrialState.RUNNING, TrialState.WAITING):
        return
    trial = optuna.trial.Trial(study, frozen._trial_id)
    for key in (ATTR_LATENCY, ATTR_RATIO, ATTR_SCORE):
        trial.set_user_attr(key, float(row["score"] if key == ATTR_SCORE else row[key]))
    for c in constraints:
        trial.set_constraint(c.key, c.violation(float(row[c.metric])))
    values = [row["score"], row["latency_ratio"]]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        _fail(study, int(row["number"]), f"non-finite level-1 values {values}")
        return
    study.tell(int(row["number"]), [float(v) for v in values])


def _fail(study: optuna.Study, number: int, message: str) -> None:
    trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
    if study._storage.get_trial(trial_id).state in (TrialState.RUNNING, TrialState.WAITING):
        study._storage.set_trial_user_attr(trial_id, "error", message[:2000])
        study.tell(number, state=TrialState.FAIL)


def _recover(study: optuna.Study, batch_dir: Path, constraints) -> tuple[int, int]:
    """After a kill: tell the stored batches Optuna never heard of, fail the candidates no batch holds.
    Returns (told, failed)."""
    open_numbers = {t.number for t in study.get_trials(deepcopy=False)
                    if t.state in (TrialState.RUNNING, TrialState.WAITING)}
    if not open_numbers:
        return 0, 0
    told = 0
    for path in sorted(batch_dir.glob("*.json")) if batch_dir.is_dir() else []:
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        for row in rows:
            if row["number"] in open_numbers:
                tell(study, row, constraints)
                open_numbers.discard(row["number"])
                told += 1
    for n in sorted(open_numbers):
        _fail(study, n, "asked before the driver was killed, never scored")
    return told, len(open_numbers)


# --------------------------------------------------------------------------- level-2 selection


def _feasible(trial: optuna.trial.FrozenTrial) -> bool:
    """Every constraint of the trial holds (Optuna: a value <= 0); true without constraints."""
    return all(v <= 0 for v in trial.constraints.values())


def _dominates(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether ``a`` Pareto-dominates ``b`` (every objective minimized)."""
    return all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))


def nondominated_fronts(points: Sequence[Sequence[float]]) -> list[list[int]]:
    """Indices of ``points`` (objectives minimized) by Pareto front: the first front dominates the rest
    (Deb et al. 2002's non-dominated sorting, O(n^2) per front)."""
    left = list(range(len(points)))
    fronts = []
    while left:
        front = [i for i in left if not any(_dominates(points[j], points[i]) for j in left if j != i)]
        fronts.append(front)
        left = [i for i in left if i not in set(front)]
    return fronts


def crowding_distance(points: Sequence[Sequence[float]]) -> list[float]:
    """NSGA-II's crowding distance of each point in one front (Deb et al. 2002, sec. III-B): the ends of
    each objective get infinity, the others the sum over objectives of the normalised gap between their
    neighbours."""
    n = len(points)
    distance = [0.0] * n
    if n == 0:
        return distance
    for m in range(len(points[0])):
        order = sorted(range(n), key=lambda i: (points[i][m], i))
        lo, hi = points[order[0]][m], points[order[-1]][m]
        distance[order[0]] = distance[order[-1]] = math.inf
        if hi == lo:
            continue
        for k in range(1, n - 1):
            distance[order[k]] += (points[order[k + 1]][m] - points[order[k - 1]][m]) / (hi - lo)
    return distance


def select_level2(trials: Sequence[optuna.trial.FrozenTrial], k: int, directions: Sequence[str]
                  ) -> list[optuna.trial.FrozenTrial]:
    """``k`` level-1 candidates for level 2: the feasible first Pareto front, by crowding distance (largest
    first, ties by trial number) when it holds more than ``k``; topped up from the next fronts when it holds
    fewer, then from infeasible candidates by their total violation. Archs that repeat (the same genes
    on the used layers) count once."""
    def feasible(t) -> bool:
        return _feasible(t)

    seen: set[str] = set()
    unique = []
    for t in sorted((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: t.number):
        key = str(t.user_attrs.get(ATTR_ARCH, t.number))
        if key not in seen:
            seen.add(key)
            unique.append(t)
    sign = [1.0 if d == "minimize" else -1.0 for d in directions]
    chosen: list[optuna.trial.FrozenTrial] = []
    ok = [t for t in unique if feasible(t)]
    points = [[s * v for s, v in zip(sign, t.values)] for t in ok]
    for front in nondominated_fronts(points):
        if len(chosen) >= k:
            break
        dist = crowding_distance([points[i] for i in front])
        ranked = sorted(range(len(front)), key=lambda j: (-dist[j], ok[front[j]].number))
        chosen += [ok[front[j]] for j in ranked[: k - len(chosen)]]
    if len(chosen) < k:
        bad = sorted((t for t in unique if not feasible(t)),
                     key=lambda t: (sum(max(v, 0.0) for v in t.constraints.values()), t.number))
        chosen += bad[: k - len(chosen)]
    return chosen


# --------------------------------------------------------------------------- the stage


@dataclass(frozen=True)
class Level1Result:
    counts: dict[str, int]
    """Candidates by Optuna state."""
    chosen: list[dict[str, Any]]
    """Optuna parameters (define-by-run, :meth:`SearchSpace.params_of`) of the archs level 2 scores."""
    wall_s: float
    """Seconds this driver spent in level 1 (predictor included)."""


def _log_generations(spec: SweepSpec, parent: str, logged: set[int]):
    """A callback logging each finished generation's table and metrics to the parent run (once each)."""
    from nas import tracking

    population = spec.search.evolution.population
    key = optuna.samplers.NSGAIISampler._get_generation_key()
    directions = level1_directions(spec)

    def log(study: optuna.Study) -> None:
        trials = study.get_trials(deepcopy=False)
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        by_gen: dict[int, list] = {}
        for t in complete:
            by_gen.setdefault(int(t.system_attrs.get(key, t.number // population)), []).append(t)
        for gen in sorted(by_gen):
            rows = by_gen[gen]
            if gen in logged or (len(rows) < population and len(complete) < spec.search.evolution.population
                                 * spec.search.evolution.generations):
                continue
            logged.add(gen)
            evaluated = sum(len(by_gen[g]) for g in by_gen if g <= gen)
            upto = [t for t in complete if int(t.system_attrs.get(key, 0)) <= gen]
            feasible = [t for t in rows if _feasible(t)]
            best = (min if directions[0] == "minimize" else max)(t.values[0] for t in (feasible or rows))
            table = {"number": [t.number for t in rows], "arch": [t.user_attrs.get(ATTR_ARCH, "") for t in rows],
                     "score": [t.values[0] for t in rows], "latency_ms": [t.user_attrs.get(ATTR_LATENCY) for t in rows],
                     "latency_ratio": [t.values[1] for t in rows],
                     "feasible": [t in feasible for t in rows]}
            try:
                tracking.get_client().log_table(parent, data=table, artifact_file=f"level1/generation_{gen:03d}.json")
                tracking.log_metrics(parent, {"candidates_evaluated": evaluated, "level1_feasible": len(feasible),
                                              "level1_front_size": _front_size(upto, directions),
                                              "level1_best_score": best}, step=gen)
            except Exception as e:  # tracking is best effort here: the study holds every candidate
                console.print(f"[yellow]level 1: generation {gen} not logged to MLflow ({type(e).__name__}: {e})")
            console.print(f"level 1: generation {gen} done ({evaluated} candidates, {len(feasible)} of "
                          f"{len(rows)} feasible, best score {best:.4g})")
    return log


def _front_size(trials, directions) -> int:
    feasible = [t for t in trials if _feasible(t)]
    sign = [1.0 if d == "minimize" else -1.0 for d in directions]
    fronts = nondominated_fronts([[s * v for s, v in zip(sign, t.values)] for t in feasible])
    return len(fronts[0]) if fronts else 0


def run_level1(spec: SweepSpec, ctx, ref: StudyRef, parent: str, sweep_id: str) -> Level1Result:
    """Fit (or reuse) the latency predictor, run level 1 to ``population x generations`` completed candidates
    (resuming a killed one) and choose level 2's archs (:func:`select_level2`).

    Raises:
        SweepFailed: every level-1 candidate failed.
    """
    from nas.search.runner import SweepFailed
    from nas.search.tune import ray_dir

    start = time.monotonic()
    ev = spec.search.evolution
    work = spec.run_dir.resolve() / "level1" / sweep_id
    batch_dir = work / "batches"
    batch_dir.mkdir(parents=True, exist_ok=True)
    predictor = _ensure_predictor(spec, ctx, work, sweep_id)
    l1ref = level1_ref(ref)
    study = l1ref.load(level1_directions(spec))
    told, failed = _recover(study, batch_dir, _constraints(spec))
    if told or failed:
        console.print(f"level 1: resumed ({told} scored candidates told from their files, {failed} lost in the "
                      f"kill marked failed)")
    if not study.get_trials(deepcopy=False):  # the YAML's starting points open the first generation
        space = SearchSpace.from_spec(spec)
        for point in space.point_params(spec.search.points_to_evaluate):
            study.enqueue_trial(point, skip_if_exists=True)
    done = sum(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False))
    console.print(f"[bold]level 1[/bold]: {ev.population} x {ev.generations} candidates ({done} done), "
                  f"{ev.score} on {ev.subset_sentences} validation sentences, NSGA-II, batches of {ev.batch_size}")
    logged: set[int] = set()
    on_generation = _log_generations(spec, parent, logged)
    if done < ev.population * ev.generations:
        searcher = Level1Search(spec, l1ref, batch_dir, on_generation)
        trainable = tune.with_resources(
            tune.with_parameters(score_batch, l1=Level1Context(ctx=ctx, predictor=predictor, batch_dir=batch_dir)),
            {"cpu": spec.search.cpu_per_trial, "gpu": spec.search.gpu_per_trial})
        exp_dir = ray_dir(spec, sweep_id, f"level1-{time.strftime('%Y%m%d-%H%M%S')}")
        from nas.search.tune import run_config

        tuner = tune.Tuner(trainable, tune_config=tune.TuneConfig(search_alg=searcher, num_samples=-1,
                                                                   reuse_actors=True),
                           run_config=run_config(exp_dir, [], spec.search.max_failures))
        tuner.fit()
    study = l1ref.load()
    on_generation(study)
    trials = study.get_trials(deepcopy=False)
    counts = dict(Counter(t.state.name for t in trials))
    if not counts.get("COMPLETE"):
        raise SweepFailed(f"level 1 of sweep {sweep_id}: every candidate failed ({counts}); see "
                          f"{ray_dir(spec, sweep_id, 'level1-*')}")
    space = SearchSpace.from_spec(spec)
    chosen = select_level2(trials, spec.search.trials, level1_directions(spec))
    params = [space.params_of(space.from_params(t.params)) for t in chosen]
    return Level1Result(counts=counts, chosen=params, wall_s=time.monotonic() - start)


def _ensure_predictor(spec: SweepSpec, ctx, work: Path, sweep_id: str) -> Path:
    """The predictor level 1 uses: ``search.latency_predictor``, else one fitted in this sweep (reused)."""
    if spec.search.latency_predictor is not None:
        return Path(spec.search.latency_predictor)
    path = work / "predictor.safetensors"
    if path.is_file() and path.with_suffix(".json").is_file():
        return path
    samples_file = work / "latency_samples.json"
    if not samples_file.is_file():
        from nas.search.tune import ray_dir, run_config

        console.print(f"level 1: timing {spec.search.evolution.predictor_samples} archs on the fixed workload "
                      f"for the latency predictor")
        trainable = tune.with_resources(tune.with_parameters(time_samples, ctx=ctx, out=samples_file),
                                        {"cpu": spec.search.cpu_per_trial, "gpu": spec.search.gpu_per_trial})
        exp_dir = ray_dir(spec, sweep_id, f"latency-{time.strftime('%Y%m%d-%H%M%S')}")
        results = tune.Tuner(trainable, tune_config=tune.TuneConfig(num_samples=1),
                             run_config=run_config(exp_dir, [], spec.search.max_failures)).fit()
        if results.errors or not samples_file.is_file():
            from nas.search.runner import SweepFailed

            raise SweepFailed(f"timing the latency predictor's archs failed: "
                              f"{'; '.join(str(e) for e in results.errors)[-2000:]}")
    from nas.eval.latency import fit_predictor_file

    metrics = fit_predictor_file(json.loads(samples_file.read_text(encoding="utf-8")), spec, path)
    console.print(f"level 1: latency predictor fitted on {metrics.get('train_samples', 0):.0f} archs, held-out "
                  f"MAPE {metrics.get('mape', float('nan')):.1f}%")
    return path


def time_samples(config: dict[str, Any], *, ctx, out: Path) -> None:
    """Ray Tune trainable: time ``search.evolution.predictor_samples`` archs (and the reference) on the fixed
    workload with the supernet's weights, and store the samples as JSON in ``out`` (atomically)."""
    import torch

    from nas.eval.latency import collect_fixed_samples
    from nas.search.trials import load_supernet

    spec = ctx.spec
    torch.set_num_threads(max(1, int(spec.search.cpu_per_trial)))
    model = load_supernet(str(ctx.supernet_dir))
    samples = collect_fixed_samples(model, spec, spec.search.evolution.predictor_samples)
    atomic_write_text(out, json.dumps(samples))
    tune.report({"samples": len(samples["samples"]) if isinstance(samples, dict) else len(samples)})
