"""The two Ray Tune trainables of a sweep: supernet training and inherited-weight scoring.

Both run inside Ray worker processes and report through ``ray.tune.report``; MLflow and Optuna
are written by the driver (:mod:`nas.search.callbacks`, :mod:`nas.search.searcher`), so there is
one writer per database.

Trials scoring side by side on one node share the node's measurement lock
(:class:`nas.eval.measure_lock.MeasureLock`): loading the supernet, decoding and the loss hold it shared, the
latency measurement holds it alone, so no trial times itself while another computes.

A trial's ``latency_ratio``, ``latency_ms`` and ``latency_reference_ms`` time the YAML's fixed workload
(``search.latency_workload``) with the reference arch (``search.latency_reference``, :func:`resolve_reference`)
interleaved, in the trial's process: :func:`nas.eval.latency.measure_latency_ratio`, the one measurement that level
1's predictor samples and ``nas retrain`` use too.

A scored trial writes its result to ``<workdir>/<name>/trials/<optuna number>.json`` (atomically)
before reporting it: a trial that Ray runs again after the driver was killed reports that file
instead of scoring the arch again.

Test-only fault injection: :func:`score_trial` is the fault point ``score_trial`` of :mod:`nas.faults`.
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from ray import tune

from nas import faults
from nas.data import PreparedData
from nas.errors import NasError
from nas.eval.latency import latency_device, resolve_reference
from nas.eval.measure_lock import MeasureLock
from nas.eval.validation import ValidationSet, validation_scores
from nas.atomic import atomic_write_text
from nas.model.io import load_model
from nas.model.supernet import SuperTransformer, count_params, extract
from nas.search.ray_session import quiet_worker_exit
from nas.search.searcher import CONTROL_KEYS, ERROR_KEY, FINISHED_KEY, OPTUNA_TRIAL_KEY
from nas.builders import build_space
from nas.space.arch import Arch
from nas.space.constraints import violated
from nas.space.predictor_file import workload_mismatch, workload_of, workload_tag
from nas.space.space import SearchSpace
from nas.space import SweepSpec

__all__ = ["latency_predictor", "validation_set", "SweepContext", "train_trial", "score_trial", "DefineByRun", "score_arch", "feasibility", "latency_device",
           "resolve_reference", "OPTUNA_TRIAL_KEY"]


@dataclass(frozen=True)
class SweepContext:
    """What every trial of a sweep needs (small and picklable: paths and the validated spec)."""

    spec: SweepSpec
    data: PreparedData
    supernet_dir: Path
    results_dir: Path | None = None
    """Where scored trials keep their results (``<optuna number>.json``); None: not kept."""
    level1_predictor: Path | None = None
    """The latency predictor level 1 chose the archs with (two-level search): each trial reports its predicted
    ``latency_ratio_pred`` beside the measured ratio; None: ``search.latency_predictor`` or nothing."""
    latency_runner: Any = None
    """``search.latency_engine: onnxruntime``'s runner factory, ``(spm_model, threads) -> Runner``
    (:func:`nas.export.latency_engine.onnx_runner`), supplied by the layer that starts the sweep (``nas.api``);
    None: PyTorch's beam search."""


def train_trial(config: dict[str, Any], *, ctx: SweepContext) -> None:
    """Ray Tune trainable: train the supernet (resuming from its checkpoint) and report metrics."""
    quiet_worker_exit()  # no "SystemExit" traceback when Ray stops this actor
    from trainers import train_supernet

    train_supernet(ctx.spec, ctx.data, ctx.supernet_dir, report=tune.report, progress=False)


@functools.lru_cache(maxsize=2)
def load_supernet(directory: str) -> SuperTransformer:
    """The trained supernet in ``directory`` (``supernet.safetensors`` + ``supernet.json``), loaded once per worker
    process (cached: Ray reuses actors between trials); callers must not modify it (extract a copy).

    Raises:
        FileNotFoundError: no supernet files in ``directory``.
    """
    return load_model(directory, "supernet")


def latency_predictor(path: str):
    """The latency predictor in ``path`` (``nas latency fit``'s file), loaded once per worker process.

    Raises:
        PredictorFileError: a file written without a workload (refit it), or not a predictor's.
    """
    return _predictor(path)


