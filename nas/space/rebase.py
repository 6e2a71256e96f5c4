"""Relative paths of a sweep YAML read against another folder than the current one (``nas sweep --resume NAME``
from elsewhere: the saved copy's paths are relative to the folder the sweep started in)."""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

__all__ = ["rebase_paths"]


def rebase_paths(raw: Any, base: Path, model: type[BaseModel]) -> Any:
    """A copy of the YAML mapping ``raw`` whose relative path values are joined to ``base``.

    A path value is one whose field in ``model`` (recursively: nested models, lists and dicts of them) is typed
    ``Path`` (or ``Path | None``); it is rebased when it is a relative string, after ``~`` is expanded. The schema
    is read from the model, so a path field added later is rebased too. Values of the wrong type are left for
    validation to report.
    """
    if not isinstance(raw, dict):
        return raw
    out = dict(raw)
    for name, info in model.model_fields.items():
        key = info.alias or name
        if key in out:
            out[key] = _rebase_value(out[key], info.annotation, base)
    return out


def _rebase_value(value: Any, annotation: Any, base: Path) -> Any:
    kinds = _members(annotation)
    if isinstance(value, str) and Path in kinds:
        path = Path(value).expanduser()
        return value if path.is_absolute() else str(base / path)
    models = [k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)]
    if isinstance(value, dict) and models:
        return rebase_paths(value, base, models[0])
    for kind in kinds:
        origin, args = typing.get_origin(kind), typing.get_args(kind)
        if origin in (list, tuple) and isinstance(value, list) and args:
            return [_rebase_value(v, args[0], base) for v in value]
        if origin is dict and isinstance(value, dict) and len(args) == 2:
            return {k: _rebase_value(v, args[1], base) for k, v in value.items()}
    return value


def _members(annotation: Any) -> list[Any]:
    """The types of a union (``A | B``, ``Optional[A]``, ``Annotated[A, ...]``), else ``[annotation]``."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _members(a)]
    return [annotation]
