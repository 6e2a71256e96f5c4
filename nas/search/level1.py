"""The Ray Tune stage of ``search.method: evolution`` (see :mod:`nas.search.evolution` for the method): the
latency predictor fitted in the sweep, level 1's batches of candidates inside Ray Tune trials, its tracking
in MLflow, its resume after a kill, and level 2's choice of archs."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState
from ray import tune
from ray.tune.search import Searcher
from nas.console import make_console

from nas import faults
from nas.atomic import atomic_write_text
from nas.search.ray_session import quiet_worker_exit
from nas.search.evolution import (ATTR_ARCH, ATTR_LATENCY, LEVEL1_SUFFIX, fail, feasible, front_size, gene_choices,
                                  latency_margin, level1_directions, nsga2_sampler, predicted_constraints, recover,
                                  select_level2, suggest_genes, tell)
from nas.search.failures import SweepFailed
from nas.search.searcher import StudyRef
from nas.search.stop import fit
from nas.search.tune import keep_idle_actors, ray_dir, run_config
from nas.builders import build_space
from nas.space import SearchSpace, SweepSpec

__all__ = ["Level1Result", "level1_ref", "level1_counts", "run_level1", "level2_points", "score_batch", "time_samples",
           "scored_before", "scores_once"]

console = make_console()


def level1_ref(ref: StudyRef) -> StudyRef:
    """Level 1's study: the sweep's study name plus :data:`~nas.search.evolution.LEVEL1_SUFFIX`, same storage."""
    return StudyRef(study_name=ref.study_name + LEVEL1_SUFFIX, journal=ref.journal, storage_url=ref.storage_url)


def level1_counts(ref: StudyRef) -> dict[str, int]:
    """Level 1's candidates by state (``COMPLETE``, ``FAIL``, ``RUNNING``), empty when it has not started."""
    try:
        study = level1_ref(ref).load()
    except KeyError:
        return {}
    return dict(Counter(t.state.name for t in study.get_trials(deepcopy=False)))



@dataclass(frozen=True)
class Level1Context:
    """What a level-1 batch needs (small and picklable)."""

    ctx: Any
    """The sweep's :class:`~nas.search.trials.SweepContext`."""
    predictor: Path
    batch_dir: Path
    """Where scored batches are stored (``<first optuna number>.json``)."""


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
    quiet_worker_exit()  # no "SystemExit" traceback when Ray stops this actor
    import torch

    from nas.search.trials import latency_predictor, load_supernet, validation_set

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
    space = build_space(spec)
    vset = validation_set(l1.ctx.data, spec.search.evolution.subset_sentences)
    predictor = latency_predictor(str(l1.predictor))
    archs = [space.from_params(params) for _, params in batch]
    predicted = predictor.predict_ratio_many(archs)  # the figure a trial measures (interleaved with the reference)
    scores = scores_once(archs, lambda arch: _score_one(model, arch, spec, vset), scored_before(l1.batch_dir))
    results = []
    for (number, _), arch, ratio, score in zip(batch, archs, predicted, scores):
        results.append({"number": int(number), "score": float(score), "latency_ms": float(ratio * predictor.reference_ms),
                        "latency_ratio": float(ratio), "arch_summary": arch.summary(), "arch_id": arch.arch_id})
    text = json.dumps(results)
    atomic_write_text(path, text)
    tune.report({"level1_results": text})


def scored_before(batch_dir: Path) -> dict[str, float]:
    """``arch_id`` -> level-1 score of each candidate in the batches stored in ``batch_dir`` so far (those stored
    with an ``arch_id``); a file being written meanwhile is skipped (written atomically: absent or whole)."""
    known: dict[str, float] = {}
    for path in sorted(batch_dir.glob("*.json")) if batch_dir.is_dir() else []:
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        known.update({row["arch_id"]: float(row["score"]) for row in rows if "arch_id" in row})
    return known


def scores_once(archs: list, score, known: dict[str, float]) -> list[float]:
    """Each arch's level-1 score, ``score(arch)`` only for an arch not in ``known`` (``arch_id`` -> score; updated):
    NSGA-II proposes an arch again in later generations (and within one), and its inherited-weight score on the fixed
    validation subset is the same every time (eval mode, no dropout, same batches), so it is computed once."""
    out = []
    for arch in archs:
        if arch.arch_id not in known:
            known[arch.arch_id] = float(score(arch))
        out.append(known[arch.arch_id])
    return out


