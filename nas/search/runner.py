"""A sweep end to end: data -> supernet training trial -> Optuna search trials, tracked in MLflow.

Ray Tune runs both stages. The search stage uses Ray's ``OptunaSearch`` with a
define-by-run space built from the YAML, the sampler named in ``search.method``, and an
Optuna study kept in a journal file under the sweep's folder.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import optuna
import ray
from ray import tune
from ray.tune.search import ConcurrencyLimiter
from ray.tune.search.optuna import OptunaSearch
from rich.console import Console

from nas import tracking
from nas.data import PreparedData, prepare_data
from nas.search.callbacks import MlflowTrialCallback
from nas.search.trials import DefineByRun, SweepContext, score_trial, train_trial
from nas.space.space import SearchSpace
from nas.space.spec import SearchSpec, SpecError, SweepSpec
from trainers import check_fingerprint, supernet_fingerprint

__all__ = ["run_sweep", "prepare_sweep_data", "SweepResult", "make_sampler"]

console = Console(stderr=True)


@dataclass(frozen=True)
class SweepResult:
    sweep_id: str
    parent_run_id: str
    experiment: str
    supernet_dir: Path
    supernet_metrics: dict[str, float]
    trials_completed: int
    trials_failed: int


def make_sampler(search: SearchSpec) -> optuna.samplers.BaseSampler:
    """The Optuna sampler named by ``search.method`` (TPE is multivariate and multi-objective in Optuna 5)."""
    samplers = {
        "tpe": lambda: optuna.samplers.TPESampler(seed=search.seed),
        "nsga2": lambda: optuna.samplers.NSGAIISampler(seed=search.seed),
        "gp": lambda: optuna.samplers.GPSampler(seed=search.seed),
        "random": lambda: optuna.samplers.RandomSampler(seed=search.seed),
    }
    return samplers[search.method]()


def prepare_sweep_data(spec: SweepSpec, progress: bool = True) -> PreparedData:
    """Tokenize the sweep's corpus (cached by content hash under ``data.cache_dir``)."""
    d = spec.data
    return prepare_data(d.train.src, d.train.tgt, d.valid.src, d.valid.tgt, d.tokenizer.vocab_size,
                        Path(d.cache_dir).resolve(),  # absolute: Ray trials run in their own folders
                        max_train_pairs=d.max_train_pairs, max_valid_pairs=d.max_valid_pairs, max_len=d.max_len,
                        seed=spec.train.seed, progress=progress)


def _init_ray(spec: SweepSpec, address: str | None) -> bool:
    """Start (or join) Ray; returns whether we started it. Raises SpecError when resources can't fit."""
    if ray.is_initialized():
        return False
    kwargs = dict(include_dashboard=False, logging_level="WARNING", log_to_driver=True)
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=os.cpu_count(), **kwargs)
    cpus = ray.cluster_resources().get("CPU", 0)
    for key, need in (("resources.cpu", spec.resources.cpu), ("search.cpu_per_trial", spec.search.cpu_per_trial)):
        if need > cpus:
            ray.shutdown()
            raise SpecError(f"{key}={need} but the Ray cluster has {cpus:g} CPUs; lower {key}")
    return True


def _fit(trainable, resources: dict[str, float], tune_config: tune.TuneConfig, name: str, storage: Path,
         callback: MlflowTrialCallback) -> tune.ResultGrid:
    tuner = tune.Tuner(tune.with_resources(trainable, resources), tune_config=tune_config,
                       run_config=tune.RunConfig(name=name, storage_path=str(storage.resolve()), callbacks=[callback],
                                                 verbose=0))
    return tuner.fit()


