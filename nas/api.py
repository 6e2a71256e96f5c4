"""The public Python API (what `import nas` offers in a notebook): the CLI's jobs as functions.

    import nas

    spec = nas.load_spec("search_spaces/quickstart.yaml")
    result = nas.sweep("search_spaces/quickstart.yaml", overrides={"search.trials": 4})  # = nas sweep FILE --set ..
    table = nas.leaderboard(top=5)                              # = nas leaderboard, as a pandas DataFrame
    done = nas.retrain("search_spaces/quickstart.yaml", best=True)
    nas.export("exported/", run_id=done.run_id)                 # = nas export --out exported/ --run-id ...
    model = nas.load_export("exported/")                        # a folder written by `nas export`
    nas.translate("exported/", ["A man is riding a bike ."])   # -> ["Ein Mann ..."]
    trained = nas.train("search_spaces/quickstart.yaml")        # = nas train FILE (the supernet alone)

`nas.export` is also the package of the export modules (`nas.export`); calling it is
`nas.export.trial.export_trial`.

Each function imports what it needs when called, so `import nas` loads no torch, Ray, Optuna or
MLflow. Bad input raises `nas.errors.NasError` (its subclasses name the key or file).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from nas.errors import NasError

if TYPE_CHECKING:
    import pandas

    from nas.export import Exported
    from nas.retraining import RetrainResult
    from nas.search import SweepResult
    from nas.space import SweepSpec
    from nas.tracking import Board
    from trainers import TrainResult

__all__ = ["load_spec", "sweep", "train", "retrain", "leaderboard", "load_export", "translate"]


def _path(value: object, what: str) -> Path:
    if not isinstance(value, (str, Path)):
        raise NasError(f"{what}: expected a file path (str or Path), got {type(value).__name__}")
    return Path(value)


def override_items(overrides: Mapping[str, object] | None) -> tuple[str, ...]:
    """`{"train.steps": 2, "search.method": "tpe"}` -> `("train.steps=2", 'search.method="tpe"')`: the
    `--set KEY.PATH=VALUE` items of `nas.space.load_spec` (each value written as JSON, which YAML reads
    back unchanged).

    Raises:
        NasError: `overrides` is not a mapping, a key is not a non-empty dotted string, or a value is not
            plain data (numbers, strings, booleans, None, lists and dicts of them).
    """
    if overrides is None:
        return ()
    if not isinstance(overrides, Mapping):
        raise NasError(f"overrides: expected a dict of dotted keys to values, e.g. {{'train.steps': 2}}, got "
                       f"{type(overrides).__name__}")
    items = []
    for key, value in overrides.items():
        if not isinstance(key, str) or not key.strip() or "=" in key:
            raise NasError(f"overrides: key {key!r} is not a dotted YAML key such as 'train.steps'")
        try:
            items.append(f"{key}={json.dumps(value)}")
        except (TypeError, ValueError):
            raise NasError(f"overrides[{key!r}]: a {type(value).__name__} is not a YAML value (numbers, strings, "
                           "booleans, None, lists, dicts)") from None
    return tuple(items)


def load_spec(path: str | Path, *, check_files: bool = True) -> "SweepSpec":
    """Read and validate a sweep YAML (`search_spaces/*.yaml`).

    Raises:
        SpecError: a bad key or value, a missing data file (names the key path and the fix).
    """
    from nas.space import load_spec as _load

    return _load(path, check_files=check_files)


def sweep(path: str | Path, *, overrides: Mapping[str, object] | None = None, address: str | None = None,
          resume: bool = False) -> "SweepResult":
    """Run (or continue) the sweep of a YAML: supernet, Optuna search through Ray Tune, MLflow runs.

    Args:
        path: the sweep YAML.
        overrides: dotted keys to values, applied to the YAML before validation, as `nas sweep --set`
            (`{"search.trials": 4}`).
        address: a Ray cluster address (`auto`, `ray://HOST:10001`); None starts a local Ray.
        resume: require an earlier start of this sweep (`nas sweep --resume`).

    Raises:
        SpecError: bad input (nothing is started). BackendError: the tracking store, the Optuna storage or the
            Ray address does not answer (nothing is started). SweepFailed: every trial failed.
            KeyboardInterrupt: Ctrl-C before Ray starts; after, `nas.search.SweepStopped` (a subclass) on SIGINT or
            SIGTERM: the sweep's runs are marked KILLED, and the same call with `resume=True` continues it.
    """
    from nas.space import load_spec as _load

    path = _path(path, "sweep(path)")
    return run_spec(_load(path, overrides=override_items(overrides)), path, address=address, resume=resume)


def run_spec(spec: "SweepSpec", path: str | Path, *, address: str | None = None,
             resume: bool = False) -> "SweepResult":
    """`sweep` of a loaded spec (`nas sweep`, which loads it from a YAML or from a sweep's saved copy):
    its backends checked first (`nas.preflight.check_backends`), then `nas.search.run_sweep`.

    Raises:
        BackendError: the tracking store, the Optuna storage or the Ray address does not answer (nothing
            started). NasError: bad input. SweepFailed: every trial failed.
    """
    from nas.preflight import check_backends
    from nas.search import run_sweep

    check_backends(spec, address)
    return run_sweep(spec, path, address=address, resume=resume, latency_runner=latency_runner(spec))


def latency_runner(spec: "SweepSpec"):
    """The engine of `search.latency_engine` as the search layer takes it (a runner factory, or None for PyTorch):
    `nas.export.latency_engine.onnx_runner` for `onnxruntime`. It lives in the export layer, above the search, so
    the layer that starts a sweep, a retrain or a predictor fit hands it down."""
    if spec.search.latency_engine == "onnxruntime":
        from nas.export.latency_engine import onnx_runner

        return onnx_runner
    return None


def train(spec: "str | Path | SweepSpec", out_dir: str | Path | None = None, *,
          overrides: Mapping[str, object] | None = None, progress: bool | None = None) -> "TrainResult":
    """Train the sweep's supernet without Ray (resuming from its checkpoint), tracked as one MLflow run
    with one nested run per training stage (`nas train`).

    Args:
        spec: the sweep YAML or its loaded spec.
        out_dir: the checkpoint folder (default `<workdir>/<name>/supernet`).
        overrides: with a YAML path: dotted keys to values, as `nas train --set` (`{"train.steps": 2}`).
        progress: show a progress bar (default: when stderr is a terminal).

    Raises:
        SpecError: bad input (`overrides` with a loaded spec too). RunLockedError: another process (a sweep, `nas train`) writes into the run
            folder `<workdir>/<name>`, or into `out_dir` when it lies outside that folder; nothing is written.
    """
    from nas.locks import lock_folder, run_lock
    from nas.space import SweepSpec

    items = override_items(overrides)
    if isinstance(spec, (str, Path)):
        from nas.space import load_spec as _load

        spec = _load(spec, check_predictor=False, overrides=items)  # the predictor is used by sweeps only
    elif not isinstance(spec, SweepSpec):
        raise NasError(f"train(spec): expected a YAML path or a loaded spec (nas.load_spec), got {type(spec).__name__}")
    elif items:
        raise NasError("train(spec, overrides=...): overrides apply to a YAML path; pass the path, or change the "
                       "loaded spec with spec.model_copy(update=...)")
    target = Path(out_dir) if out_dir is not None else spec.run_dir / "supernet"
    from nas.preflight import check_tracking_store

    check_tracking_store(read_only=False)  # a server or database that refuses: one line, within seconds
    with run_lock(lock_folder(spec.run_dir, target), f"nas train {spec.name}"):  # before anything is written
        return _train_locked(spec, target, progress)


def _train_locked(spec: "SweepSpec", target: Path, progress: bool | None) -> "TrainResult":
    from nas import tracking
    from nas.builders import prepare_sweep_data
    from trainers import train_supernet

    data = prepare_sweep_data(spec)
    for stale in tracking.find_tagged_runs(spec.experiment, {"nas.role": "supernet",
                                                             "nas.supernet_dir": str(target.resolve())},
                                           status="RUNNING"):  # left by a killed `nas train` of this folder
        for child in tracking.find_tagged_runs(spec.experiment, {"mlflow.parentRunId": stale.info.run_id},
                                               status="RUNNING"):
            tracking.end_run(child.info.run_id, "KILLED")
        tracking.end_run(stale.info.run_id, "KILLED")
    run = tracking.start_run(spec.experiment, f"{spec.name}-supernet", role="supernet",
                             tags={"nas.supernet_dir": str(target.resolve()),
                                   "nas.data_dir": str(Path(data.root).resolve())},
                             params=spec.redact({"supernet": spec.supernet.model_dump(mode="json"),
                                                 "train": spec.train.model_dump(mode="json")}))
    stages = tracking.StageRuns(spec.experiment, run)  # one nested run per training stage
    try:
        result = train_supernet(spec, data, target, report=stages, progress=progress)
    except BaseException:
        stages.close("FAILED")
        tracking.end_run(run, "FAILED")
        raise
    stages.close()
    tracking.log_supernet_files(run, target, data.root)  # so `nas export` works from any machine (MLflow)
    tracking.end_run(run)
    return result


def retrain(spec: "str | Path | SweepSpec", *, run_id: str | None = None, best: bool = False,
            arch: str | None = None, out_dir: str | Path | None = None, experiment: str | None = None,
            metric: str = "bleu", where: Sequence[str] = (), progress: bool | None = None) -> "RetrainResult":
    """Train one sub-Transformer alone with the YAML's `retrain:` recipe, resumably, tracked as an MLflow run with
    tag `nas.role=retrain` (`nas retrain`; `nas.retraining.retrain`).

    Args:
        spec: the sweep YAML or its loaded spec.
        run_id: a FINISHED trial run (a unique prefix of its id is enough); or `best`: the best trial by
            `metric` meeting its sweep's constraints (and `where`) in `experiment` (default the YAML's); or
            `arch`: a hand-designed arch (summary string, JSON or an `arch.json` path). Exactly one.
        out_dir: default `<workdir>/<name>/retrain/<arch_id>-<init>-seed<seed>`.
        progress: a progress bar (default: when stderr is a terminal).

    Raises:
        NasError: bad input (names it; nothing is written). RunLockedError: another process writes the folder.
    """
    from nas.retraining import retrain as _retrain

    if isinstance(spec, (str, Path)):
        from nas.space import load_spec as _load

        spec = _load(spec, check_predictor=False)  # the predictor is used by sweeps only
    return _retrain(spec, run_id=run_id, best=best, arch=arch, out_dir=out_dir, experiment=experiment,
                    metric=metric, where=tuple(where), progress=progress, latency_runner=latency_runner(spec))


def leaderboard(experiment: str | None = None, *, metric: str = "bleu", top: int = 10, sweep_id: str | None = None,
                status: str = "FINISHED", where: Sequence[str] = (), include_infeasible: bool = False,
                pareto: bool = False, objectives: str | None = None) -> "pandas.DataFrame":
    """The best trials of an MLflow experiment as a pandas DataFrame (`nas leaderboard`), best first.

    One row a trial, one column a `nas.tracking.LeaderboardRow` field: `run_id`, `arch`, `bleu`,
    `chrf` (0-100), `params_m` (millions), `latency_ms` (ms), `valid_loss` (nats per token), `sweep_id`,
    `arch_id`, `pareto`, `feasible`, `latency_ratio`, the retrained scores beside the inherited ones
    (`retrain_bleu`, ..., where `nas retrain` trained the trial's arch), and `point`: the name of the
    `search.points_to_evaluate` entry a trial was started from (your own arch, e.g. `tiny`), else None.

    Args:
        experiment: default: the newest sweep's.
        metric: the ranking metric (`bleu`, `chrf`, `valid_loss`, `params_m`, `latency_ms`).
        where: constraints `METRIC OP NUMBER` (`"latency_ms<=40"`), all of which must hold.
        include_infeasible: also rank trials that break their sweep's `search.constraints`.
        pareto: mark the trials on the Pareto front of `objectives` (default `bleu:max,latency_ms:min`, or
            the sweep's with `sweep_id`) in the `pareto` column.

    Raises:
        NasError: an unknown metric, status, constraint or experiment; no sweep in the tracking store.
    """
    import dataclasses

    import pandas as pd

    from nas import tracking

    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise NasError(f"leaderboard(top={top!r}): expected a positive int")
    if isinstance(where, str):
        where = (where,)
    _, board = ranked_board(experiment, metric=metric, top=top, sweep_id=sweep_id, status=status, where=tuple(where),
                            include_infeasible=include_infeasible, pareto=pareto, objectives=objectives)
    columns = [f.name for f in dataclasses.fields(tracking.LeaderboardRow)]
    return pd.DataFrame([dataclasses.asdict(r) for r in board.rows], columns=columns)


def ranked_board(experiment: str | None = None, **filters: object) -> "tuple[str, Board]":
    """`(experiment, board)`: the tracking store checked read-only (one line within seconds when it does not
    answer; nothing is created), the experiment defaulted to the newest sweep's, then
    `nas.tracking.ranked_rows(experiment, **filters, explain=True)` (`nas leaderboard`, `nas.leaderboard`).

    Raises:
        BackendError: the store does not answer. NasError: no sweep in the store, a bad filter.
    """
    from nas import tracking
    from nas.preflight import check_tracking_store

    check_tracking_store(read_only=True)
    experiment = experiment or tracking.latest_experiment()
    return experiment, tracking.ranked_rows(experiment, explain=True, **filters)


def sweep_spec(path: str | Path | None, name: str | None = None, *, workdir: str | Path = "nas_runs",
               check_files: bool = True, overrides: Sequence[str] = ()) -> "SweepSpec":
    """The spec of the sweep YAML `path` (whose `name` must be `name` if given), else of the sweep `name`
    in `workdir`: the copy of its YAML saved when it started (`--set` overrides included), with
    `overrides` (`KEY.PATH=VALUE` items) on top (`nas sweep [FILE] --resume/--status NAME`).

    Without `path`, the copy's relative paths (data files, `workdir`, ...) are read against the folder the
    sweep started in, and, unless `MLFLOW_TRACKING_URI` is set, it is set to that folder's
    `sqlite:///.../mlflow.db` (the store the sweep started with); the current folder is not changed.

    Raises:
        SpecError: an unreadable YAML or sweep record; NasError: neither `path` nor `name`, a name that
            differs from the YAML's, no sweep `name` in `workdir`, its start folder gone.
    """
    import os

    from nas.search import SPEC_COPY, read_sweep_record
    from nas.space import load_spec as _load

    if path is not None:
        spec = _load(path, check_files=check_files, overrides=tuple(overrides))
        if name and spec.name != name:
            raise NasError(f"{path}: name is {spec.name!r}, not {name!r}; pass the YAML of sweep {name!r} or "
                           "leave FILE out")
        return spec
    if not name:
        raise NasError("pass a sweep YAML (nas sweep FILE), or --resume NAME / --status NAME")
    workdir = Path(workdir)
    record = read_sweep_record(workdir / name)
    if record is None:
        raise NasError(f"no sweep named {name!r} in {workdir} (no {workdir / name / 'sweep.json'}); pass its YAML "
                       f"(nas sweep FILE --resume {name}) or --workdir DIR")
    start = Path(record.cwd)
    if not start.is_dir():
        raise NasError(f"sweep {name!r} started in {start}, which is not available here; pass its YAML: "
                       f"nas sweep FILE --resume {name}")
    spec = _load(workdir / name / SPEC_COPY, check_files=check_files, overrides=tuple(overrides), base_dir=start)
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{(start / 'mlflow.db').resolve()}"
    return spec


def average_checkpoints(supernet_dir: str | Path, last: int, out_dir: str | Path) -> Path:
    """Average the weights of the newest `last` training snapshots of `supernet_dir` into the new folder
    `out_dir` (`nas average`; fairseq's `average_checkpoints`, `trainers.average.average_checkpoints`).

    Raises:
        NasError: fewer snapshots than `last`; `out_dir` holds files (nothing is written).
    """
    from trainers.average import average_checkpoints as _average

    return _average(_path(supernet_dir, "average_checkpoints(supernet_dir)"), last,
                    _path(out_dir, "average_checkpoints(out_dir)"))


def load_export(directory: str | Path) -> "Exported":
    """Load a folder written by `nas export` (no supernet needed); `.translate(sentences)` on it.

    Raises:
        NasError: `directory` is not a path; MissingFileError: the folder or a file of the export is missing;
            DamagedFileError: a file is truncated or invalid (each names the file).
    """
    from nas.export import load_export as _load

    if not isinstance(directory, (str, Path)):
        raise NasError(f"load_export(directory): expected a folder path (str or Path), got {type(directory).__name__}")
    return _load(directory)


def translate(export: "str | Path | Exported", sentences: Sequence[str], *, beam_size: int | None = None) -> list[str]:
    """Detokenized translations of raw source sentences with an exported sub-Transformer (beam search).

    Args:
        export: an export folder, or what `load_export` returned (load once, translate often).
        sentences: raw source sentences.
        beam_size: default: the export's.

    Raises:
        NasError: `sentences` is a string (pass a list of sentences) or holds a non-string; the export is
            missing or damaged (`load_export`).
    """
    if isinstance(sentences, (str, bytes)):
        raise NasError("translate(export, sentences): sentences is one string; pass a list of sentences, e.g. "
                       f"[{sentences[:40]!r}]")
    sentences = list(sentences)
    bad = next((i for i, s in enumerate(sentences) if not isinstance(s, str)), None)
    if bad is not None:
        raise NasError(f"translate(export, sentences): sentences[{bad}] is a {type(sentences[bad]).__name__}, not a "
                       f"string")
    model = load_export(export) if isinstance(export, (str, Path)) else export
    return model.translate(list(sentences), beam_size=beam_size)