class Level1Search(Searcher):
    """Ray Tune searcher that asks level 1's NSGA-II study for batches of candidates and tells it the scores.

    The study is the only state: nothing is pickled that a kill could make stale (see the module docstring).
    """

    def __init__(self, spec: SweepSpec, ref: StudyRef, batch_dir: Path, on_generation=None, margin: float = 0.0
                 ) -> None:
        super().__init__(metric=None, mode=None)
        self.spec, self.ref, self.batch_dir = spec, ref, batch_dir
        self.space = build_space(spec)
        self.genes = gene_choices(self.space)
        ev = spec.search.evolution
        self.total, self.batch_size, self.population = ev.population * ev.generations, ev.batch_size, ev.population
        self.constraints = predicted_constraints(spec, margin)
        self.on_generation = on_generation
        self._study: optuna.Study | None = None
        self._batches: dict[str, list[int]] = {}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_study"], state["on_generation"] = None, None
        return state

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return True

    # The study is the state (a killed level 1 recovers from it and the stored batches): no Ray searcher file.
    def save_to_dir(self, checkpoint_dir: str, session_str: str = "default") -> None:
        pass

    def restore_from_dir(self, checkpoint_dir: str) -> None:
        pass

    def save(self, checkpoint_path: str) -> None:
        pass

    def restore(self, checkpoint_path: str) -> None:
        pass

    @property
    def study(self) -> optuna.Study:
        if self._study is None:
            study = self.ref.load(level1_directions(self.spec))
            study.sampler = nsga2_sampler(self.spec, seed_offset=len(study.get_trials(deepcopy=False)))
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
        room = self._room(trials)
        if room <= 0:
            return None  # this generation is asked in full: its batches finish before the next one's start
        batch = []
        for _ in range(min(self.batch_size, remaining, room)):
            trial = self.study.ask()
            arch = suggest_genes(self.space, trial, self.genes)
            trial.set_user_attr(ATTR_ARCH, arch.summary())
            batch.append([trial.number, dict(trial.params)])
        self._batches[trial_id] = [n for n, _ in batch]
        return {"level1_batch": json.dumps(batch)}

    def _room(self, trials) -> int:
        """Candidates the current NSGA-II generation still takes. Optuna files a trial asked before a generation
        completes into that generation, so asking freely would let ``max_concurrent`` batches overflow it (1,000
        candidates made 7 generations of 100 and 150 instead of 10 of 100); failed candidates leave room."""
        key = optuna.samplers.NSGAIISampler._get_generation_key()
        live = [t for t in trials if t.state in (TrialState.RUNNING, TrialState.COMPLETE) and key in t.system_attrs]
        if not live:
            return self.population
        current = max(int(t.system_attrs[key]) for t in live)
        members = [t for t in live if int(t.system_attrs[key]) == current]
        if sum(t.state == TrialState.COMPLETE for t in members) >= self.population:
            return self.population  # the next ask opens generation current + 1
        return self.population - len(members)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        numbers = self._batches.pop(trial_id, [])
        rows = json.loads(result["level1_results"]) if result and "level1_results" in result else None
        if rows is None:
            for n in numbers:
                fail(self.study, n, "its level-1 batch failed; see the Ray trial logs")
            return
        for row in rows:
            tell(self.study, row, self.constraints)
        faults.kill_point("level1_batch")  # tests only: a kill after a batch was told
        if self.on_generation is not None:
            self.on_generation(self.study)


# --------------------------------------------------------------------------- the stage


@dataclass(frozen=True)
class Level1Result:
    counts: dict[str, int]
    """Candidates by Optuna state."""
    chosen: list[dict[str, Any]]
    """Optuna parameters (define-by-run, :meth:`SearchSpace.params_of`) of the archs level 2 scores: the archs of
    ``search.points_to_evaluate`` first (:meth:`~nas.space.SearchSpec.arch_points`), then level 1's."""
    wall_s: float
    """Seconds this driver spent in level 1 (predictor included)."""
    predictor: Path | None = None
    """The latency predictor level 1 chose with (level 2 reports each trial's predicted ratio beside its own)."""
    names: list[str | None] = field(default_factory=list)
    """Per ``chosen`` entry, the ``points_to_evaluate`` name of a user's arch (the MLflow tag ``nas.point``), None for
    level 1's choices."""


