"""The MLflow run layout of a sweep and where the runs are: tag and param names, stage names, the tracking URI.

One *sweep* parent run (tags ``nas.sweep_id``, ``nas.role=sweep``), and under it one ``nas.role=supernet``
child run (with one ``nas.role=stage`` child per training stage) plus one ``nas.role=trial`` child run per
search trial (tags ``nas.trial_id``, ``nas.arch_id``, ``nas.arch_summary``, and ``nas.point`` on a trial started
from a ``search.points_to_evaluate`` entry; metrics ``bleu``, ``chrf``,
``valid_loss``, ``params_m``, ``latency_ms``; params = the flattened architecture). ``nas retrain`` of a trial
adds a ``nas.role=retrain`` child (tag ``nas.source_run_id``: the trial) with the retrained model's metrics and
weights; a retrain of an ``--arch`` is a top-level run of that role.

Standard library only (no mlflow): :mod:`nas.preflight` reads :func:`tracking_uri` before anything starts.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["tracking_uri", "TAG_ROLE", "TAG_SWEEP_ID", "TAG_TRIAL_ID", "TAG_ARCH_ID", "TAG_ARCH_SUMMARY",
           "TAG_PARENT", "TAG_STAGE", "STAGE_NAMES", "TAG_OPTUNA_TRIAL", "TAG_ERROR", "TAG_OBJECTIVES",
           "TAG_OPTUNA_STORAGE", "TAG_STUDY_NAME", "TAG_SOURCE_RUN", "TAG_RETRAIN_DIR", "TAG_POINT",
           "PARAM_CONSTRAINTS"]

TAG_ROLE = "nas.role"
TAG_SWEEP_ID = "nas.sweep_id"
TAG_TRIAL_ID = "nas.trial_id"
TAG_ARCH_ID = "nas.arch_id"
TAG_ARCH_SUMMARY = "nas.arch_summary"
TAG_PARENT = "mlflow.parentRunId"
TAG_STAGE = "nas.stage"
STAGE_NAMES = {1: "joint", 2: "word_distill", 3: "seq_distill"}
TAG_OPTUNA_TRIAL = "nas.optuna_trial"
TAG_POINT = "nas.point"
"""Trial-run tag: the name of the ``search.points_to_evaluate`` entry the trial was started from (``narrowest``, a
named arch such as ``tiny``, ``points_to_evaluate.2``); absent on a sampled trial. The leaderboard marks these."""
TAG_ERROR = "nas.error"
TAG_OBJECTIVES = "nas.objectives"
TAG_OPTUNA_STORAGE = "nas.optuna_storage"
"""Sweep parent-run tag: the Optuna study's storage, a journal file path or a database URL (password masked)."""
TAG_STUDY_NAME = "nas.study_name"
"""Sweep parent-run tag: the study's name in that storage."""
TAG_SOURCE_RUN = "nas.source_run_id"
"""Retrain-run tag (``nas.role=retrain``): the trial run whose arch was retrained (absent for ``--arch``)."""
TAG_RETRAIN_DIR = "nas.retrain_dir"
"""Retrain-run tag: the folder (absolute) that holds the retrained weights on the machine that trained them."""

PARAM_CONSTRAINTS = "search.constraints"
"""Param of a sweep's parent run: its ``search.constraints`` as ``; ``-joined keys (``latency_ms<=40``)."""


def tracking_uri() -> str:
    """The MLflow tracking URI: ``$MLFLOW_TRACKING_URI`` if set (and non-empty), else an
    absolute SQLite URI ``sqlite:///<cwd>/mlflow.db``."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{(Path.cwd() / 'mlflow.db').resolve()}"
