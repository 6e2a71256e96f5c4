"""The sweep YAML's schema: pydantic models, one module per section, with the checks that need only the YAML.

Every field carries its unit in its docstring (STYLE habit 1). :class:`SweepSpec` is the whole file;
reading it from disk is :func:`nas.space.loader.load_spec`. Relative data paths are resolved against the
current working directory (the repository root in the README's commands).

What lives where (each module imports only those above it):

- :mod:`nas.space.schema.base`: :class:`StrictModel`, the base of every model (unknown keys refused, frozen).
- :mod:`nas.space.schema.data`: ``data:`` (:class:`DataSpec`, :class:`PairFiles`, :class:`TokenizerSpec`).
- :mod:`nas.space.schema.supernet`: ``supernet:`` (:class:`SupernetSpec`).
- :mod:`nas.space.schema.space`: ``space:`` (:class:`SpaceSpec`, :class:`Dimension`) and :func:`check_space`,
  its checks against the supernet.
- :mod:`nas.space.schema.train`: ``train:`` (:class:`TrainSpec`) and its stages (:data:`StageSpec`,
  :data:`STAGE_ORDER`).
- :mod:`nas.space.schema.points`: ``search.points_to_evaluate`` entries (:class:`ArchPoint`, :data:`PointSpec`,
  :data:`REFERENCE_POINTS`).
- :mod:`nas.space.schema.search`: ``search:`` (:class:`SearchSpec`, :class:`MetricSpec`,
  :class:`LatencyWorkloadSpec`, :class:`EvolutionSpec`, :class:`FinetuneSpec`).
- :mod:`nas.space.schema.resources`: ``resources:`` (:class:`ResourcesSpec`).
- :mod:`nas.space.schema.tracking`: ``tracking:`` (:class:`TrackingSpec`, :data:`OPTUNA_STORAGE_SCHEMES`).
- :mod:`nas.space.schema.sweep`: the whole file (:class:`SweepSpec`): the checks that span sections and the
  hiding of values interpolated from ``${VAR}`` (:data:`REDACTED`).

The ``retrain:`` section is :mod:`nas.space.recipe` (:class:`RetrainSpec`).

Pydantic and the standard library only: no torch, Ray, Optuna or MLflow.
"""

from __future__ import annotations

from nas.redact import REDACTED
from nas.space.recipe import RetrainSpec
from nas.space.schema.data import DataSpec, PairFiles, TokenizerSpec
from nas.space.schema.points import REFERENCE_POINTS, ArchPoint, PointSpec
from nas.space.schema.resources import ResourcesSpec
from nas.space.schema.search import EvolutionSpec, FinetuneSpec, LatencyWorkloadSpec, MetricSpec, SearchSpec
from nas.space.schema.space import Dimension, SpaceSpec
from nas.space.schema.supernet import SupernetSpec
from nas.space.schema.sweep import SweepSpec
from nas.space.schema.tracking import OPTUNA_STORAGE_SCHEMES, TrackingSpec
from nas.space.schema.train import STAGE_ORDER, JointStage, SeqDistillStage, StageSpec, TrainSpec, WordDistillStage

__all__ = ["SweepSpec", "DataSpec", "PairFiles", "TokenizerSpec", "SupernetSpec", "Dimension", "SpaceSpec",
           "JointStage", "WordDistillStage", "SeqDistillStage", "StageSpec", "STAGE_ORDER", "TrainSpec",
           "MetricSpec", "FinetuneSpec", "LatencyWorkloadSpec", "EvolutionSpec", "SearchSpec", "ResourcesSpec",
           "ArchPoint", "PointSpec", "REFERENCE_POINTS",
           "TrackingSpec", "RetrainSpec", "OPTUNA_STORAGE_SCHEMES", "REDACTED"]