@functools.lru_cache(maxsize=2)
def _predictor(path: str):
    from nas.eval.latency import LatencyPredictor

    return LatencyPredictor.load(path)


def _checked_predictor(spec: SweepSpec, reference: Arch, *, ratio: bool):
    """The ``search.latency_predictor``, refused unless it was fitted on the YAML's workload and, with ``ratio``
    (``latency_ratio`` taken from it), measured the YAML's reference arch.

    Raises:
        NasError: the predictor's workload or reference differs from the YAML's, or it has no reference latency;
            the message names the file, both values and the fix.
    """
    path = spec.search.latency_predictor
    predictor = _predictor(str(path))
    wanted = workload_of(spec.search)
    fix = "refit it with `nas latency fit` on this YAML"
    diff = workload_mismatch(predictor.workload, wanted)
    if diff:
        raise NasError(f"search.latency_predictor: {path} was fitted on latency workload "
                       f"{workload_tag(predictor.workload)}, but search.latency_workload is {workload_tag(wanted)} "
                       f"({diff}); {fix}")
    if ratio and predictor.reference_arch is None:
        raise NasError(f"search.latency_predictor: {path} stores no measured reference arch, so latency_ratio cannot "
                       f"be predicted; {fix}")
    if ratio and Arch.from_json(predictor.reference_arch).arch_id != reference.arch_id:
        raise NasError(f"search.latency_predictor: {path} measured the reference "
                       f"{Arch.from_json(predictor.reference_arch).summary()}, but search.latency_reference: "
                       f"{spec.search.latency_reference} is {reference.summary()}; {fix}")
    return predictor


@functools.lru_cache(maxsize=4)
def validation_set(data: PreparedData, sentences: int | None) -> ValidationSet:
    """The first ``sentences`` validation pairs of ``data`` (None: all), loaded once per worker process (Ray reuses
    actors between trials, and level 1 scores its batches in the same processes)."""
    return ValidationSet.load(data, sentences)


def score_arch(model: SuperTransformer, arch, spec: SweepSpec, data: PreparedData, *,
               lock: MeasureLock | None = None, level1_predictor: Path | None = None,
               latency_runner: Any = None) -> dict[str, float]:
    """Score a sub-Transformer with inherited weights on the validation set.

    Returns ``bleu``, ``chrf`` (sacrebleu, detokenized, beam search with ``search.beam_size``),
    ``valid_loss`` (nats/token), ``params_m`` (millions, the extracted model's parameters) and the latency:

    - with ``search.latency: measured``, :func:`nas.eval.latency.measure_latency_ratio` of the extracted
      sub-Transformer and the extracted reference arch (:func:`resolve_reference`), timed interleaved for
      ``search.latency_repeats`` rounds on the fixed workload ``search.latency_workload`` (HAT sec. 4: a dummy
      source, exactly ``tgt_tokens`` beam-search decoder steps), on ``search.latency_device``
      (:func:`latency_device`) and ``search.cpu_per_trial`` torch threads: ``latency_ratio`` (the median per-round
      ratio; a budget less tied to one CPU's speed than ms; a CPU budget does not carry over to a GPU, where
      batch-1 decoding is bound by kernel launches), ``latency_ms`` and ``latency_reference_ms`` (the medians);
    - with ``predicted``, the ``search.latency_predictor``'s ratio (HAT sec. 3.3), its milliseconds (the ratio
      times the reference's latency its samples measured) and that reference latency.

    When a predictor is given with ``measured`` (``search.latency_predictor``, else ``level1_predictor``),
    ``latency_ratio_pred`` and ``latency_pred_ms`` are added, and ``latency_drift``
    (``|predicted - measured| / measured`` of the ratio); a drift above 20% is warned about.

    Decoding and the loss hold the node's measurement lock shared, the timing holds it exclusively
    (:class:`nas.eval.measure_lock.MeasureLock`): trials scoring side by side on one node never time themselves
    while another computes.

    Args:
        lock: the node's measurement lock (default: ``MeasureLock()``, the folder of
            :func:`nas.eval.measure_lock.lock_dir`).
        level1_predictor: the predictor level 1 fitted in this sweep (its workload and reference are the YAML's).

    Raises:
        OSError: the lock's folder or files cannot be created or opened.
        NasError: ``search.latency_device: cuda`` on a trial without a GPU; a bad ``search.latency_reference``;
            a predictor fitted on another workload or reference arch.
    """
    se = spec.search
    lock = lock if lock is not None else MeasureLock()
    reference = resolve_reference(spec, build_space(spec))
    if se.latency_predictor is not None:
        predictor = _checked_predictor(spec, reference, ratio=se.latency == "predicted")
    else:
        predictor = None if level1_predictor is None else _predictor(str(level1_predictor))
    with lock.shared():
        vset = validation_set(data, se.valid_sentences)
        metrics = validation_scores(model, arch, vset, beam_size=se.beam_size, max_tokens=spec.train.max_tokens)
        sub = extract(model, arch).eval()
        metrics["params_m"] = count_params(sub) / 1e6
        predicted = None if predictor is None else predictor.predict_ratio(arch)
    if se.latency == "predicted":
        metrics["latency_ratio"] = predicted
        metrics["latency_reference_ms"] = predictor.reference_ms
        metrics["latency_ms"] = predicted * predictor.reference_ms
        return metrics
    metrics.update(_measure(model, sub, arch, reference, spec, lock, latency_runner, data.spm_model))
    if predicted is not None:
        from nas.eval.latency import check_drift

        metrics["latency_ratio_pred"] = predicted
        metrics["latency_pred_ms"] = predicted * predictor.reference_ms
        metrics["latency_drift"] = abs(predicted - metrics["latency_ratio"]) / metrics["latency_ratio"]
        warning = check_drift(predicted, metrics["latency_ratio"], unit="x the reference")
        if warning:
            warnings.warn(f"{arch.summary()}: {warning}", stacklevel=2)
    return metrics


