"""The base of every model of the sweep YAML's schema: unknown keys refused, values frozen.

Pydantic only: no torch, Ray, Optuna or MLflow.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["StrictModel"]


class StrictModel(BaseModel):
    """A section (or sub-section) of the sweep YAML: a key it does not define is an error (pydantic
    ``extra="forbid"``, reported with "did you mean" by :mod:`nas.space.errors`), and a loaded spec is immutable
    (``frozen``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
