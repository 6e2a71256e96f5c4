"""Checkpoint averaging: model-only snapshots written during training and their element-wise mean.

The trainer writes ``snapshots/step_{step:08d}.safetensors`` beside each checkpoint and keeps
the newest ``train.keep_last``; :func:`average_checkpoints` averages the newest ``last`` of
them into a new, loadable supernet folder. This is fairseq's ``scripts/average_checkpoints.py``
(``--num-update-checkpoints``) and the "average of the last checkpoints" of Vaswani et al.
2017, sec. 6.1 (last 5 for base models, last 20 for big ones, written every 10 minutes);
Scalable Transformers (sec. 4.2, "Advantages of type-2 ST") compare their best sub-Transformer
with an average of 10 checkpoints of an independently trained widest Transformer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nas.errors import NasError
from nas.atomic import atomic_path, atomic_write_text

__all__ = ["average_snapshots", "latest_snapshots", "average_checkpoints", "save_snapshot", "prune_snapshots",
           "snapshot_step", "SNAPSHOTS"]

SNAPSHOTS = "snapshots"
"""Subfolder of a supernet folder that holds the snapshots."""
SUPERNET = "supernet"
_STEP_FILE = re.compile(r"^step_(\d{8,})\.safetensors$")


def snapshot_step(path: Path) -> int:
    """The optimizer step in a snapshot's file name (``step_00001000.safetensors`` -> 1000).

    Raises:
        ValueError: the name is not ``step_<8+ digits>.safetensors``.
    """
    match = _STEP_FILE.match(Path(path).name)
    if match is None:
        raise NasError(f"{path} is not a snapshot file (expected step_<8 digits>.safetensors)")
    return int(match.group(1))


def save_snapshot(state_dict: dict[str, torch.Tensor], folder: Path, step: int, config: dict) -> Path:
    """Write ``folder/step_{step:08d}.safetensors`` (weights only) through a temporary file and ``os.replace``.

    The model's constructor ``config`` is stored as JSON in the safetensors metadata, so a
    snapshot can be averaged before training has written ``supernet.json``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:08d}.safetensors"
    with atomic_path(path) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()}, str(tmp),
                  metadata={"step": str(step), "config": json.dumps(config, sort_keys=True)})
    return path


def _snapshots(folder: Path) -> list[Path]:
    """Snapshot files in ``folder``, oldest step first (none when the folder is missing)."""
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if _STEP_FILE.match(p.name)), key=snapshot_step)


def prune_snapshots(folder: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest snapshots in ``folder``; returns the deleted paths."""
    found = _snapshots(folder)
    doomed = found[:max(len(found) - keep, 0)]
    for path in doomed:
        path.unlink(missing_ok=True)
    return doomed


def latest_snapshots(folder: str | Path, n: int) -> list[Path]:
    """The ``n`` newest ``step_*.safetensors`` files in ``folder``, oldest step first.

    Raises:
        ValueError: ``n < 1``, or the folder holds fewer than ``n`` snapshots (names the
            folder and how many it holds).
    """
    folder = Path(folder)
    if n < 1:
        raise NasError(f"number of snapshots to average must be >= 1, got {n}")
    found = _snapshots(folder)
    if len(found) < n:
        raise NasError(f"{folder} holds {len(found)} snapshot(s) (step_*.safetensors), fewer than the {n} requested; "
                         f"the trainer writes one every train.checkpoint_every steps and keeps train.keep_last")
    return found[-n:]


def average_snapshots(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Element-wise mean of the tensors of several safetensors files (fairseq ``average_checkpoints``).

    Each tensor is summed in float32, divided by ``len(paths)`` and cast back to its dtype
    in the first file; shapes are unchanged. One file is held in memory at a time besides
    the float32 sums.

    Raises:
        ValueError: ``paths`` is empty, or a file's tensor names or shapes differ from the
            first file's (names that file and the tensor).
    """
    if not paths:
        raise NasError("no snapshot files to average")
    first = Path(paths[0])
    reference = load_file(str(first))
    dtypes = {name: t.dtype for name, t in reference.items()}
    sums = {name: t.to(torch.float32) for name, t in reference.items()}
    del reference
    for path in paths[1:]:
        tensors = load_file(str(path))
        if tensors.keys() != sums.keys():
            missing, extra = sorted(sums.keys() - tensors.keys()), sorted(tensors.keys() - sums.keys())
            raise NasError(f"{path}: tensor names differ from {first}: missing {missing[:3]}, "
                             f"unexpected {extra[:3]}")
        for name, tensor in tensors.items():
            if tensor.shape != sums[name].shape:
                raise NasError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)} "
                                 f"but {tuple(sums[name].shape)} in {first}")
            sums[name] += tensor.to(torch.float32)
    return {name: (total / len(paths)).to(dtypes[name]) for name, total in sums.items()}


def _config_text(supernet_dir: Path, newest: Path) -> str:
    """The supernet's constructor config: ``supernet.json`` if training finished, else the snapshot's metadata."""
    stored = supernet_dir / f"{SUPERNET}.json"
    if stored.is_file():
        return stored.read_text(encoding="utf-8")
    with safe_open(str(newest), framework="pt") as f:
        config = (f.metadata() or {}).get("config")
    if config is None:
        raise FileNotFoundError(f"no {stored} and no config in the metadata of {newest}; cannot rebuild the supernet")
    return json.dumps(json.loads(config), indent=2)


def average_checkpoints(supernet_dir: str | Path, last: int, out_dir: str | Path) -> Path:
    """Average the ``last`` newest snapshots of a trained supernet into a new supernet folder.

    Writes ``out_dir/supernet.safetensors`` (the mean weights, see :func:`average_snapshots`),
    ``out_dir/supernet.json`` (the same constructor config, so ``load_model(out_dir,
    "supernet")`` and ``nas export`` read it) and ``out_dir/average.json`` (the source folder,
    steps and files averaged). Everything is written to a temporary folder beside
    ``out_dir`` and renamed into place, so ``out_dir`` is complete or absent.

    Raises:
        FileNotFoundError: ``supernet_dir`` is not a folder, or it has no config.
        FileExistsError: ``out_dir`` is a file or a folder that is not empty.
        ValueError: fewer than ``last`` snapshots, or snapshots that disagree (see
            :func:`latest_snapshots`, :func:`average_snapshots`).
    """
    supernet_dir, out_dir = Path(supernet_dir), Path(out_dir)
    if not supernet_dir.is_dir():
        raise FileNotFoundError(f"supernet folder not found: {supernet_dir}")
    if out_dir.is_file() or (out_dir.is_dir() and any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} already exists and is not empty; pass another --out or delete it")
    paths = latest_snapshots(supernet_dir / SNAPSHOTS, last)
    config = _config_text(supernet_dir, paths[-1])
    weights = average_snapshots(paths)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.", suffix=".tmp"))
    try:
        save_file(weights, str(tmp / f"{SUPERNET}.safetensors"))
        atomic_write_text(tmp / f"{SUPERNET}.json", config)
        provenance = {"source": str(supernet_dir.resolve()), "steps": [snapshot_step(p) for p in paths],
                      "files": [p.name for p in paths]}
        atomic_write_text(tmp / "average.json", json.dumps(provenance, indent=2))
        if out_dir.is_dir():
            out_dir.rmdir()  # empty (checked above); os.replace onto a folder needs it gone
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
