"""A sweep end to end: data -> supernet training trial -> Optuna search trials, tracked in MLflow.

Ray Tune runs both stages. The search stage uses :class:`~nas.search.searcher.DurableOptunaSearch`
over a define-by-run space built from the YAML, the sampler named in ``search.method``, and an Optuna
study kept in durable storage (a journal file under the sweep's folder, or PostgreSQL).

A sweep is identified by its YAML ``name``: ``<workdir>/<name>/sweep.json`` (written once, atomically,
when the sweep first starts) holds its id, and running ``nas sweep`` again after the driver was killed
continues it: the Optuna study is loaded, the Ray Tune experiments are restored
(``Tuner.restore``), and MLflow runs are reused (runs left RUNNING by the killed driver are ended
as KILLED first, and reopened when their trial runs again). The run folder's lock (:func:`nas.locks.run_lock`,
taken before data is prepared or anything is written) keeps two drivers off one sweep.
"""

from __future__ import annotations

import dataclasses

import json
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import ray
from ray import tune
from nas.console import make_console

from nas.errors import NotFoundError
from nas import faults, tracking
from nas.builders import build_space, prepare_sweep_data
from nas.search.ray_session import cluster_encoders, init_ray
from nas.tracking.plots import log_pareto_plot
from nas.search.callbacks import MlflowTrialCallback
from nas.search.failures import SweepFailed
from nas.search.searcher import ATTR_ERROR, DurableOptunaSearch, OptunaSync, StudyRef, study_trials
from nas.search.trials import DefineByRun, SweepContext, score_trial, train_trial
from nas.space.predictor_file import workload_of, workload_tag
from nas.search.stop import fit, handle_stop_signals
from nas.search.tune import is_uri, ray_dir, make_tuner, run_config
from nas.atomic import atomic_write_text
from nas.locks import run_lock
from nas.redact import redact_url
from nas.space import SpecError, SweepSpec
from trainers import check_fingerprint, supernet_fingerprint

__all__ = ["run_sweep", "SweepResult", "SweepFailed", "SweepRecord", "SweepStatus", "sweep_status", "read_sweep_record", "study_ref", "ray_dir", "results_dir"]

console = make_console()

SWEEP_FILE = "sweep.json"
"""The sweep's identity, under ``<workdir>/<name>/`` (see :class:`SweepRecord`)."""
SPEC_COPY = "sweep.yaml"
"""The YAML as it was when the sweep started (``nas sweep --resume NAME`` reads it)."""
_SETTINGS = ("space", "search", "tracking")
"""Sections a resumed sweep must share with the one that started (the supernet has its own fingerprint)."""


@dataclass(frozen=True)
class SweepResult:
    sweep_id: str
    parent_run_id: str
    experiment: str
    supernet_dir: Path
    supernet_metrics: dict[str, float]
    trials_completed: int
    trials_failed: int
    resumed: bool = False
    """Whether this driver continued a sweep that an earlier driver started."""


@dataclass(frozen=True)
class SweepRecord:
    """``<workdir>/<name>/sweep.json``: written once, when the sweep first starts."""

    sweep_id: str
    """``<name>-<start time>``: the MLflow ``nas.sweep_id`` tag and the Optuna study name."""
    name: str
    created: str
    """Start time, ISO 8601 local time."""
    spec_file: str
    """The YAML the sweep started from (absolute path); a copy is ``sweep.yaml`` beside this file."""
    cwd: str
    """The working folder it started in (relative data paths and ``sqlite:///mlflow.db`` resolve there)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The ``space``, ``search`` and ``tracking`` sections it started with."""


def results_dir(spec: SweepSpec, sweep_id: str) -> Path:
    """Where scored trials keep their results (``<optuna number>.json``), per sweep id."""
    return spec.run_dir.resolve() / "trials" / sweep_id


