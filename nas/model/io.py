"""Model files: ``<name>.safetensors`` (weights) + ``<name>.json`` (constructor config), a pair that a crash
cannot mismatch.

Each file is written atomically (:mod:`nas.atomic`), but the two are replaced one after the other, so a crash
between the two writes would leave new weights beside an old config. The weights therefore carry their
own config in the safetensors metadata (key ``config``, as the training snapshots do) and are written
first; :func:`load_model` compares it with ``<name>.json`` and refuses a pair that disagrees
(:class:`ModelFileError`) instead of building one architecture and loading another's weights. A crash
leaves the old pair, new weights beside an old but equal config (consistent), or a refused pair; never a
silently mismatched one. A swap of a whole folder would be atomic too, but the pair shares its folder with
other files (a supernet folder holds checkpoints and metrics).
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from nas.errors import DamagedFileError, MissingFileError, NasError
from nas.atomic import atomic_path, atomic_write_text
from nas.model.supernet import SuperTransformer

__all__ = ["ModelFileError", "save_model", "load_model"]

CONFIG_KEY = "config"
"""The safetensors metadata key holding the constructor config (JSON)."""


class ModelFileError(DamagedFileError):
    """A model folder's weights and config do not belong together (a save was interrupted); names both files."""


def save_model(model: SuperTransformer, directory: str | Path, name: str = "model") -> Path:
    """Write ``<name>.safetensors`` (with the config in its metadata), then ``<name>.json`` into ``directory``.

    Returns the weights file. See the module docstring for why a crash between the two writes is detected.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = json.dumps(model.config(), indent=2)
    weights = directory / f"{name}.safetensors"
    with atomic_path(weights) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(tmp),
                  metadata={CONFIG_KEY: config})
    atomic_write_text(directory / f"{name}.json", config)
    return weights


def load_model(directory: str | Path, name: str = "model") -> SuperTransformer:
    """Rebuild a model written by :func:`save_model`, in eval mode.

    Raises:
        MissingFileError: the weights or config file is missing (names it; also a FileNotFoundError).
        ModelFileError: the config embedded in the weights differs from ``<name>.json`` (an interrupted save), the
            config is not JSON or not a model's, or the weights are unreadable (truncated) or do not fit the config
            (names the file).
    """
    directory = Path(directory)
    config, weights = directory / f"{name}.json", directory / f"{name}.safetensors"
    for f in (config, weights):
        if not f.is_file():
            raise MissingFileError(f"model file not found: {f}")
    again = "write it again with the command that made it (nas export, nas train, nas retrain)"
    try:
        stored = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{config} is not valid JSON ({e}); {again}") from None
    try:
        with safe_open(str(weights), framework="pt") as f:
            embedded = (f.metadata() or {}).get(CONFIG_KEY)  # None: written before configs were embedded
        tensors = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelFileError(f"{weights} is unreadable, likely truncated ({e}); {again}") from None
    embedded = None if embedded is None else json.loads(embedded)
    if embedded is not None and embedded != stored:
        changed = sorted(k for k in {**stored, **embedded} if stored.get(k) != embedded.get(k))
        raise ModelFileError(f"{weights} and {config} do not belong together (they differ in {', '.join(changed)}): "
                             "a save into that folder was interrupted; run the command that wrote it again")
    try:
        model = SuperTransformer.from_config(stored)
        model.load_state_dict(tensors)
    except (TypeError, KeyError, ValueError, RuntimeError) as e:  # a config of no model, weights of another shape
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelFileError(f"{weights} and {config} do not make a model ({first}); {again}") from None
    return model.eval()
