"""An exported sub-Transformer as an MLflow model: source sentences in, translations out.

The model is an MLflow ``python_function`` (pyfunc) logged with *models from code*: a three-line
entry file that builds :class:`Translator`, the ``nas`` package as its code path (so a client needs
no ``nas`` install, only the pinned requirements), and the export folder of :mod:`nas.export.folder`
(``model.safetensors``, ``model.json``, ``arch.json``, ``spm.model``, ``export.json``) as the
artifact ``export_dir``. At load time only :func:`nas.export.load_export` runs: torch, safetensors,
SentencePiece (and sacrebleu/pyarrow through ``nas.data``/``nas.eval.scores``), never Ray or Optuna.

Usage once registered (``nas export ... --register NAME``)::

    model = mlflow.pyfunc.load_model("models:/NAME@champion")
    model.predict(["A man is riding a bike ."])                    # -> ["Ein Mann ..."]
    model.predict(pandas.DataFrame({"src": [...]}), params={"beam_size": 1})
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import mlflow
import mlflow.pyfunc

__all__ = ["CHAMPION", "EXPORT_FILES", "LoggedTranslator", "Translator", "log_translator", "pip_requirements"]

CHAMPION = "champion"
"""Registry alias set on the newest registered version."""
ARTIFACT = "export_dir"
"""Name of the export-folder artifact inside the MLflow model."""
MODEL_NAME = "translator"
"""Name of the logged model inside its run."""
EXPORT_FILES = ("model.safetensors", "model.json", "arch.json", "spm.model", "export.json")
"""The files of an export folder the model carries (ONNX files are left out)."""
DEFAULT_EXAMPLE = ("A man is riding a bike .", "Two dogs are playing in the snow .")
# Distributions the pyfunc imports at load time (see the module docstring); pinned at logging time.
_RUNTIME = ("mlflow", "torch", "safetensors", "sentencepiece", "numpy", "pyarrow", "sacrebleu", "rich")
_ENTRY = '''"""MLflow models-from-code entry point written by nas.export.mlflow_model.log_translator."""
import mlflow

from nas.export.mlflow_model import Translator

mlflow.models.set_model(Translator())
'''


def _sentences(model_input: Any) -> list[str]:
    """Source sentences from a list/tuple of str, a pandas Series, a DataFrame (column ``src``, or its
    only column) or a 1-D numpy array.

    Raises:
        ValueError: a DataFrame with several columns and none named ``src``, or a non-string item.
    """
    if hasattr(model_input, "columns"):  # pandas DataFrame
        columns = list(model_input.columns)
        if "src" in columns:
            model_input = model_input["src"]
        elif len(columns) == 1:
            model_input = model_input[columns[0]]
        else:
            raise ValueError(f"expected a DataFrame with a column 'src' of source sentences, got columns {columns}")
    items = model_input.tolist() if hasattr(model_input, "tolist") else list(model_input)
    bad = next((i for i, s in enumerate(items) if not isinstance(s, str)), None)
    if bad is not None:
        raise ValueError(f"source sentence {bad} is {type(items[bad]).__name__} {items[bad]!r}, expected str")
    return items


class Translator(mlflow.pyfunc.PythonModel):
    """pyfunc: raw source sentences -> detokenized translations (beam search of :mod:`nas.export.folder`).

    ``predict`` input: ``list[str]``, or a pandas DataFrame with a column ``src`` (n rows); output: a
    ``list[str]`` of n translations in input order. Param ``beam_size`` (int, default: the export's).

    Raises (from ``predict``):
        ValueError: input that holds no source sentences (see :func:`_sentences`), or ``beam_size`` < 1.
    """

    # MLflow would wrap predict and warn that it has no type hints; list[str] hints would replace the explicit
    # signature (dropping its beam_size param), so the explicit signature validates the input instead.
    _skip_type_hint_validation = True

    def load_context(self, context: mlflow.pyfunc.PythonModelContext) -> None:
        from nas.export.folder import load_export

        self._model = load_export(context.artifacts[ARTIFACT])

    def predict(self, context, model_input, params=None):  # no type hints: MLflow would derive a schema from them
        beam_size = (params or {}).get("beam_size")
        if beam_size is not None and int(beam_size) < 1:
            raise ValueError(f"params.beam_size={beam_size} must be >= 1")
        return self._model.translate(_sentences(model_input), beam_size=int(beam_size) if beam_size else None)


def pip_requirements() -> list[str]:
    """``name==version`` for each distribution the pyfunc imports, at the versions installed here
    (local version labels such as ``+cpu`` dropped)."""
    out = []
    for name in _RUNTIME:
        try:
            out.append(f"{name}=={version(name).split('+')[0]}")
        except PackageNotFoundError:
            out.append(name)
    return out


@dataclass(frozen=True)
class LoggedTranslator:
    """Where :func:`log_translator` put the model."""

    model_uri: str
    """``models:/<model id>``: the logged model itself."""
    run_id: str
    """The ``nas.role=export`` run that logged it."""
    registered_name: str | None = None
    version: str | None = None
    """Registered version (when registered)."""
    alias_uri: str | None = None
    """``models:/NAME@champion`` (when registered)."""


def log_translator(export_dir: str | Path, *, experiment: str, register: str | None = None,
                   source_run_id: str | None = None, input_example: Sequence[str] = DEFAULT_EXAMPLE,
                   alias: str = CHAMPION) -> LoggedTranslator:
    """Log the export folder ``export_dir`` (written by :func:`nas.export.export_arch`) as an MLflow
    pyfunc model in a new run of ``experiment`` (tags ``nas.role=export``, ``nas.source_run_id``),
    with ``input_example`` (source sentences; MLflow checks that the model translates them), the
    signature ``string -> string`` with param ``beam_size`` (default: the export's), the pinned
    :func:`pip_requirements` and the ``nas`` package as code. With ``register``, the model becomes a
    new version of the registered model ``register`` and ``alias`` is moved to that version.

    Raises:
        FileNotFoundError: ``export_dir`` lacks a file of :data:`EXPORT_FILES` (names it).
        ValueError: ``input_example`` is empty.
        mlflow.MlflowException: the store refuses the run, the model or the registration (e.g. a
            registered-model name it does not accept).
    """
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    from nas import tracking  # not at module level: a loaded model needs only nas.export.folder

    export_dir = Path(export_dir)
    missing = [f for f in EXPORT_FILES if not (export_dir / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{export_dir} is not a complete nas export (missing {', '.join(missing)}); "
                                "write it with `nas export`")
    if not input_example:
        raise ValueError("input_example needs at least one source sentence")
    meta = json.loads((export_dir / "export.json").read_text(encoding="utf-8"))
    beam_size = int(meta.get("beam_size", 4))
    signature = ModelSignature(inputs=Schema([ColSpec("string")]), outputs=Schema([ColSpec("string")]),
                               params=ParamSchema([ParamSpec("beam_size", "long", beam_size)]))
    tags = {"nas.source_run_id": source_run_id or "", "nas.export_dir": str(export_dir.resolve())}
    if meta.get("sweep_id"):
        tags["nas.sweep_id"] = str(meta["sweep_id"])
    run_id = tracking.start_run(experiment, f"export-{(source_run_id or export_dir.name)[:8]}", role="export", tags=tags)
    mlflow.set_tracking_uri(tracking.tracking_uri())
    with tempfile.TemporaryDirectory(prefix="nas-mlflow-") as tmp:
        tmp = Path(tmp)
        files = tmp / "export"
        files.mkdir()
        for name in EXPORT_FILES:
            shutil.copyfile(export_dir / name, files / name)
        code = tmp / "code" / "nas"
        shutil.copytree(Path(__file__).resolve().parents[1], code, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        entry = tmp / "translator.py"
        entry.write_text(_ENTRY, encoding="utf-8")
        sys_path = list(sys.path)  # MLflow prepends the code path when it checks the input example
        try:
            with mlflow.start_run(run_id=run_id):  # FAILED if logging raises, FINISHED otherwise
                info = mlflow.pyfunc.log_model(name=MODEL_NAME, python_model=str(entry),
                                               artifacts={ARTIFACT: str(files)}, code_paths=[str(code)],
                                               signature=signature, input_example=list(input_example),
                                               pip_requirements=pip_requirements(), registered_model_name=register)
        finally:
            sys.path[:] = sys_path
    if register is None:
        return LoggedTranslator(model_uri=info.model_uri, run_id=run_id)
    version_ = str(info.registered_model_version)
    tracking.get_client().set_registered_model_alias(register, alias, version_)
    return LoggedTranslator(model_uri=info.model_uri, run_id=run_id, registered_name=register, version=version_,
                            alias_uri=f"models:/{register}@{alias}")