def study_ref(spec: SweepSpec, sweep_id: str) -> StudyRef:
    """Where the sweep's Optuna study lives (``tracking.optuna_storage``, else the journal file)."""
    return StudyRef(study_name=sweep_id, journal=spec.run_dir.resolve() / "optuna.journal",
                    storage_url=spec.tracking.optuna_storage)


# --------------------------------------------------------------------------- identity


def _settings(spec: SweepSpec) -> dict[str, Any]:
    """The sections a resumed sweep must keep, as stored in ``sweep.json`` (the storage URL's password masked)."""
    tracking_section = spec.tracking.model_dump(mode="json")
    if tracking_section.get("optuna_storage"):
        tracking_section["optuna_storage"] = redact_url(tracking_section["optuna_storage"])
    return spec.redact({"space": spec.space.model_dump(mode="json", exclude_none=True),  # finetune runs after the
                        "search": spec.search.model_dump(mode="json", exclude={"finetune"}),  # search: it may change
                        "tracking": tracking_section})


def read_sweep_record(run_dir: Path) -> SweepRecord | None:
    """The sweep's record in ``run_dir`` (``<workdir>/<name>``), or None before its first start.

    Raises:
        SpecError: ``sweep.json`` exists but does not parse (names the file and the fix).
    """
    path = Path(run_dir) / SWEEP_FILE
    if not path.is_file():
        return None
    try:
        return SweepRecord(**json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, TypeError) as e:
        raise SpecError(f"{path}: unreadable sweep record ({e}); move the folder {run_dir} away to start "
                        "the sweep afresh") from None


def _changed(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Differences ``key: old, now new``; keys the old record lacks (fields added since) are not compared."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [c for k in sorted(old) for c in _changed(old[k], new.get(k), f"{prefix}{k}.")]
    return [] if old == new else [f"{prefix.rstrip('.')}: {old!r} when the sweep started, now {new!r}"]


def _sweep_record(spec: SweepSpec, spec_path: str | Path, *, must_exist: bool) -> tuple[SweepRecord, bool]:
    """Load the sweep's record (checking that the YAML did not change) or make a new one, not yet written
    (:func:`_write_record`); returns (record, resumed).

    Raises:
        SpecError: ``must_exist`` and there is no record, or the space/search/tracking sections changed.
    """
    run_dir = spec.run_dir.resolve()
    record = read_sweep_record(run_dir)
    if record is None:
        if must_exist:
            raise SpecError(f"no sweep named {spec.name!r} to resume: {run_dir / SWEEP_FILE} does not exist; "
                            f"start it with `nas sweep FILE`")
        record = SweepRecord(sweep_id=f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}", name=spec.name,
                             created=time.strftime("%Y-%m-%dT%H:%M:%S"), spec_file=str(Path(spec_path).resolve()),
                             cwd=str(Path.cwd()), settings=_settings(spec))
        return record, False
    changes = _changed(record.settings, _settings(spec))
    if changes:
        raise SpecError(f"{spec_path}: sweep {spec.name!r} (started {record.created} from {record.spec_file}) "
                        f"continues with the settings it started with, but: {'; '.join(changes)}. Restore those "
                        f"values, or give the YAML a new name to start another sweep")
    return record, True


def _write_record(spec: SweepSpec, spec_path: str | Path, record: SweepRecord) -> None:
    """Write ``sweep.yaml`` (the YAML's copy) then ``sweep.json``, each atomically: the sweep exists from here on."""
    run_dir = spec.run_dir.resolve()
    atomic_write_text(run_dir / SPEC_COPY, spec.redact(spec.yaml_text(spec_path)))  # ${VAR} kept, --set applied
    atomic_write_text(run_dir / SWEEP_FILE, json.dumps(record.__dict__, indent=2) + "\n")


# --------------------------------------------------------------------------- the sweep


