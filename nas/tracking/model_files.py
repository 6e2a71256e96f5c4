"""The trained supernet and its data files as MLflow artifacts, so any machine that reaches MLflow can export.

A sweep (and ``nas train``) logs, once, into its supernet run's artifacts under :data:`SUPERNET_ARTIFACTS`:
``supernet.safetensors`` and ``supernet.json`` (the weights and the constructor config,
:mod:`nas.model.io`), ``spm.model`` (the SentencePiece model) and ``valid.parquet`` (the validation sentences
that ``nas export --onnx`` / ``--ctranslate2`` check on). :func:`trial_model_files` finds them for a trial run:
the local folders its ``nas.supernet_dir`` / ``nas.data_dir`` tags name when they hold the files (the machine
that ran the sweep), else the artifacts of the sweep's supernet run, downloaded through MLflow (a laptop reading
a cluster's tracking server, proxied artifacts included).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlflow.entities import Run

from nas.errors import NotFoundError
from nas.tracking.layout import TAG_PARENT, TAG_ROLE
from nas.tracking.runs import find_tagged_runs, get_client

__all__ = ["DATA_FILES", "SUPERNET_ARTIFACTS", "SUPERNET_FILES", "ModelFiles", "log_supernet_files",
           "trial_model_files"]

SUPERNET_ARTIFACTS = "supernet"
"""The artifact folder of a supernet run that holds the files below."""
SUPERNET_FILES = ("supernet.safetensors", "supernet.json")
DATA_FILES = ("spm.model", "valid.parquet")
SUPERNET_EXTRAS = ("sample_counts.json",)
"""Files of the supernet's folder logged when present: how often each (layer, dimension, value) trained."""


def log_supernet_files(run_id: str, supernet_dir: str | Path, data_dir: str | Path) -> list[str]:
    """Upload the supernet's and the data's files (those not already there) to ``run_id``'s artifacts under
    :data:`SUPERNET_ARTIFACTS`; returns the names uploaded. The weights go first and the config last, so a
    folder interrupted mid-way never holds a config without its weights.

    Raises:
        FileNotFoundError: the supernet files are missing from ``supernet_dir`` (training did not finish).
        mlflow.MlflowException: store errors.
    """
    client = get_client()
    have = {Path(a.path).name for a in client.list_artifacts(run_id, SUPERNET_ARTIFACTS)}
    files = [Path(supernet_dir) / name for name in SUPERNET_FILES]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"the trained supernet is missing: {', '.join(missing)}")
    files += [Path(supernet_dir) / name for name in SUPERNET_EXTRAS if (Path(supernet_dir) / name).is_file()]
    files += [Path(data_dir) / name for name in DATA_FILES if (Path(data_dir) / name).is_file()]
    uploaded = []
    for path in files:
        if path.name not in have:
            client.log_artifact(run_id, str(path), SUPERNET_ARTIFACTS)
            uploaded.append(path.name)
    return uploaded


@dataclass(frozen=True)
class ModelFiles:
    """Where a trial's supernet and data files are on this machine.

    Attributes:
        supernet_dir: holds ``supernet.safetensors`` and ``supernet.json``.
        spm_model: the SentencePiece model.
        valid: the validation Parquet file (``src_text`` column), or None when the sweep logged none.
        source: ``"local"`` (the folders the tags name) or ``"mlflow"`` (downloaded from run ``run_id``).
        run_id: the supernet run the files were downloaded from (None when local).
    """

    supernet_dir: Path
    spm_model: Path
    valid: Path | None
    source: str
    run_id: str | None = None


def _local(run: Run) -> ModelFiles | None:
    tags = run.data.tags
    supernet_dir, data_dir = tags.get("nas.supernet_dir"), tags.get("nas.data_dir")
    if not supernet_dir or not data_dir:
        return None
    supernet_dir, data_dir = Path(supernet_dir), Path(data_dir)
    if not all((supernet_dir / name).is_file() for name in SUPERNET_FILES) or not (data_dir / "spm.model").is_file():
        return None
    valid = data_dir / "valid.parquet"
    return ModelFiles(supernet_dir, data_dir / "spm.model", valid if valid.is_file() else None, "local")


def _supernet_runs(run: Run) -> list[Run]:
    """The supernet runs of ``run``'s sweep (children of its parent run), finished first."""
    parent = run.data.tags.get(TAG_PARENT)
    if not parent:
        return []
    experiment = get_client().get_experiment(run.info.experiment_id).name
    runs = find_tagged_runs(experiment, {TAG_PARENT: parent, TAG_ROLE: "supernet"})
    return sorted(runs, key=lambda r: r.info.status != "FINISHED")


def trial_model_files(run: Run, download_to: str | Path) -> ModelFiles:
    """The supernet and data files of trial ``run``: local when its tags' folders hold them, else downloaded from
    its sweep's supernet run into ``download_to`` (an existing folder the caller owns and cleans up).

    Raises:
        NotFoundError: neither the local folders nor any supernet run's artifacts hold them (names the folder
            and what to do).
        mlflow.MlflowException: store errors while downloading.
    """
    local = _local(run)
    if local is not None:
        return local
    client = get_client()
    for supernet_run in _supernet_runs(run):
        run_id = supernet_run.info.run_id
        names = {Path(a.path).name for a in client.list_artifacts(run_id, SUPERNET_ARTIFACTS)}
        if not set(SUPERNET_FILES) | {"spm.model"} <= names:
            continue
        folder = Path(client.download_artifacts(run_id, SUPERNET_ARTIFACTS, str(download_to)))
        valid = folder / "valid.parquet"
        return ModelFiles(folder, folder / "spm.model", valid if valid.is_file() else None, "mlflow", run_id)
    raise NotFoundError(
        f"the supernet of run {run.info.run_id} is neither in {run.data.tags.get('nas.supernet_dir', '(no tag)')} "
        f"on this machine nor in the artifacts of its sweep's supernet run (sweeps log it there since this "
        f"version); export on the machine that ran the sweep, or run the sweep again to log it")
