"""Builders: a validated spec in, the pieces a recipe needs out (torchtune's ``_model_builders``).

The one place that reads a :class:`~nas.space.SweepSpec` to build

- the supernet (:func:`supernet_config`, :func:`build_supernet`),
- the tokenized corpus (:func:`prepare_sweep_data`),
- the search space (:func:`build_space`),
- the Optuna sampler (:func:`build_sampler`).

The recipes (``trainers/``, ``nas/search/``, the CLI, the benchmarks) call these and never construct
the pieces by hand. Importing this module loads torch (the model) but no Ray, Optuna or MLflow:
Optuna is imported inside :func:`build_sampler` only, so ``nas train``, ``nas latency fit`` and
``nas fidelity`` can build a model or read data without the search stack.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nas.data import EncodersFactory, PreparedData, prepare_data
from nas.model.supernet import SuperTransformer
from nas.space.params import RELATIVE_DEFAULT, relative_positions
from nas.space.space import SearchSpace
from nas.space import SearchSpec, SweepSpec

if TYPE_CHECKING:
    import optuna

__all__ = ["supernet_config", "build_supernet", "prepare_sweep_data", "build_space", "build_sampler",
           "startup_trials", "relative_positions", "RELATIVE_DEFAULT", "space_param_counts"]


def build_space(spec: SweepSpec) -> SearchSpace:
    """The sweep's search space (``space`` section, bounded by ``supernet``)."""
    return SearchSpace.from_spec(spec)


def supernet_config(spec: SweepSpec, vocab_size: int, space: SearchSpace | None = None) -> dict[str, Any]:
    """The sweep's supernet constructor arguments, JSON-ready (what ``SuperTransformer.config()`` returns).

    The maxima are the space's (``SearchSpace.supernet_maxima``), so the supernet's size is the product
    of the YAML's maxima (DESIGN: "the unified layer"). As ``SuperTransformer.config()``, it has
    ``relative_layers`` (the spec's, "units" by default) only with relative positions and ``share_layouts``
    only when False, so the config (and the trainer's fingerprint of it) of a sweep that uses neither is what
    it was before they existed.

    ``space``: the sweep's space when the caller has built it already (:func:`build_space`; a training start
    builds it once and passes it on); default: built here.
    """
    sn = spec.supernet
    maxima = (build_space(spec) if space is None else space).supernet_maxima(spec)
    relative = relative_positions(spec, maxima)
    return dict(vocab_size=vocab_size, model_dim=sn.model_dim, heads=sn.heads, head_dim=sn.head_width,
                max_arch=maxima.to_dict(),
                dropout=sn.dropout, attention_dropout=sn.attention_dropout, drop_branch=spec.drop_branch,
                max_positions=sn.max_positions, pad_id=0, more_features=sn.more_features,
                unit_bias_rate=spec.train.unit_bias_rate, io_projection=spec.io_projection,
                relative_positions=relative, **({"relative_layers": sn.relative_layers} if relative else {}),
                **({} if sn.share_layouts else {"share_layouts": False}))


def build_supernet(spec: SweepSpec, vocab_size: int, space: SearchSpace | None = None) -> SuperTransformer:
    """The supernet of a sweep (freshly initialised): maxima from ``spec.supernet`` and the space (``space``, when
    already built: see :func:`supernet_config`)."""
    return SuperTransformer.from_config(supernet_config(spec, vocab_size, space))


def space_param_counts(spec: SweepSpec, space: SearchSpace | None = None) -> dict[str, int]:
    """Parameters of the supernet and of the largest and smallest sub-Transformers of ``space`` (default
    :func:`build_space`), at the YAML's vocabulary size (``nas space show``)."""
    from nas.model.supernet import count_params, extract

    space = build_space(spec) if space is None else space
    supernet = build_supernet(spec, spec.data.tokenizer.vocab_size)
    return {"supernet": count_params(supernet), "largest sub-net": count_params(extract(supernet, space.widest())),
            "smallest sub-net": count_params(extract(supernet, space.narrowest()))}