def run_sweep(spec: SweepSpec, spec_path: str | Path, *, address: str | None = None,
              resume: bool = False, latency_runner: Any = None) -> SweepResult:
    """Run a whole sweep, or continue it: train (or reuse) the supernet, then ``search.trials`` Optuna trials.

    A sweep that finished (its parent MLflow run FINISHED) run again with the same settings starts nothing, not
    even Ray, and returns its recorded result.

    Args:
        spec: the validated YAML.
        spec_path: the YAML file (logged as an artifact of the sweep's parent run).
        address: a Ray cluster to join (default: start a local one).
        resume: only continue an existing sweep (error if ``<workdir>/<name>/sweep.json`` is missing).
        latency_runner: ``search.latency_engine: onnxruntime``'s runner factory
            (:attr:`SweepContext.latency_runner`; ``nas.api`` passes :func:`nas.export.latency_engine.onnx_runner`).

    Raises:
        SpecError: resources that the Ray cluster cannot provide, an unreachable Optuna storage, no sweep to
            resume, or settings changed since the sweep started.
        FaultSpecError: a malformed ``NAS_TEST_FAULT`` (:func:`nas.faults.check`); nothing is started.
        RunLockedError: another process (a driver of this sweep, ``nas train``, ``nas fidelity``) writes into
            the run folder ``<workdir>/<name>`` (names its pid, host and start time); nothing was prepared.
        SweepFailed: the supernet trial failed, or every search trial failed (with their errors).
        SweepStopped: (a KeyboardInterrupt) SIGINT or SIGTERM, raised at a safe point (:mod:`nas.search.stop`):
            the sweep's RUNNING MLflow runs are marked KILLED and Ray is shut down; running it again resumes it.
    """
    faults.check()  # a test-only hook: a malformed value would otherwise fail every trial
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # trials are printed by the MLflow callback
    run_dir = spec.run_dir.resolve()
    if resume and read_sweep_record(run_dir) is None:  # before anything is prepared or written
        raise SpecError(f"no sweep named {spec.name!r} to resume: {run_dir / SWEEP_FILE} does not exist; "
                        f"start it with `nas sweep FILE`")
    with run_lock(run_dir, f"nas sweep {spec.name}"):  # before data is prepared or anything is written
        return _run_locked(spec, spec_path, address, resume, latency_runner)


