"""Model files: safetensors weights + JSON constructor config, each written atomically (:mod:`nas.io`)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from nas.io import atomic_path, atomic_write_text
from nas.model.supernet import SuperTransformer

__all__ = ["save_model", "load_model"]


def save_model(model: SuperTransformer, directory: str | Path, name: str = "model") -> Path:
    """Write ``<name>.safetensors`` and ``<name>.json`` (the constructor config) into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = directory / f"{name}.safetensors"
    with atomic_path(weights) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(tmp))
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
