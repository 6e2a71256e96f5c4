"""The public Python API (what ``import nas`` offers in a notebook): the CLI's jobs as functions.

    import nas

    spec = nas.load_spec("search_spaces/quickstart.yaml")
    result = nas.sweep("search_spaces/quickstart.yaml")        # = nas sweep FILE
    trained = nas.train("search_spaces/quickstart.yaml")        # = nas train FILE
    done = nas.retrain("search_spaces/quickstart.yaml", arch="enc[128/256 128/256] dec[128/256 128/256]")
    model = nas.load_export("exported/")                        # a folder written by `nas export`
    nas.translate("exported/", ["A man is riding a bike ."])   # -> ["Ein Mann ..."]

Each function imports what it needs when called, so ``import nas`` loads no torch, Ray, Optuna or
MLflow. Bad input raises :class:`nas.errors.NasError` (its subclasses name the key or file).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from nas.errors import NasError

if TYPE_CHECKING:
    from nas.export import Exported
    from nas.retraining import RetrainResult
    from nas.search import SweepResult
    from nas.space import SweepSpec
    from trainers import TrainResult

__all__ = ["load_spec", "sweep", "train", "retrain", "load_export", "translate"]


def load_spec(path: str | Path, *, check_files: bool = True) -> "SweepSpec":
    """Read and validate a sweep YAML (``search_spaces/*.yaml``).

    Raises:
        SpecError: a bad key or value, a missing data file (names the key path and the fix).
    """
    from nas.space import load_spec as _load

    return _load(path, check_files=check_files)


def sweep(path: str | Path, *, address: str | None = None, resume: bool = False) -> "SweepResult":
    """Run (or continue) the sweep of a YAML: supernet, Optuna search through Ray Tune, MLflow runs.

    Args:
        path: the sweep YAML.
        address: a Ray cluster address (``auto``, ``ray://HOST:10001``); None starts a local Ray.
        resume: require an earlier start of this sweep (``nas sweep --resume``).

    Raises:
        SpecError: bad input (nothing is started). SweepFailed: every trial failed.
    """
    from nas.search import run_sweep

    return run_sweep(load_spec(path), path, address=address, resume=resume)


def train(spec: "str | Path | SweepSpec", out_dir: str | Path | None = None, *,
          progress: bool | None = None) -> "TrainResult":
    """Train the sweep's supernet without Ray (resuming from its checkpoint), tracked as one MLflow run
    with one nested run per training stage (``nas train``).

    Args:
        spec: the sweep YAML or its loaded spec.
        out_dir: the checkpoint folder (default ``<workdir>/<name>/supernet``).
        progress: show a progress bar (default: when stderr is a terminal).

    Raises:
        SpecError: bad input. RunLockedError: another process (a sweep, ``nas train``) writes into the run
            folder ``<workdir>/<name>``, or into ``out_dir`` when it lies outside that folder; nothing is written.
    """
    from nas.locks import lock_folder, run_lock

    if isinstance(spec, (str, Path)):
        from nas.space import load_spec as _load

        spec = _load(spec, check_predictor=False)  # the predictor is used by sweeps only
    target = Path(out_dir) if out_dir is not None else spec.run_dir / "supernet"
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
    """Train one sub-Transformer alone with the YAML's ``retrain:`` recipe, resumably, tracked as an MLflow run with
    tag ``nas.role=retrain`` (``nas retrain``; :func:`nas.retraining.retrain`).

    Args:
        spec: the sweep YAML or its loaded spec.
        run_id: a FINISHED trial run (a unique prefix of its id is enough); or ``best``: the best trial by
            ``metric`` meeting its sweep's constraints (and ``where``) in ``experiment`` (default the YAML's); or
            ``arch``: a hand-designed arch (summary string, JSON or an ``arch.json`` path). Exactly one.
        out_dir: default ``<workdir>/<name>/retrain/<arch_id>-<init>-seed<seed>``.
        progress: a progress bar (default: when stderr is a terminal).

    Raises:
        NasError: bad input (names it; nothing is written). RunLockedError: another process writes the folder.
    """
    from nas.retraining import retrain as _retrain

    if isinstance(spec, (str, Path)):
        from nas.space import load_spec as _load

        spec = _load(spec, check_predictor=False)  # the predictor is used by sweeps only
    return _retrain(spec, run_id=run_id, best=best, arch=arch, out_dir=out_dir, experiment=experiment,
                    metric=metric, where=tuple(where), progress=progress)


def load_export(directory: str | Path) -> "Exported":
    """Load a folder written by ``nas export`` (no supernet needed); ``.translate(sentences)`` on it.

    Raises:
        NasError: ``directory`` is not a path; MissingFileError: the folder or a file of the export is missing;
            DamagedFileError: a file is truncated or invalid (each names the file).
    """
    from nas.export import load_export as _load

    if not isinstance(directory, (str, Path)):
        raise NasError(f"load_export(directory): expected a folder path (str or Path), got {type(directory).__name__}")
    return _load(directory)


def translate(export: "str | Path | Exported", sentences: Sequence[str], *, beam_size: int | None = None) -> list[str]:
    """Detokenized translations of raw source sentences with an exported sub-Transformer (beam search).

    Args:
        export: an export folder, or what :func:`load_export` returned (load once, translate often).
        sentences: raw source sentences.
        beam_size: default: the export's.

    Raises:
        NasError: ``sentences`` is a string (pass a list of sentences) or holds a non-string; the export is
            missing or damaged (:func:`load_export`).
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