def _run_locked(spec: SweepSpec, spec_path: str | Path, address: str | None, resume: bool,
                latency_runner: Any = None) -> SweepResult:
    """:func:`run_sweep` with the run folder's lock held."""
    run_dir = spec.run_dir.resolve()
    connected: list[bool] = []  # whether encoding the data on the cluster connected to Ray
    data = prepare_sweep_data(spec, encoders=cluster_encoders(address, connected) if address else None)
    supernet_dir = run_dir / "supernet"
    check_fingerprint(supernet_dir, supernet_fingerprint(spec, data))  # before Ray or MLflow start
    record, resumed = _sweep_record(spec, spec_path, must_exist=resume)
    sweep_id = record.sweep_id
    study = study_ref(spec, sweep_id)
    study.load([("maximize" if m.goal == "maximize" else "minimize") for m in spec.search.metrics])
    if not resumed:  # after the storage answered: a failed start leaves no record behind
        _write_record(spec, spec_path, record)
    if resumed:
        console.print(f"[bold]resuming sweep {sweep_id}[/bold] (started {record.created})")
        finished = _finished_sweep(spec, record, supernet_dir)
        if finished is not None:
            return finished
    started_ray = init_ray(spec, address, connected=any(connected))
    restore_signals = handle_stop_signals()  # after ray.init: Ctrl-C and SIGTERM stop the sweep at a safe point
    experiment = spec.experiment
    tags = {"nas.sweep_id": sweep_id, "nas.sweep_name": spec.name, "nas.supernet_dir": str(supernet_dir),
            "nas.data_dir": str(Path(data.root).resolve()), "nas.beam_size": str(spec.search.beam_size),
            "nas.latency_workload": workload_tag(workload_of(spec.search))}
    parent_tags = {**tags, tracking.TAG_STUDY_NAME: study.study_name,  # where `nas report` finds the study
                   tracking.TAG_OPTUNA_STORAGE: redact_url(study.storage_url) if study.storage_url
                   else str(study.journal)}
    try:
        parent = _parent_run(spec, record, parent_tags, resumed)
        try:
            killed = tracking.end_stale_runs(experiment, sweep_id, keep=(parent,))
            if killed:
                console.print(f"marked {len(killed)} MLflow run(s) left RUNNING by the killed driver as KILLED")
            ctx = SweepContext(spec=spec, data=data, supernet_dir=supernet_dir,
                               results_dir=results_dir(spec, sweep_id), latency_runner=latency_runner)
            supernet_metrics = _train_stage(spec, ctx, experiment, parent, tags, sweep_id)
            _log_supernet_files(experiment, parent, supernet_dir, Path(data.root))
            level1_metrics: dict[str, float] = {}
            points = point_names = None
            if spec.search.method == "evolution":  # two-level search: level 1 chooses level 2's archs
                from nas.search.level1 import run_level1

                level1 = run_level1(spec, ctx, study, parent, sweep_id)
                points, point_names = level1.chosen, level1.names
                ctx = dataclasses.replace(ctx, level1_predictor=level1.predictor)
                level1_metrics = {"level1_candidates": level1.counts.get("COMPLETE", 0),
                                  "level1_failed": level1.counts.get("FAIL", 0), "level1_wall_s": level1.wall_s}
            completed, failed, errors = _search_stage(spec, ctx, experiment, tags, study, points=points,
                                                      point_names=point_names)
            finetuned: dict[str, int] = {}
            if completed > 0 and spec.search.finetune is not None:  # ASHA fine-tune of the best sub-Transformers
                from nas.search.finetune import finetune_counts, run_finetune_stage

                finetuned = finetune_counts(run_finetune_stage(spec, ctx, experiment, tags, study, sweep_id))
            tracking.log_metrics(parent, {**supernet_metrics, "trials_completed": completed,
                                          "trials_failed": failed, **finetuned, **level1_metrics})
            if completed == 0:
                raise SweepFailed(f"all {failed} search trials of sweep {sweep_id} failed:\n"
                                  + "\n".join(f"  trial {n}: {e}" for n, e in errors)
                                  + f"\nfull tracebacks under {ray_dir(spec, sweep_id, 'search')}")
            log_pareto_plot(experiment, sweep_id, parent)  # pareto.png on the parent run
            tracking.end_run(parent, "FINISHED")
        except BaseException as e:
            _end_sweep_runs(experiment, sweep_id, parent, stopped=isinstance(e, KeyboardInterrupt))
            raise
    finally:
        if started_ray:
            ray.shutdown()
        restore_signals()
    return SweepResult(sweep_id, parent, experiment, supernet_dir, supernet_metrics, completed, failed, resumed)


def _finished_sweep(spec: SweepSpec, record: SweepRecord, supernet_dir: Path) -> SweepResult | None:
    """The result of a sweep that already finished (its parent MLflow run ended FINISHED, which happens only after
    every stage is done), read from its records without starting Ray; None when anything may be left to do.

    A finished Ray Tune experiment restored, a fairseq run past ``--max-update``: run again, a finished sweep does
    nothing and shows its results (with changed settings it is refused earlier, by :func:`_sweep_record`)."""
    runs = tracking.find_tagged_runs(spec.experiment, {tracking.TAG_ROLE: "sweep", tracking.TAG_SWEEP_ID: record.sweep_id})
    metrics_file = supernet_dir / "metrics.json"
    if not runs or runs[0].info.status != "FINISHED" or not metrics_file.is_file():
        return None
    metrics = runs[0].data.metrics
    if "trials_completed" not in metrics:
        return None
    console.print(f"sweep {record.sweep_id} finished before: nothing left to run (Ray not started)")
    return SweepResult(record.sweep_id, runs[0].info.run_id, spec.experiment, supernet_dir,
                       json.loads(metrics_file.read_text()), int(metrics["trials_completed"]),
                       int(metrics.get("trials_failed", 0)), resumed=True)


