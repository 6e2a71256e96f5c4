"""Reports of a finished sweep (``nas report``).

What lives where (every public name below is re-exported here and loaded on first use, PEP 562, so
``import nas.report`` alone imports no mlflow or optuna):

- :mod:`nas.report.sweep`: a sweep's report: the best sub-Transformers, the Pareto front (table and plot) and
  Optuna's parameter importances (:func:`build_report`, :func:`param_importances`, :func:`locate_study`),
  rendered as one self-contained HTML file or as Markdown with the plot beside it (:func:`write_report`).

The Pareto plot itself is drawn by :mod:`nas.tracking.plots` (a sweep also logs it to its parent run).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nas.lazy import lazy_exports

_MODULES = {
    "sweep": ("FORMATS", "ImportanceError", "SweepReport", "build_report", "locate_study", "param_importances",
              "render_html", "render_markdown", "write_report"),
}
"""Submodule -> the public names it defines (its ``__all__``)."""
_HOMES = {name: module for module, names in _MODULES.items() for name in names}

__all__ = ["FORMATS", "ImportanceError", "SweepReport", "build_report", "locate_study", "param_importances",
           "render_html", "render_markdown", "write_report"]

if TYPE_CHECKING:
    from nas.report.sweep import (FORMATS, ImportanceError, SweepReport, build_report, locate_study,
                                  param_importances, render_html, render_markdown, write_report)


__getattr__, __dir__ = lazy_exports(globals(), _HOMES)