def _measure(model: SuperTransformer, sub: SuperTransformer, arch: Arch, reference: Arch, spec: SweepSpec,
             lock: MeasureLock, latency_runner: Any = None, spm_model: Path | None = None) -> dict[str, float]:
    """``latency_ms``, ``latency_reference_ms`` and ``latency_ratio`` of the extracted ``sub`` (see
    :func:`score_arch`): it and the extracted reference timed interleaved on ``search.latency_engine``
    (:func:`engine_runner`), in one exclusive hold of ``lock``."""
    from nas.eval.latency import measure_latency_ratio

    se = spec.search
    device = latency_device(se.latency_device, next(model.parameters()).device)
    reference_model = extract(model, reference).eval().to(device)
    threads = max(1, int(se.cpu_per_trial))
    runner = engine_runner(spec, latency_runner, spm_model, threads)
    try:
        return measure_latency_ratio(sub.to(device), arch, reference_model, reference, workload=workload_of(se),
                                     rounds=se.latency_repeats, threads=threads, lock=lock, runner=runner)
    finally:
        getattr(runner, "close", lambda: None)()


def engine_runner(spec: SweepSpec, factory: Any, spm_model: Path, threads: int) -> Any:
    """The runner of ``search.latency_engine`` (:func:`nas.eval.latency.measure_latency_ratio`'s ``runner``): None
    (PyTorch) for ``torch``; ``factory(spm_model, threads)`` for ``onnxruntime``.

    Raises:
        NasError: ``onnxruntime`` without a factory (a sweep started below ``nas.api``, which supplies it).
    """
    if spec.search.latency_engine == "torch":
        return None
    if factory is None:
        raise NasError("search.latency_engine: onnxruntime needs the ONNX engine, which `nas sweep`, `nas retrain`, "
                       "`nas latency fit` and nas.api supply; start the sweep through them, or set latency_engine: "
                       "torch")
    return factory(spm_model, threads)


