"""The search space's spec layer: the sweep YAML, its checks, and the space of sub-Transformers it defines.

What lives where (each module imports only those above it; none imports torch, Ray, Optuna or MLflow):

- :mod:`nas.space.arch`: the :class:`Arch` dataclass (per-layer tuples, JSON, ``arch_id``) and the names of
  layouts, unit biases and unit dependencies.
- :mod:`nas.space.constraints`: the ``METRIC OP NUMBER`` language of ``search.constraints`` and of
  ``nas leaderboard --where`` (:class:`Constraint`, :func:`parse_constraint`, :data:`METRIC_NAMES`).
- :mod:`nas.space.errors`: :class:`SpecError` (a :class:`nas.errors.NasError`: exit 2) and pydantic errors
  rewritten as one line per problem naming the key path.
- :mod:`nas.space.schema`: the pydantic models of the YAML (:class:`SweepSpec` and its sections, a module per
  section).
- :mod:`nas.space.datafiles`: the up-front checks of the data files the YAML names.
- :mod:`nas.space.predictor_file`: a latency predictor's file read without torch (format, feature names).
- :mod:`nas.space.params`: :func:`arch_params`, a sub-Transformer's parameter count from its arch and the
  supernet's fixed sizes (:class:`ModelSizes`).
- :mod:`nas.space.space`: :class:`SearchSpace`, the space built from a spec (widest, narrowest, random and
  Optuna define-by-run archs).
- :mod:`nas.space.loader`: :func:`load_spec` (YAML file -> checked :class:`SweepSpec`) and :func:`parse_spec`.

Example::

    from nas.space import SearchSpace, load_spec
    spec = load_spec("search_spaces/quickstart.yaml")
    widest = SearchSpace.from_spec(spec).widest()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nas.lazy import lazy_exports

_HOMES = {
    "Arch": "arch", "LayerArch": "arch", "StackArch": "arch",
    "METRIC_NAMES": "constraints", "Constraint": "constraints", "parse_constraint": "constraints",
    "SpecError": "errors",
    "load_spec": "loader", "parse_spec": "loader",
    "REDACTED": "schema", "FinetuneSpec": "schema", "JointStage": "schema", "SearchSpec": "schema",
    "SeqDistillStage": "schema", "SweepSpec": "schema", "TrainSpec": "schema", "WordDistillStage": "schema",
    "SearchSpace": "space", "format_count": "space",
    "ModelSizes": "params", "arch_params": "params",
}
"""Public name -> the module that defines it (loaded on first use, PEP 562: ``import nas.space.arch``, as the
model does, stays free of pydantic and YAML)."""

if TYPE_CHECKING:
    from nas.space.arch import Arch, LayerArch, StackArch
    from nas.space.constraints import METRIC_NAMES, Constraint, parse_constraint
    from nas.space.errors import SpecError
    from nas.space.loader import load_spec, parse_spec
    from nas.space.schema import (REDACTED, FinetuneSpec, JointStage, SearchSpec, SeqDistillStage, SweepSpec,
                                  TrainSpec, WordDistillStage)
    from nas.space.params import ModelSizes, arch_params
    from nas.space.space import SearchSpace, format_count


__getattr__, __dir__ = lazy_exports(globals(), _HOMES)


__all__ = [
    "Arch",
    "Constraint",
    "FinetuneSpec",
    "JointStage",
    "LayerArch",
    "METRIC_NAMES",
    "ModelSizes",
    "REDACTED",
    "SearchSpace",
    "SearchSpec",
    "SeqDistillStage",
    "SpecError",
    "StackArch",
    "SweepSpec",
    "TrainSpec",
    "WordDistillStage",
    "arch_params",
    "format_count",
    "load_spec",
    "parse_constraint",
    "parse_spec",
]