def _end_sweep_runs(experiment: str, sweep_id: str, parent: str, *, stopped: bool) -> None:
    """End the parent run FAILED, or when the sweep was stopped (Ctrl-C, SIGTERM) KILLED with every run of the
    sweep left RUNNING. A stopped sweep's store error is one line (the next start marks the runs), so that the
    stop's own message is the one that ends the command."""
    try:
        if stopped:
            tracking.end_stale_runs(experiment, sweep_id, keep=(parent,))
        tracking.end_run(parent, "KILLED" if stopped else "FAILED")
    except Exception as e:
        if not stopped:
            raise
        console.print(f"[yellow]could not mark the sweep's MLflow runs KILLED ({type(e).__name__}); the next start "
                      f"of the sweep does[/yellow]")


def _parent_run(spec: SweepSpec, record: SweepRecord, tags: dict[str, str], resumed: bool) -> str:
    """The sweep's parent run: reused (keyed by ``nas.sweep_id``) and reopened, or created."""
    params = {"yaml": record.spec_file, "search.method": spec.search.method, "search.trials": spec.search.trials}
    if spec.tracking.optuna_storage:
        params["tracking.optuna_storage"] = redact_url(spec.tracking.optuna_storage)
    params = spec.redact(params)
    if spec.search.constraints:  # read back by the Pareto plot and `nas report`: the front is feasible trials only.
        # Parsed bounds are numbers, not credentials: logged as they are even when a ${VAR} gave them, since a
        # redacted bound could not be read back (and a secret that happens to equal "30" would hide the budget).
        params[tracking.PARAM_CONSTRAINTS] = "; ".join(c.key for c in spec.search.parsed_constraints())
    runs = tracking.find_tagged_runs(spec.experiment, {tracking.TAG_ROLE: "sweep", tracking.TAG_SWEEP_ID: record.sweep_id})
    if runs:
        run_id = runs[0].info.run_id
        if runs[0].info.status != "RUNNING":
            tracking.reopen_run(run_id)
        resumes = int(runs[0].data.tags.get("nas.resumes", "0")) + (1 if resumed else 0)
        tracking.get_client().set_tag(run_id, "nas.resumes", str(resumes))
        for key in (tracking.TAG_STUDY_NAME, tracking.TAG_OPTUNA_STORAGE):  # a sweep started before they were tagged
            if key in tags and key not in runs[0].data.tags:
                tracking.get_client().set_tag(run_id, key, tags[key])
        tracking.log_new_params(run_id, params)
    else:
        run_id = tracking.start_run(spec.experiment, record.sweep_id, role="sweep", tags=tags, params=params)
    copy = spec.run_dir.resolve() / SPEC_COPY
    name = Path(record.spec_file).name
    if name not in {a.path for a in tracking.get_client().list_artifacts(run_id)}:
        with tempfile.TemporaryDirectory() as tmp:  # the YAML the sweep started from, under its own name
            (Path(tmp) / name).write_text(spec.redact(copy.read_text(encoding="utf-8")), encoding="utf-8")
            tracking.log_file_artifact(run_id, Path(tmp) / name)
    return run_id


