"""``search.method: evolution``: HAT's two-level search, its Optuna side (no Ray, no MLflow, no torch).

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
  constrained domination) rather than redrawn as in HAT. Unlike HAT, a latency bound is checked on the prediction
  made worse by the predictor's cross-validated error (``search.evolution.latency_margin``,
  :class:`GuardedConstraint`), so the archs kept near the budget are still under it when level 2 measures them.
  Genes have a fixed length, sized for the deepest stack (HAT's encoding): a layer's genes past the chosen depth
  are inert. Candidates are scored ``search.evolution.batch_size`` at a time inside Ray Tune trials (:func:`score_batch`), at most
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

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from nas.space import SweepSpec
from nas.space.space import ORDER, SearchSpace, param_label

__all__ = ["LEVEL1_SUFFIX", "PREDICTED_METRICS", "gene_choices", "suggest_genes", "level1_directions", "nsga2_sampler",
           "GuardedConstraint", "latency_margin", "predicted_constraints", "select_level2", "nondominated_fronts",
           "crowding_distance", "feasible", "tell", "fail", "recover", "front_size"]

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
    (``kernels`` only ``when: {layout: prime}``) are genes everywhere. Single-value choices are no genes, nor are
    the dimensions of a stack that does not choose them (``space.<name>.stacks``, :meth:`SearchSpace.chosen_in`).
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
            if name in space.tie or len(values) < 2 or not space.chosen_in(stack, name):
                continue
            labels = [param_label(v) for v in values]
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


def level1_directions(spec: SweepSpec) -> list[str]:
    """Level 1's objectives: the score (loss minimized, BLEU maximized), then the predicted ``latency_ratio``."""
    score = spec.search.evolution.score
    return ["minimize" if score == "valid_loss" else "maximize", "minimize"]


def nsga2_sampler(spec: SweepSpec, seed_offset: int = 0) -> optuna.samplers.NSGAIISampler:
    ev, seed = spec.search.evolution, spec.search.seed
    return optuna.samplers.NSGAIISampler(population_size=ev.population, mutation_prob=ev.mutation_prob,
                                         crossover_prob=ev.crossover_prob,
                                         seed=None if seed is None else seed + seed_offset)


class GuardedConstraint:
    """A latency constraint checked on a prediction made pessimistic by ``margin`` (a fraction >= 0): an upper bound
    (``<=``, ``<``) on ``value x (1 + margin)``, a lower bound on ``value x (1 - margin)``. Optuna stores it under the
    plain constraint's :attr:`key` (so a study told before a margin existed resumes under the same keys); ``margin``
    0 is the plain :class:`~nas.space.constraints.Constraint`.

    Departs from HAT (Wang et al. 2020, sec. 3.4), which filters on the predicted latency itself: level 1 keeps the
    candidates predicted fastest, so among those near the budget it keeps the under-predicted ones (a winner's
    curse), and level 2 then measures about half of them over the budget."""

    __slots__ = ("constraint", "margin")

    def __init__(self, constraint, margin: float) -> None:
        if not (math.isfinite(margin) and 0.0 <= margin < 1.0):
            raise ValueError(f"latency margin {margin} must be a fraction in [0, 1)")
        self.constraint, self.margin = constraint, float(margin)

    @property
    def metric(self) -> str:
        return self.constraint.metric

    @property
    def key(self) -> str:
        return self.constraint.key

    def violation(self, value: float) -> float:
        """Optuna's constraint value (``<= 0``: holds) of the guarded ``value``, in the metric's units."""
        upper = self.constraint.op in ("<=", "<")
        return self.constraint.violation(value * (1.0 + self.margin if upper else 1.0 - self.margin))

    def __repr__(self) -> str:
        return f"GuardedConstraint({self.key!r}, margin={self.margin:g})"


def latency_margin(spec: SweepSpec, predictor: str | Path | None) -> float:
    """Level 1's latency margin (a fraction): ``search.evolution.latency_margin`` when a number, else (``auto``) the
    ``cv_mape`` (%) that :func:`nas.eval.latency.fit_predictor_file` saved in ``predictor``'s sidecar, over 100, capped
    at 0.5; 0 without a predictor or for a predictor file without it (fitted before the margin existed)."""
    margin = spec.search.evolution.latency_margin
    if margin != "auto":
        return float(margin)
    if predictor is None:
        return 0.0
    try:
        metrics = json.loads(Path(predictor).with_suffix(".json").read_text(encoding="utf-8")).get("metrics", {})
    except (OSError, ValueError):
        return 0.0
    cv = metrics.get("cv_mape")
    return min(0.5, float(cv) / 100.0) if isinstance(cv, (int, float)) and math.isfinite(cv) and cv > 0 else 0.0


def predicted_constraints(spec: SweepSpec, margin: float = 0.0) -> list:
    """The YAML's constraints that level 1 evaluates (on the predictor's ``latency_ms`` and ``latency_ratio``),
    each guarded by ``margin`` (:class:`GuardedConstraint`; :func:`latency_margin` gives the sweep's)."""
    return [GuardedConstraint(c, margin) for c in spec.search.parsed_constraints() if c.metric in PREDICTED_METRICS]


# --------------------------------------------------------------------------- level-2 selection


def feasible(trial: optuna.trial.FrozenTrial) -> bool:
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


# --------------------------------------------------------------------------- telling level 1


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
        fail(study, int(row["number"]), f"non-finite level-1 values {values}")
        return
    study.tell(int(row["number"]), [float(v) for v in values])


def fail(study: optuna.Study, number: int, message: str) -> None:
    trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
    if study._storage.get_trial(trial_id).state in (TrialState.RUNNING, TrialState.WAITING):
        study._storage.set_trial_user_attr(trial_id, "error", message[:2000])
        study.tell(number, state=TrialState.FAIL)


def recover(study: optuna.Study, batch_dir: Path, constraints) -> tuple[int, int]:
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
        fail(study, n, "asked before the driver was killed, never scored")
    return told, len(open_numbers)




def front_size(trials, directions: Sequence[str]) -> int:
    """Size of the first Pareto front of the feasible completed ``trials``."""
    ok = [t for t in trials if feasible(t)]
    sign = [1.0 if d == "minimize" else -1.0 for d in directions]
    fronts = nondominated_fronts([[s * v for s, v in zip(sign, t.values)] for t in ok])
    return len(fronts[0]) if fronts else 0