def feasibility(metrics: dict[str, float], spec: SweepSpec) -> dict[str, Any]:
    """``feasible`` (1.0 when every ``search.constraints`` bound holds, else 0.0) and, when some bound fails,
    ``violated`` (the failed constraints, ``"; "``-joined); empty without constraints."""
    constraints = spec.search.parsed_constraints()
    if not constraints:
        return {}
    failed = [c.key for c in violated(constraints, metrics)]
    return {"feasible": 0.0 if failed else 1.0, **({"violated": "; ".join(failed)} if failed else {})}


def score_trial(config: dict[str, Any], *, ctx: SweepContext) -> None:
    """Ray Tune trainable: the arch Optuna sampled (``config``), scored with inherited weights.

    Reports the :func:`score_arch` metrics plus ``arch`` (JSON), ``arch_id`` and ``arch_summary``; reports
    the stored result instead when this Optuna trial was scored before (a re-run after a driver kill).

    Raises:
        FloatingPointError: a metric is NaN or infinite (names the metrics and the arch).
        torch.OutOfMemoryError: the arch does not fit in memory (names the arch).
        RuntimeError: injected by :mod:`nas.faults` (tests only), or the replay of a trial that failed
            before the driver was killed.
    """
    quiet_worker_exit()  # no "SystemExit" traceback when Ray stops this actor
    number = config.get(OPTUNA_TRIAL_KEY)
    params = {k: v for k, v in config.items() if k not in CONTROL_KEYS}
    stored = _load_result(ctx, number)
    if stored is not None:
        tune.report(stored)
        return
    if config.get(FINISHED_KEY) == "FAIL":  # failed before a kill lost its Ray trial: record it again, as is
        raise RuntimeError(f"Optuna trial {number} failed before the driver was killed: {config.get(ERROR_KEY)}")
    torch.set_num_threads(max(1, int(ctx.spec.search.cpu_per_trial)))
    arch = build_space(ctx.spec).from_params(params)
    fault = None
    try:
        fault = faults.point("score_trial", number=number, attempts=_result_path(ctx, number, ".attempts"),
                             label=f"Optuna trial {number}")
        with MeasureLock().shared():  # reading the weights computes too: not while a trial times itself
            model = load_supernet(str(ctx.supernet_dir))
        if ctx.spec.search.gpu_per_trial > 0 and torch.cuda.is_available():  # Ray gave this trial (a share of) a GPU
            model.to("cuda")  # in place: the worker's cached supernet stays there for the next trial
        metrics = score_arch(model, arch, ctx.spec, ctx.data, level1_predictor=ctx.level1_predictor,
                             latency_runner=ctx.latency_runner)
    except torch.OutOfMemoryError as e:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        raise torch.OutOfMemoryError(f"{e} -- scoring {arch.summary()}; lower search.max_concurrent or "
                                     "search.beam_size, or give trials more memory") from e
    if fault == "nan":
        metrics["valid_loss"] = float("nan")
    bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
    if bad:
        raise FloatingPointError(f"Optuna trial {number}: non-finite {', '.join(f'{k}={v}' for k, v in bad.items())} "
                                 f"for {arch.summary()}; the supernet may have diverged (lower train.lr)")
    result = {**metrics, **feasibility(metrics, ctx.spec), "arch": arch.to_json(), "arch_id": arch.arch_id,
              "arch_summary": arch.summary()}
    _store_result(ctx, number, result)
    tune.report({**result, "node_id": ray.get_runtime_context().get_node_id()})  # the Ray node that scored it


def _result_path(ctx: SweepContext, number: int | None, suffix: str = ".json") -> Path | None:
    if ctx.results_dir is None or number is None:
        return None
    return Path(ctx.results_dir) / f"{int(number):05d}{suffix}"


def _load_result(ctx: SweepContext, number: int | None) -> dict[str, Any] | None:
    path = _result_path(ctx, number)
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # unreadable: score again



def _store_result(ctx: SweepContext, number: int | None, result: dict[str, Any]) -> None:
    path = _result_path(ctx, number)
    if path is not None:
        atomic_write_text(path, json.dumps(result))


class DefineByRun:
    """Optuna define-by-run space for Ray's ``OptunaSearch`` (a picklable callable)."""

    def __init__(self, space: SearchSpace) -> None:
        self.space = space

    def __call__(self, trial) -> None:
        self.space.suggest(trial)
