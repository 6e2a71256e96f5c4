"""Export a sub-Transformer to standalone files, load it back, translate with it.

An export folder holds exactly what translation needs, and nothing of the supernet:

- ``model.safetensors`` - the cropped weights (``extract(arch)``),
- ``model.json`` - the constructor config (its maxima are the arch),
- ``arch.json`` - the architecture, ``spm.model`` - the SentencePiece model,
- ``export.json`` - provenance (MLflow run id, metrics, beam size); it also marks the folder as an export,
  which a later export may replace without ``--force``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nas.data import Tokenizer
from nas.eval.scores import translate
from nas.errors import ArchError, DamagedFileError, MissingFileError
from nas.atomic import atomic_write_text, output_dir
from nas.model.io import load_model, save_model
from nas.model.supernet import SuperTransformer, extract
from nas.space.arch import Arch

__all__ = ["export_arch", "load_export", "Exported", "PROVENANCE"]

PROVENANCE = "export.json"
"""The provenance file every export folder (ONNX ones too) holds: the marker of an earlier export."""


@dataclass(frozen=True)
class Exported:
    model: SuperTransformer
    tokenizer: Tokenizer
    arch: Arch
    beam_size: int

    @property
    def max_src_tokens(self) -> int:
        """The longest source the model reads (SentencePiece pieces); :meth:`translate` cuts longer ones to this."""
        return self.model.max_positions // 2 - 1  # then EOS, as nas.eval.scores.encode_sources does

    def too_long(self, sentences: list[str]) -> list[int]:
        """Indices of the sentences longer than :attr:`max_src_tokens` pieces, which :meth:`translate` truncates."""
        return [i for i, ids in enumerate(self.tokenizer.encode(sentences)) if len(ids) > self.max_src_tokens]

    def translate(self, sentences: list[str], beam_size: int | None = None, *, max_tokens: int | None = None,
                  batch_size: int = 64, on_batch: Callable[[int, int], None] | None = None) -> list[str]:
        """Detokenized translations of raw source sentences (each cut to :attr:`max_src_tokens` pieces), in input
        order; batching and ``on_batch`` as in :func:`nas.eval.scores.translate` (an empty line gives "")."""
        return translate(self.model, self.tokenizer, sentences, beam_size=beam_size or self.beam_size,
                         max_tokens=max_tokens, batch_size=batch_size, on_batch=on_batch)


def export_arch(supernet_dir: str | Path, spm_model: str | Path, arch: Arch, out: str | Path, *,
                beam_size: int = 4, provenance: dict | None = None, force: bool = False,
                model_name: str = "supernet") -> Path:
    """Crop ``arch`` out of the supernet saved in ``supernet_dir`` and write an export folder.

    ``model_name="model"`` reads a retrained sub-Transformer instead (``model.safetensors`` of a ``nas retrain``
    folder, whose maxima are ``arch``): the crop is then the whole model, its weights unchanged.

    The folder is written as a temporary sibling and swapped into place (:func:`nas.atomic.output_dir`), so an
    interrupted export leaves the earlier one whole. ``out`` may be new, empty or an earlier export (it
    holds :data:`PROVENANCE`); any other folder is replaced only with ``force``, and the current folder,
    its ancestors and the home folder never.

    Raises:
        FileNotFoundError: the supernet or SentencePiece file is missing (names it).
        ValueError: ``arch`` exceeds the supernet (names the choice).
        OutputPathError: ``out`` may not be replaced (names it and a few of its entries).
    """
    spm_model = Path(spm_model)
    if not spm_model.is_file():
        raise FileNotFoundError(f"SentencePiece model not found: {spm_model}")
    sub = extract(load_model(supernet_dir, model_name), arch)
    with output_dir(out, marker=PROVENANCE, force=force) as tmp:
        save_model(sub, tmp, "model")
        shutil.copyfile(spm_model, tmp / "spm.model")
        atomic_write_text(tmp / "arch.json", json.dumps(arch.to_dict(), indent=2))
        atomic_write_text(tmp / PROVENANCE, json.dumps({"beam_size": beam_size, **(provenance or {})}, indent=2))
    return Path(out)


def _json_file(path: Path) -> dict:
    """The JSON object in ``path``. Raises MissingFileError / DamagedFileError naming it."""
    if not path.is_file():
        raise MissingFileError(f"{path} is missing: the export is partial; export it again with `nas export`")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DamagedFileError(f"{path} is not valid JSON ({e}); export it again with `nas export`") from None
    if not isinstance(value, dict):
        raise DamagedFileError(f"{path} holds a JSON {type(value).__name__}, not an object; export it again with "
                               f"`nas export`")
    return value


def load_export(directory: str | Path) -> Exported:
    """Load an export folder written by :func:`export_arch` (no supernet needed).

    Raises:
        MissingFileError: the folder or a file of the export is missing (names it; also a FileNotFoundError).
        DamagedFileError: a file is unreadable: invalid JSON, truncated weights, an arch or SentencePiece model
            that cannot be read (names it).
    """
    directory = Path(directory)
    meta_file = directory / PROVENANCE
    if not meta_file.is_file():
        raise MissingFileError(f"{directory} is not a nas export (no {PROVENANCE}); create one with `nas export`")
    meta = _json_file(meta_file)
    model = load_model(directory, "model")
    try:
        arch = Arch.from_dict(_json_file(directory / "arch.json"))
    except ArchError as e:
        raise DamagedFileError(f"{directory / 'arch.json'} is no arch ({e}); export it again with `nas export`") \
            from None
    spm = directory / "spm.model"
    if not spm.is_file():
        raise MissingFileError(f"{spm} is missing: the export is partial; export it again with `nas export`")
    try:
        tokenizer = Tokenizer(spm)
        tokenizer.vocab_size  # loads the model: a damaged file fails here, not at the first sentence
    except (OSError, RuntimeError, ValueError) as e:  # DataError is a ValueError (NasError)
        raise DamagedFileError(f"{spm} is not a SentencePiece model; export it again with `nas export`") from e
    return Exported(model=model, tokenizer=tokenizer, arch=arch, beam_size=int(meta.get("beam_size", 4)))