def prepare_sweep_data(spec: SweepSpec, progress: bool = True,
                       encoders: EncodersFactory | None = None) -> PreparedData:
    """Tokenize the sweep's corpus (cached by content hash under ``data.cache_dir``); ``encoders``: where the
    shards are encoded (default: this machine's cores; :func:`nas.data.prepare_data`).

    Raises:
        DataError: a data file is missing, unreadable or misaligned (names it).
    """
    d = spec.data
    return prepare_data(d.train.src, d.train.tgt, d.valid.src, d.valid.tgt, d.tokenizer.vocab_size,
                        Path(d.cache_dir).resolve(),  # absolute: Ray trials run in their own folders
                        max_train_pairs=d.max_train_pairs, max_valid_pairs=d.max_valid_pairs, max_len=d.max_len,
                        seed=spec.train.seed, progress=progress, encoders=encoders)


TPE_STARTUP_MAX = 10
"""TPE's and GP's default random start-up (Optuna's ``n_startup_trials``): the most :func:`startup_trials` gives."""
NSGA2_POPULATION_MAX = 50
"""NSGA-II's default ``population_size``: the most :func:`startup_trials` gives it."""


def startup_trials(search: SearchSpec) -> int:
    """Trials the sampler of ``search.method`` draws before it models anything (TPE and GP's random start-up,
    NSGA-II's first generation, whose size is the population).

    A third of the budget, at most the sampler's Optuna default (10 for TPE and GP, 50 for NSGA-II) and at
    least the enqueued ``points_to_evaluate`` (Optuna counts them in the start-up); NSGA-II's population is
    at least 2 (its crossover takes two parents). ``random`` has no start-up: 0.

    Raises:
        ValueError: ``search.method`` is ``evolution``, which is not a per-trial sampler.
    """
    _check_per_trial(search.method)
    cap = {"tpe": TPE_STARTUP_MAX, "gp": TPE_STARTUP_MAX, "nsga2": NSGA2_POPULATION_MAX, "random": 0}[search.method]
    n = max(len(search.points_to_evaluate), min(cap, search.trials // 3))
    return max(2, n) if search.method == "nsga2" else n


def build_sampler(search: SearchSpec, seed_offset: int = 0) -> "optuna.samplers.BaseSampler":
    """The Optuna sampler named by ``search.method`` (TPE is multivariate and multi-objective in Optuna 5),
    with its start-up sized to the budget (:func:`startup_trials`): Optuna's default of 10 random TPE trials
    would leave an 8-trial sweep random from start to end.

    ``seed_offset`` (the number of trials already in the study when a driver resumes it) shifts the seed,
    so that a resumed random or TPE start-up phase does not draw the first trials' archs again.

    Warns (``UserWarning``) when ``search.trials`` cannot leave the start-up, naming both numbers.

    Raises:
        ValueError: ``search.method`` is ``evolution`` (a two-level search with its own NSGA-II study, not a
            sampler of the sweep's trials).
    """
    import optuna  # here, not at the top: building a model or data must not load the search stack

    n_startup = startup_trials(search)
    if search.method != "random" and search.trials <= n_startup:
        what = "population_size (the first generation)" if search.method == "nsga2" else "random start-up trials"
        warnings.warn(f"search.trials={search.trials} <= {n_startup} {what} of search.method={search.method}: "
                      f"every trial is drawn before the sampler models any; raise search.trials above {n_startup} "
                      f"or drop points_to_evaluate ({len(search.points_to_evaluate)})", stacklevel=2)
    seed = None if search.seed is None else search.seed + seed_offset
    samplers = {
        "tpe": lambda: optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup),
        "nsga2": lambda: optuna.samplers.NSGAIISampler(seed=seed, population_size=n_startup),
        "gp": lambda: optuna.samplers.GPSampler(seed=seed, n_startup_trials=n_startup),
        "random": lambda: optuna.samplers.RandomSampler(seed=seed),
    }
    return samplers[search.method]()


def _check_per_trial(method: str) -> None:
    if method == "evolution":
        raise ValueError("search.method=evolution is the two-level search (search.evolution), not a per-trial "
                         "Optuna sampler: build_sampler serves tpe, nsga2, gp and random")
