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
from nas.tracking.layout import TAG_PARENT, TAG_RETRAIN_DIR, TAG_ROLE, TAG_SWEEP_ID
from nas.tracking.runs import find_tagged_runs, get_client

__all__ = ["DATA_FILES", "SUPERNET_ARTIFACTS", "SUPERNET_FILES", "RETRAIN_ARTIFACTS", "RETRAIN_FILES", "ModelFiles",
           "log_supernet_files", "log_retrain_files", "trial_model_files", "retrained_model_files", "model_run_problem"]

SUPERNET_ARTIFACTS = "supernet"
"""The artifact folder of a supernet run that holds the files below."""
SUPERNET_FILES = ("supernet.safetensors", "supernet.json")
DATA_FILES = ("spm.model", "valid.parquet")
RETRAIN_ARTIFACTS = "model"
"""The artifact folder of a retrain run (``nas.role=retrain``) that holds :data:`RETRAIN_FILES`."""
RETRAIN_FILES = ("model.safetensors", "model.json", "arch.json", "spm.model")
"""A retrained sub-Transformer: weights, constructor config, arch and SentencePiece model."""
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


def log_retrain_files(run_id: str, folder: str | Path) -> None:
    """Upload a retrain folder's :data:`RETRAIN_FILES` to ``run_id``'s artifacts under :data:`RETRAIN_ARTIFACTS`
    (the weights first, the arch last: a folder interrupted mid-way is recognisably incomplete).

    Raises:
        FileNotFoundError: a file is missing (names it). mlflow.MlflowException: store errors.
    """
    files = [Path(folder) / name for name in RETRAIN_FILES]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"the retrained model is incomplete: {', '.join(missing)} missing")
    client = get_client()
    for path in files:
        client.log_artifact(run_id, str(path), RETRAIN_ARTIFACTS)


def retrained_model_files(run: Run, download_to: str | Path) -> Path:
    """The folder holding retrain ``run``'s :data:`RETRAIN_FILES`: the local one its ``nas.retrain_dir`` tag names
    when it holds them, else its artifacts downloaded into ``download_to`` (a folder the caller owns).

    Raises:
        NotFoundError: neither holds them (names the folder and the run).
    """
    local = Path(run.data.tags.get(TAG_RETRAIN_DIR, "")) if run.data.tags.get(TAG_RETRAIN_DIR) else None
    if local is not None and all((local / name).is_file() for name in RETRAIN_FILES):
        return local
    client = get_client()
    names = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, RETRAIN_ARTIFACTS)}
    if not set(RETRAIN_FILES) <= names:
        raise NotFoundError(f"the retrained weights of run {run.info.run_id} are neither in {local or '(no tag)'} "
                            f"on this machine nor in its artifacts ({RETRAIN_ARTIFACTS}/); run `nas retrain` again")
    return Path(client.download_artifacts(run.info.run_id, RETRAIN_ARTIFACTS, str(download_to)))


def model_run_problem(run: Run, roles: tuple[str, ...] = ("trial", "retrain")) -> str | None:
    """Why ``run`` cannot give a model (None when it can): it must be a FINISHED run of one of ``roles`` (a
    search trial, scored with inherited weights, or a retrained sub-Transformer). The text names what the run
    is and the kind of run to pass instead (with the ``nas leaderboard`` command that lists them)."""
    tags, run_id = run.data.tags, run.info.run_id
    role, status = tags.get(TAG_ROLE), run.info.status
    if role in roles and status == "FINISHED":
        return None
    sweep_id = tags.get(TAG_SWEEP_ID)
    if sweep_id is None and tags.get(TAG_PARENT):
        try:
            sweep_id = get_client().get_run(tags[TAG_PARENT]).data.tags.get(TAG_SWEEP_ID)
        except Exception:  # a deleted parent: the message names no sweep
            sweep_id = None
    leaderboard = f"nas leaderboard --sweep {sweep_id}" if sweep_id else "nas leaderboard"
    of_sweep = f" of sweep {sweep_id}" if sweep_id else ""
    if role in roles:
        return (f"run {run_id} is a {status} {role}{of_sweep}, which has no finished model; pass the run id of a "
                f"FINISHED trial ({leaderboard}) or --best")
    what = {"sweep": f"the parent run{of_sweep}", "supernet": f"the supernet training run{of_sweep}",
            "stage": f"a supernet training stage run{of_sweep}", "export": "an export run",
            "trial": f"a trial{of_sweep}", "retrain": "a retrain run"}.get(
        role, f"a run of role {role!r}" if role else "not a nas trial run (no nas.role tag)")
    kinds = " or a ".join(f"{r} run" if r != "trial" else r for r in roles)
    trial = "one of its FINISHED trials" if role == "sweep" else "a FINISHED trial"
    return f"run {run_id} is {what}, not a {kinds}; pass the run id of {trial} ({leaderboard}) or --best"