def run_sweep(spec: SweepSpec, spec_path: str | Path, *, address: str | None = None) -> SweepResult:
    """Run a whole sweep: train (or reuse) the supernet, then ``search.trials`` Optuna trials.

    Raises:
        SpecError: resources that the Ray cluster cannot provide.
        RuntimeError: the supernet trial failed, or every search trial failed (with their errors).
    """
    data = prepare_sweep_data(spec)
    sweep_id = f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = spec.run_dir.resolve()
    supernet_dir = run_dir / "supernet"
    check_fingerprint(supernet_dir, supernet_fingerprint(spec, data))  # before Ray or MLflow start
    started_ray = _init_ray(spec, address)
    experiment = spec.experiment
    tags = {"nas.sweep_id": sweep_id, "nas.sweep_name": spec.name, "nas.supernet_dir": str(supernet_dir),
            "nas.data_dir": str(Path(data.root).resolve()), "nas.beam_size": str(spec.search.beam_size)}
    parent = tracking.start_run(experiment, sweep_id, role="sweep", tags=tags,
                                params={"yaml": str(spec_path), "search.method": spec.search.method,
                                        "search.trials": spec.search.trials})
    tracking.log_file_artifact(parent, spec_path)
    try:
        ctx = SweepContext(spec=spec, data=data, supernet_dir=supernet_dir)
        supernet_metrics = _train_stage(spec, ctx, experiment, parent, tags, sweep_id, run_dir)
        completed, failed = _search_stage(spec, ctx, experiment, parent, tags, sweep_id, run_dir)
        tracking.log_metrics(parent, {**supernet_metrics, "trials_completed": completed, "trials_failed": failed})
        if completed == 0:
            raise RuntimeError(f"all {failed} search trials failed; see the Ray logs under {run_dir / 'ray'}")
        tracking.end_run(parent, "FINISHED")
    except BaseException:
        tracking.end_run(parent, "FAILED")
        raise
    finally:
        if started_ray:
            ray.shutdown()
    return SweepResult(sweep_id, parent, experiment, supernet_dir, supernet_metrics, completed, failed)


def _train_stage(spec: SweepSpec, ctx: SweepContext, experiment: str, parent: str, tags: dict[str, str],
                 sweep_id: str, run_dir: Path) -> dict[str, float]:
    """Train the supernet as one Ray Tune trial unless a finished one is already in ``supernet_dir``."""
    metrics_file = ctx.supernet_dir / "metrics.json"
    params = {"supernet": spec.supernet.model_dump(mode="json"), "train": spec.train.model_dump(mode="json"),
              "space": spec.space.model_dump(mode="json", exclude_none=True)}
    if metrics_file.is_file():
        console.print(f"[green]reusing the trained supernet in {ctx.supernet_dir}[/green]")
        metrics = json.loads(metrics_file.read_text())
        run = tracking.start_run(experiment, "supernet (reused)", role="supernet", parent_run_id=parent,
                                 tags={**tags, "nas.reused": "true"}, params=params)
        tracking.log_metrics(run, metrics)
        tracking.end_run(run)
        return metrics
    console.print(f"[bold]training the supernet[/bold] ({spec.train.steps} steps) -> {ctx.supernet_dir}")
    callback = MlflowTrialCallback(experiment, parent, "supernet", tags, params)
    results = _fit(tune.with_parameters(train_trial, ctx=ctx), {"cpu": spec.resources.cpu, "gpu": spec.resources.gpu},
                   tune.TuneConfig(num_samples=1), f"{sweep_id}-train", run_dir / "ray", callback)
    if results.errors or not metrics_file.is_file():
        raise RuntimeError(f"supernet training failed: {'; '.join(str(e) for e in results.errors)[-2000:]}")
    return json.loads(metrics_file.read_text())


def _search_stage(spec: SweepSpec, ctx: SweepContext, experiment: str, parent: str, tags: dict[str, str],
                  sweep_id: str, run_dir: Path) -> tuple[int, int]:
    """Score ``search.trials`` sub-Transformers sampled by Optuna; returns (completed, failed)."""
    se = spec.search
    names = [m.name for m in se.metrics]
    modes = ["max" if m.goal == "maximize" else "min" for m in se.metrics]
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(run_dir / "optuna.journal")))
    searcher = OptunaSearch(space=DefineByRun(SearchSpace.from_spec(spec)),
                            metric=names if len(names) > 1 else names[0], mode=modes if len(modes) > 1 else modes[0],
                            sampler=make_sampler(se), study_name=sweep_id, storage=storage)
    console.print(f"[bold]searching[/bold]: {se.trials} trials, {se.max_concurrent} at a time, "
                  f"{se.method} on {', '.join(names)}")
    callback = MlflowTrialCallback(experiment, parent, "trial", tags)
    results = _fit(tune.with_parameters(score_trial, ctx=ctx), {"cpu": se.cpu_per_trial},
                   tune.TuneConfig(search_alg=ConcurrencyLimiter(searcher, max_concurrent=se.max_concurrent),
                                   num_samples=se.trials, reuse_actors=True),
                   f"{sweep_id}-search", run_dir / "ray", callback)
    failed = len(results.errors)
    return len(results) - failed, failed