def _logged_generations(parent: str) -> set[int]:
    """The generations whose table the parent run already holds (``level1/generation_NNN.json``)."""
    from nas import tracking

    try:
        names = [Path(a.path).stem for a in tracking.get_client().list_artifacts(parent, "level1")]
    except Exception:  # best effort, as the logging itself: at worst a table is logged again
        return set()
    return {int(n.rsplit("_", 1)[1]) for n in names if n.startswith("generation_") and n.rsplit("_", 1)[1].isdigit()}


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
            ok = [t for t in rows if feasible(t)]
            best = (min if directions[0] == "minimize" else max)(t.values[0] for t in (ok or rows))
            table = {"number": [t.number for t in rows], "arch": [t.user_attrs.get(ATTR_ARCH, "") for t in rows],
                     "score": [t.values[0] for t in rows], "latency_ms": [t.user_attrs.get(ATTR_LATENCY) for t in rows],
                     "latency_ratio": [t.values[1] for t in rows],
                     "feasible": [t in ok for t in rows]}
            try:
                tracking.get_client().log_table(parent, data=table, artifact_file=f"level1/generation_{gen:03d}.json")
                tracking.log_metrics(parent, {"candidates_evaluated": evaluated, "level1_feasible": len(ok),
                                              "level1_front_size": front_size(upto, directions),
                                              "level1_best_score": best}, step=gen)
            except Exception as e:  # tracking is best effort here: the study holds every candidate
                console.print(f"[yellow]level 1: generation {gen} not logged to MLflow ({type(e).__name__}: {e})")
            distinct = len({t.user_attrs.get(ATTR_ARCH, t.number) for t in upto})  # each scored once (scores_once)
            console.print(f"level 1: generation {gen} done ({evaluated} candidates, {distinct} distinct archs, "
                          f"{len(ok)} of {len(rows)} feasible, best score {best:.4g})")
    return log


def run_level1(spec: SweepSpec, ctx, ref: StudyRef, parent: str, sweep_id: str) -> Level1Result:
    """Fit (or reuse) the latency predictor, run level 1 to ``population x generations`` completed candidates
    (resuming a killed one) and choose level 2's archs: the archs of ``search.points_to_evaluate`` (arch strings and
    named archs, scored whatever level 1 finds), then level 1's choice (:func:`select_level2`) up to ``search.trials``
    (:func:`level2_points`).

    Raises:
        SweepFailed: every level-1 candidate failed.
    """
    start = time.monotonic()
    ev = spec.search.evolution
    work = spec.run_dir.resolve() / "level1" / sweep_id
    batch_dir = work / "batches"
    batch_dir.mkdir(parents=True, exist_ok=True)
    predictor = _ensure_predictor(spec, ctx, work, sweep_id)
    margin = latency_margin(spec, predictor)  # from the persisted predictor: the same after a resume
    if predicted_constraints(spec):
        console.print(f"level 1: latency constraints checked on the predicted ratio x {1 + margin:.3f} (margin "
                      f"{100 * margin:.1f}%, search.evolution.latency_margin: {spec.search.evolution.latency_margin})")
        try:
            from nas import tracking
            tracking.log_metrics(parent, {"level1_latency_margin": margin})
        except Exception as e:  # tracking is best effort here, as for the generations
            console.print(f"[yellow]level 1: the latency margin not logged to MLflow ({type(e).__name__}: {e})")
    l1ref = level1_ref(ref)
    study = l1ref.load(level1_directions(spec))
    told, failed = recover(study, batch_dir, predicted_constraints(spec, margin))
    if told or failed:
        console.print(f"level 1: resumed ({told} scored candidates told from their files, {failed} lost in the "
                      f"kill marked failed)")
    if not study.get_trials(deepcopy=False):  # the YAML's starting points open the first generation
        space = build_space(spec)
        for point in space.point_params(spec.search.points_to_evaluate):
            study.enqueue_trial(point, skip_if_exists=True)
    done = sum(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False))
    console.print(f"[bold]level 1[/bold]: {ev.population} x {ev.generations} candidates ({done} done), "
                  f"{ev.score} on {ev.subset_sentences} validation sentences, NSGA-II, batches of {ev.batch_size}")
    logged = _logged_generations(parent)  # a resumed level 1 logs each generation's table once
    on_generation = _log_generations(spec, parent, logged)
    if done < ev.population * ev.generations:
        searcher = Level1Search(spec, l1ref, batch_dir, on_generation, margin)
        trainable = tune.with_resources(
            tune.with_parameters(score_batch, l1=Level1Context(ctx=ctx, predictor=predictor, batch_dir=batch_dir)),
            {"cpu": spec.search.cpu_per_trial, "gpu": spec.search.gpu_per_trial})
        exp_dir = ray_dir(spec, sweep_id, f"level1-{time.strftime('%Y%m%d-%H%M%S')}")
        tuner = tune.Tuner(trainable, tune_config=tune.TuneConfig(search_alg=searcher, num_samples=-1,
                                                                   reuse_actors=True),
                           run_config=run_config(exp_dir, [], spec.search.max_failures))
        with keep_idle_actors(spec.search.max_concurrent):  # a generation's workers wait for the next one
            fit(tuner)
    study = l1ref.load()
    on_generation(study)
    trials = study.get_trials(deepcopy=False)
    counts = dict(Counter(t.state.name for t in trials))
    if not counts.get("COMPLETE"):
        raise SweepFailed(f"level 1 of sweep {sweep_id}: every candidate failed ({counts}); see "
                          f"{ray_dir(spec, sweep_id, 'level1-*')}")
    space = build_space(spec)
    chosen = select_level2(trials, spec.search.trials, level1_directions(spec))
    params, names = level2_points(spec, space, [space.params_of(space.from_params(t.params)) for t in chosen])
    return Level1Result(counts=counts, chosen=params, wall_s=time.monotonic() - start, predictor=predictor,
                        names=names)