def _train_stage(spec: SweepSpec, ctx: SweepContext, experiment: str, parent: str, tags: dict[str, str],
                 sweep_id: str) -> dict[str, float]:
    """Train the supernet as one Ray Tune trial unless a finished one is already in ``supernet_dir``."""
    metrics_file = ctx.supernet_dir / "metrics.json"
    params = spec.redact({"supernet": spec.supernet.model_dump(mode="json"), "train": spec.train.model_dump(mode="json"),
                          "space": spec.space.model_dump(mode="json", exclude_none=True)})
    if metrics_file.is_file():
        console.print(f"[green]reusing the trained supernet in {ctx.supernet_dir}[/green]")
        metrics = json.loads(metrics_file.read_text())
        _finish_supernet_run(experiment, parent, tags, params, metrics)
        return metrics
    console.print(f"[bold]training the supernet[/bold] ({spec.train.steps} steps"
                  + (f", {spec.resources.workers} data-parallel workers" if spec.resources.workers > 1 else "")
                  + f") -> {ctx.supernet_dir}")
    if spec.resources.workers > 1:
        return _train_stage_ddp(spec, ctx, experiment, parent, tags, params, sweep_id)
    callback = MlflowTrialCallback(experiment, sweep_id, "supernet", tags, params)
    trainable = tune.with_resources(tune.with_parameters(train_trial, ctx=ctx),
                                    {"cpu": spec.resources.cpu, "gpu": spec.resources.gpu})
    exp_dir = ray_dir(spec, sweep_id, "train")
    tuner, _ = make_tuner(trainable, exp_dir, restart_errored=True,  # the trainer resumes from its own checkpoint
                      tune_config=tune.TuneConfig(num_samples=1),
                      run_config=run_config(exp_dir, [callback], spec.search.max_failures))
    results = fit(tuner)
    if results.errors or not metrics_file.is_file():
        raise SweepFailed(f"supernet training failed: {'; '.join(str(e) for e in results.errors)[-2000:]}")
    return json.loads(metrics_file.read_text())


