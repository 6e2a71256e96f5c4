"""Model files: safetensors weights + JSON constructor config, written atomically."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file

from nas.model.supernet import SuperTransformer

__all__ = ["save_model", "load_model", "atomic_write_text", "atomic_write_bytes"]


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace`` (no torn files)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file and ``os.replace`` (mode 0644; no torn files).

    Returns ``path``. The temporary file is removed when the write fails.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save_model(model: SuperTransformer, directory: str | Path, name: str = "model") -> Path:
    """Write ``<name>.safetensors`` and ``<name>.json`` (the constructor config) into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = directory / f"{name}.safetensors"
    tmp = directory / f".{name}.safetensors.tmp"
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(tmp))
    os.replace(tmp, weights)
    atomic_write_text(directory / f"{name}.json", json.dumps(model.config(), indent=2))
    return weights


def load_model(directory: str | Path, name: str = "model") -> SuperTransformer:
    """Rebuild a model written by :func:`save_model`, in eval mode.

    Raises:
        FileNotFoundError: the weights or config file is missing (names it).
    """
    directory = Path(directory)
    config, weights = directory / f"{name}.json", directory / f"{name}.safetensors"
    for f in (config, weights):
        if not f.is_file():
            raise FileNotFoundError(f"model file not found: {f}")
    model = SuperTransformer.from_config(json.loads(config.read_text(encoding="utf-8")))
    model.load_state_dict(load_file(str(weights)))
    return model.eval()
