"""A sub-Transformer out of the supernet: export folders, ONNX, MLflow models.

The package is callable: ``nas.export(out_dir, run_id=... | best=True, ...)`` is :func:`export_trial` (the user
job ``nas export``), so that the export modules and the job share the one name users look for.

What lives where (callers keep writing ``from nas.export import export_arch, load_export``: every public name
below is re-exported here and loaded on first use, PEP 562, so ``import nas.export`` alone imports no torch,
onnx or mlflow):

- :mod:`nas.export.trial`: :func:`export_trial` (an MLflow trial or retrain run to an export folder, with ONNX,
  CTranslate2 and a registered MLflow model on request), :class:`ExportResult`, :class:`ExportCheckFailed`.
- :mod:`nas.export.text`: raw text through an export (``nas translate``): :func:`~nas.export.text.decode_lines`,
  :func:`~nas.export.text.translate_lines`.
- :mod:`nas.export.folder`: the export folder (``model.safetensors``, ``model.json``, ``arch.json``,
  ``spm.model``, ``export.json``): :func:`export_arch`, :func:`load_export`, :class:`Exported`, and
  :data:`PROVENANCE` (``export.json``, the file that marks a folder as an export).
- :mod:`nas.export.onnx`: :func:`export_onnx` (``encoder.onnx``, ``decoder_step.onnx``, ``onnx.json`` and
  ``translate_onnx.py`` added to an export folder) and :func:`verify_onnx` (PyTorch against onnxruntime).
- :mod:`nas.export.translate_onnx`: the standalone translation script copied into every ONNX folder
  (onnxruntime, numpy and sentencepiece only; it imports nothing of ``nas``, so it is not re-exported).
- :mod:`nas.export.ct2`: the export as a CTranslate2 model folder (:func:`export_ctranslate2`, ``nas export
  --ctranslate2``), :func:`ctranslate2_problem` (what prevents it) and :class:`Ct2Translator`; needs the
  optional ``ctranslate2`` (``pip install 'nas[serve]'``) only when called.
- :mod:`nas.export.mlflow_model`: an export folder as an MLflow pyfunc model (:func:`log_translator`,
  :class:`Translator`); imports mlflow.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from nas.lazy import lazy_exports

_MODULES = {
    "trial": ("export_trial", "ExportResult", "ExportCheckFailed"),
    "folder": ("export_arch", "load_export", "Exported", "PROVENANCE"),
    "onnx": ("export_onnx", "verify_onnx", "TRANSLATE_SCRIPT", "MANIFEST", "MIN_OPSET"),
    "ct2": ("CT2_DIR", "Ct2Translator", "UnsupportedArchError", "build_spec", "ctranslate2_problem",
            "export_ctranslate2", "require_ctranslate2"),
    "mlflow_model": ("CHAMPION", "EXPORT_FILES", "LoggedTranslator", "Translator", "log_translator",
                     "pip_requirements"),
}
"""Submodule -> the public names it defines (its ``__all__``)."""
_HOMES = {name: module for module, names in _MODULES.items() for name in names}

__all__ = ["CHAMPION", "CT2_DIR", "Ct2Translator", "EXPORT_FILES", "ExportCheckFailed", "ExportResult", "Exported",
           "LoggedTranslator", "MANIFEST",
           "MIN_OPSET", "PROVENANCE", "TRANSLATE_SCRIPT", "Translator", "UnsupportedArchError", "build_spec",
           "ctranslate2_problem", "export_arch", "export_ctranslate2", "export_onnx", "export_trial", "load_export",
           "log_translator", "pip_requirements", "require_ctranslate2", "verify_onnx"]

if TYPE_CHECKING:
    from nas.export.ct2 import (CT2_DIR, Ct2Translator, UnsupportedArchError, build_spec, ctranslate2_problem,
                                export_ctranslate2, require_ctranslate2)
    from nas.export.folder import PROVENANCE, Exported, export_arch, load_export
    from nas.export.mlflow_model import (CHAMPION, EXPORT_FILES, LoggedTranslator, Translator, log_translator,
                                         pip_requirements)
    from nas.export.onnx import MANIFEST, MIN_OPSET, TRANSLATE_SCRIPT, export_onnx, verify_onnx
    from nas.export.trial import ExportCheckFailed, ExportResult, export_trial


__getattr__, __dir__ = lazy_exports(globals(), _HOMES)


class _CallablePackage(types.ModuleType):
    """This package's class: calling it calls :func:`export_trial` (a module's class may be a subclass of
    ``ModuleType``, Python's data model, "Customizing module attribute access")."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.export_trial(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