def level2_points(spec: SweepSpec, space: SearchSpace, chosen: list[dict[str, Any]]
                  ) -> tuple[list[dict[str, Any]], list[str | None]]:
    """Level 2's points and their names: the archs of ``search.points_to_evaluate`` (:meth:`SearchSpec.arch_points`;
    the user's designs, which level 2 always scores, named), then the archs of ``chosen`` (level 1's, unnamed) that
    are not among them, ``search.trials`` in all."""
    se = spec.search
    mine = se.arch_points()
    points = space.point_params([se.points_to_evaluate[i] for i in mine])
    names: list[str | None] = [se.point_names()[i] for i in mine]
    rest = [p for p in chosen if p not in points][: max(se.trials - len(points), 0)]
    return points + rest, names + [None] * len(rest)


def _ensure_predictor(spec: SweepSpec, ctx, work: Path, sweep_id: str) -> Path:
    """The predictor level 1 uses: ``search.latency_predictor``, else one fitted in this sweep (reused)."""
    if spec.search.latency_predictor is not None:
        return Path(spec.search.latency_predictor)
    path = work / "predictor.safetensors"
    if path.is_file() and path.with_suffix(".json").is_file():
        return path
    samples_file = work / "latency_samples.json"
    if not samples_file.is_file():
        console.print(f"level 1: timing {spec.search.evolution.predictor_samples} archs on the fixed workload "
                      f"for the latency predictor")
        trainable = tune.with_resources(tune.with_parameters(time_samples, ctx=ctx, out=samples_file),
                                        {"cpu": spec.search.cpu_per_trial, "gpu": spec.search.gpu_per_trial})
        exp_dir = ray_dir(spec, sweep_id, f"latency-{time.strftime('%Y%m%d-%H%M%S')}")
        results = fit(tune.Tuner(trainable, tune_config=tune.TuneConfig(num_samples=1),
                                 run_config=run_config(exp_dir, [], spec.search.max_failures)))
        if results.errors or not samples_file.is_file():
            raise SweepFailed(f"timing the latency predictor's archs failed: "
                              f"{'; '.join(str(e) for e in results.errors)[-2000:]}")
    from nas.eval.latency import fit_predictor_file

    metrics = fit_predictor_file(json.loads(samples_file.read_text(encoding="utf-8")), spec, path)
    console.print(f"level 1: latency predictor fitted on {metrics.get('train_samples', 0):.0f} archs, held-out "
                  f"MAPE {metrics.get('mape', float('nan')):.1f}% (of a fit on "
                  f"{metrics.get('heldout_fit_samples', 0):.0f} of them), 5-fold cross-validated MAPE "
                  f"{metrics.get('cv_mape', float('nan')):.1f}% (bias {metrics.get('cv_bias', float('nan')):+.1f}%)")
    return path


def time_samples(config: dict[str, Any], *, ctx, out: Path) -> None:
    """Ray Tune trainable: time ``search.evolution.predictor_samples`` archs (and the reference) on the fixed
    workload with the supernet's weights, and store the samples as JSON in ``out`` (atomically)."""
    quiet_worker_exit()  # no "SystemExit" traceback when Ray stops this actor
    import torch

    from nas.eval.latency import collect_fixed_samples
    from nas.search.trials import load_supernet

    spec = ctx.spec
    torch.set_num_threads(max(1, int(spec.search.cpu_per_trial)))
    model = load_supernet(str(ctx.supernet_dir))
    if spec.search.gpu_per_trial > 0 and torch.cuda.is_available():  # where the trials score, and so time
        model.to("cuda")
    from nas.search.trials import engine_runner

    runner = engine_runner(spec, ctx.latency_runner, ctx.data.spm_model, max(1, int(spec.search.cpu_per_trial)))
    try:
        samples = collect_fixed_samples(model, spec, spec.search.evolution.predictor_samples, space=build_space(spec),
                                        runner=runner)
    finally:
        getattr(runner, "close", lambda: None)()
    atomic_write_text(out, json.dumps(samples))
    tune.report({"samples": len(samples)})
