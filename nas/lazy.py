"""Lazy package exports (PEP 562), written once for every package ``__init__`` (standard library only).

A package lists where each public name lives; the name's module is imported on first use, so importing
the package stays light (``import nas`` loads no torch, Ray, Optuna or MLflow).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(namespace: dict[str, Any], homes: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of the package whose ``globals()`` is ``namespace``.

    Args:
        namespace: the package's ``globals()``; a loaded name is cached there.
        homes: public name -> the submodule defining it, relative to the package (``"latency"``).

    Usage: ``__getattr__, __dir__ = lazy_exports(globals(), {"measure_latency": "latency"})``.
    An unknown name raises ``AttributeError`` naming the package.
    """
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{homes[name]}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *namespace.get("__all__", ())})

    return __getattr__, __dir__