def _train_stage_ddp(spec: SweepSpec, ctx: SweepContext, experiment: str, parent: str, tags: dict[str, str],
                     params: dict[str, Any], sweep_id: str) -> dict[str, float]:
    """Train the supernet on ``resources.workers`` Ray Train workers (:mod:`nas.search.ddp`), logging rank 0's
    reports into the sweep's supernet run (reused after a restart) and its per-stage runs."""
    from nas.search.ddp import train_supernet_ddp

    runs = tracking.find_tagged_runs(experiment, {tracking.TAG_PARENT: parent, tracking.TAG_ROLE: "supernet"})
    if runs:
        run_id = runs[0].info.run_id
        tracking.reopen_run(run_id)
    else:
        run_id = tracking.start_run(experiment, "supernet", role="supernet", parent_run_id=parent, tags=tags,
                                    params=params)
    try:
        metrics = train_supernet_ddp(spec, ctx.data, ctx.supernet_dir, storage_path=ray_dir(spec, sweep_id, "train"),
                                     name="ddp", mlflow_uri=tracking.tracking_uri(), experiment=experiment,
                                     supernet_run_id=run_id, max_failures=spec.search.max_failures)
    except BaseException as e:
        tracking.end_run(run_id, "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        if not isinstance(e, Exception):  # Ctrl-C or exit: not a failure of the training
            raise
        raise SweepFailed(f"data-parallel supernet training failed: {e}"[-2000:]) from e
    tracking.end_run(run_id, "FINISHED")
    return metrics


def _finish_supernet_run(experiment: str, parent: str, tags: dict[str, str], params: dict[str, Any],
                         metrics: dict[str, float]) -> None:
    """Make sure the sweep has one FINISHED supernet run holding the final metrics (none is duplicated)."""
    runs = tracking.find_tagged_runs(experiment, {tracking.TAG_PARENT: parent, tracking.TAG_ROLE: "supernet"})
    if runs and runs[0].info.status == "FINISHED":
        return
    if runs:
        run_id = runs[0].info.run_id
        tracking.log_new_params(run_id, params)
    else:
        run_id = tracking.start_run(experiment, "supernet (reused)", role="supernet", parent_run_id=parent,
                                    tags={**tags, "nas.reused": "true"}, params=params)
    tracking.log_metrics(run_id, metrics)
    tracking.end_run(run_id, "FINISHED")


def _log_supernet_files(experiment: str, parent: str, supernet_dir: Path, data_dir: Path) -> None:
    """Log the trained supernet, the SentencePiece model and the validation file into the sweep's supernet run
    (once; a resumed sweep uploads only what is missing), so ``nas export`` works from any machine that reaches
    MLflow (:mod:`nas.tracking.model_files`)."""
    runs = tracking.find_tagged_runs(experiment, {tracking.TAG_PARENT: parent, tracking.TAG_ROLE: "supernet"})
    finished = [r for r in runs if r.info.status == "FINISHED"] or runs
    if finished:
        uploaded = tracking.log_supernet_files(finished[0].info.run_id, supernet_dir, data_dir)
        if uploaded:
            console.print(f"logged {', '.join(uploaded)} to MLflow run {finished[0].info.run_id} "
                          f"(artifacts/{tracking.SUPERNET_ARTIFACTS})")


def _search_stage(spec: SweepSpec, ctx: SweepContext, experiment: str, tags: dict[str, str],
                  study: StudyRef, points: list[dict[str, Any]] | None = None,
                  point_names: list[str | None] | None = None) -> tuple[int, int, list[tuple[int, str]]]:
    """Score ``search.trials`` sub-Transformers sampled by Optuna; returns (completed, failed, [(number, error)]).

    ``points``: the Optuna parameters of the first trials (default: ``search.points_to_evaluate``), with their
    names in ``point_names`` (default: :meth:`~nas.space.SearchSpec.point_names`; None: unnamed), which tag their
    MLflow runs ``nas.point``; with ``search.method: evolution`` they are the archs of ``points_to_evaluate`` and
    level 1's choice (:func:`nas.search.level1.run_level1`), and the trials they do not cover (level 1 found fewer
    distinct archs) are drawn at random.
    """
    se = spec.search
    space = build_space(spec)
    if points is None:
        points, point_names = space.point_params(se.points_to_evaluate), se.point_names()
    sampler_spec = se.model_copy(update={"method": "random"}) if se.method == "evolution" else se
    searcher = DurableOptunaSearch(DefineByRun(space), study, sampler_spec, points=points,
                                   point_names=point_names or ())
    callbacks = [OptunaSync(searcher), MlflowTrialCallback(experiment, study.study_name, "trial", tags)]
    trainable = tune.with_resources(tune.with_parameters(score_trial, ctx=ctx),
                                    {"cpu": se.cpu_per_trial, "gpu": se.gpu_per_trial})
    exp_dir = ray_dir(spec, study.study_name, "search")
    tuner, restored = make_tuner(trainable, exp_dir, restart_errored=False,
                             tune_config=tune.TuneConfig(search_alg=searcher, num_samples=-1, reuse_actors=True),
                             run_config=run_config(exp_dir, callbacks, se.max_failures))
    done = Counter(t.state.name for t in study_trials(study))
    console.print(f"[bold]searching[/bold]{' (level 2)' if se.method == 'evolution' else ''}: {se.trials} trials, "
                  f"{se.max_concurrent} at a time, {se.method} on {', '.join(m.name for m in se.metrics)}"
                  + (f" (restored: {done['COMPLETE']} complete, {done['FAIL']} failed)" if restored else ""))
    fit(tuner)
    lost = [t.number for t in study_trials(study)
            if t.state in (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING)]
    if lost:  # a Ray experiment state older than the searcher's "finished" flag: should not happen
        DurableOptunaSearch(DefineByRun(build_space(spec)), study, se).fail_open_trials(
            "lost: its Ray trial was not in the restored experiment")
        console.print(f"[red]Optuna trials {lost} had no Ray trial after the restore; marked FAIL[/red]")
    trials = study_trials(study)
    completed = sum(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    errors = [(t.number, str(t.user_attrs.get(ATTR_ERROR, "failed"))) for t in trials
              if t.state == optuna.trial.TrialState.FAIL]
    return completed, len(errors), errors


# --------------------------------------------------------------------------- status


@dataclass(frozen=True)
class SweepStatus:
    """Trial counts by state in each system, for ``nas sweep --status NAME``."""

    name: str
    sweep_id: str | None
    trials: int
    """``search.trials``: how many the sweep runs in all."""
    optuna: dict[str, int]
    """Optuna trial states (COMPLETE, FAIL, RUNNING, ...)."""
    ray: dict[str, int]
    """Ray Tune trial statuses of the search experiment (TERMINATED, ERROR, PENDING, RUNNING, ...)."""
    mlflow: dict[str, int]
    """MLflow statuses of the trial runs (FINISHED, FAILED, KILLED, RUNNING)."""
    mlflow_duplicates: int
    """Trial runs beyond the first for the same Optuna trial (should be 0)."""
    mlflow_other: dict[str, str]
    """The parent (``sweep``) and ``supernet`` runs' statuses."""
    where: dict[str, str]
    level1: dict[str, int] = field(default_factory=dict)
    """Level 1's candidates by Optuna state (``search.method: evolution``; empty otherwise)."""

    def lines(self) -> list[str]:
        def fmt(counts: dict[str, int]) -> str:
            return "  ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"
        return [
            f"sweep {self.name} ({self.sweep_id or 'not started'}): {self.trials} trials requested",
            *([f"  level 1 {fmt(self.level1)}   [{self.where['optuna']}]"] if self.level1 else []),
            f"  optuna  {fmt(self.optuna)}   [{self.where['optuna']}]",
            f"  ray     {fmt(self.ray)}   [{self.where['ray']}]",
            f"  mlflow  {fmt(self.mlflow)}; duplicates {self.mlflow_duplicates}; "
            + ", ".join(f"{k} {v}" for k, v in self.mlflow_other.items()) + f"   [{self.where['mlflow']}]",
        ]


def sweep_status(spec: SweepSpec) -> SweepStatus:
    """Count the sweep's trials by state in Optuna, Ray Tune and MLflow (reads only; works while it runs).

    Raises:
        LookupError: the sweep never started (no ``<workdir>/<name>/sweep.json``).
        SpecError: the Optuna storage is unreachable.
    """
    run_dir = spec.run_dir.resolve()
    record = read_sweep_record(run_dir)
    if record is None:
        raise NotFoundError(f"sweep {spec.name!r} has not started: no {run_dir / SWEEP_FILE}")
    ref = study_ref(spec, record.sweep_id)
    try:
        optuna_counts = dict(Counter(t.state.name for t in ref.load().get_trials(deepcopy=False)))
    except KeyError:
        optuna_counts = {}
    level1: dict[str, int] = {}
    if spec.search.method == "evolution":
        from nas.search.level1 import level1_counts

        level1 = level1_counts(ref)
    exp_dir = ray_dir(spec, record.sweep_id, "search")
    ray_counts: dict[str, int] = {}
    if is_uri(exp_dir) or (exp_dir.is_dir() and any(exp_dir.glob("experiment_state-*.json"))):
        from ray.tune import ExperimentAnalysis

        try:
            ray_counts = dict(Counter(t.status for t in ExperimentAnalysis(str(exp_dir)).trials))
        except Exception:  # a URI storage with no experiment (yet) or unreachable: Ray's counts are unknown
            if not is_uri(exp_dir):
                raise
    runs = tracking.find_tagged_runs(spec.experiment, {tracking.TAG_SWEEP_ID: record.sweep_id})
    trial_runs = [r for r in runs if r.data.tags.get(tracking.TAG_ROLE) == "trial"]
    keys = Counter(r.data.tags.get(tracking.TAG_OPTUNA_TRIAL, r.info.run_id) for r in trial_runs)
    other = {f"{role} run": "/".join(r.info.status for r in runs if r.data.tags.get(tracking.TAG_ROLE) == role) or "none"
             for role in ("sweep", "supernet")}
    return SweepStatus(spec.name, record.sweep_id, spec.search.trials, optuna_counts, ray_counts,
                       dict(Counter(r.info.status for r in trial_runs)), sum(n - 1 for n in keys.values()), other,
                       {"optuna": ref.location, "ray": redact_url(str(exp_dir)),
                        "mlflow": redact_url(tracking.tracking_uri())}, level1)
