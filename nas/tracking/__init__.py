"""MLflow tracking of NAS sweeps: runs, leaderboard queries, Pareto fronts and leaderboard files.

What lives where (callers keep writing ``from nas import tracking; tracking.leaderboard(...)``: every public
name below is re-exported here and loaded on first use, PEP 562, so ``import nas.tracking`` alone imports no
mlflow):

- :mod:`nas.tracking.layout`: the run layout (``TAG_*`` names, stage names) and :func:`tracking_uri` (no mlflow).
- :mod:`nas.tracking.runs`: the MLflow client: experiments, parent/child runs, :class:`StageRuns`, params,
  metrics, artifacts, resuming and ending runs.
- :mod:`nas.tracking.model_files`: the trained supernet, SentencePiece model and validation file as artifacts
  of the supernet run (:func:`log_supernet_files`), and where a trial's are (:func:`trial_model_files`: the
  local folders, else downloaded through MLflow), so any machine that reaches MLflow can export.
- :mod:`nas.tracking.rows`: :class:`LeaderboardRow` and the row metrics (no mlflow).
- :mod:`nas.tracking.pareto`: :class:`Objective`, :func:`parse_objectives`, :func:`pareto_mask` (no mlflow).
- :mod:`nas.tracking.query`: :func:`leaderboard`, :func:`iter_leaderboard_rows`, :func:`parse_where`
  (``--where``, the grammar of :mod:`nas.space.constraints`), :func:`pareto_scan`, :func:`best_trial`; rankings
  keep the trials meeting their sweep's constraints unless asked to include the others.
- :mod:`nas.tracking.board`: what a leaderboard shows (:func:`ranked_rows`), why it is empty, which constraints applied.
- :mod:`nas.tracking.sweeps`: a sweep's parent run, its objectives and constraints (:func:`constraints_by_sweep`).
- :mod:`nas.tracking.writers`: :func:`leaderboard_table` (rich) and :func:`write_leaderboard` (CSV, JSON,
  Parquet; atomic, :mod:`nas.atomic`) (no mlflow).
- :mod:`nas.tracking.plots`: the Pareto plot of a sweep (matplotlib, loaded when drawing): :func:`pareto_png`,
  :func:`write_pareto_plot`, :func:`log_pareto_plot`. Import it from the module: it is built on this package's
  API, so it is not re-exported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nas.lazy import lazy_exports

_MODULES = {
    "layout": ("tracking_uri", "TAG_ROLE", "TAG_SWEEP_ID", "TAG_TRIAL_ID", "TAG_ARCH_ID", "TAG_ARCH_SUMMARY",
               "TAG_PARENT", "TAG_STAGE", "STAGE_NAMES", "TAG_OPTUNA_TRIAL", "TAG_ERROR", "TAG_OBJECTIVES",
               "TAG_OPTUNA_STORAGE", "TAG_STUDY_NAME", "TAG_SOURCE_RUN", "TAG_RETRAIN_DIR", "TAG_POINT",
               "PARAM_CONSTRAINTS"),
    "runs": ("get_client", "ensure_experiment", "flatten", "start_run", "log_metrics", "log_json_artifact",
             "log_file_artifact", "end_run", "StageRuns", "find_tagged_runs", "log_new_params", "reopen_run",
             "end_stale_runs", "find_runs", "resolve_run_id", "require_store"),
    "model_files": ("SUPERNET_ARTIFACTS", "ModelFiles", "log_supernet_files", "trial_model_files",
                    "RETRAIN_ARTIFACTS", "log_retrain_files", "retrained_model_files", "model_run_problem"),
    "rows": ("LeaderboardRow",),
    "pareto": ("Objective", "DEFAULT_OBJECTIVES", "parse_objectives", "pareto_mask"),
    "query": ("LEADERBOARD_STATUSES", "parse_where", "iter_leaderboard_rows", "leaderboard", "ParetoScan",
              "pareto_scan", "best_trial", "with_retrained", "points_below"),
    "sweeps": ("find_sweep_run", "sweep_constraints", "sweep_objectives", "constraints_by_sweep",
               "describe_constraints", "latest_experiment"),
    "writers": ("leaderboard_table", "write_leaderboard"),
    "board": ("Board", "ranked_rows", "empty_reason", "feasibility_note"),
}
"""Submodule -> the public names it defines (the package's API)."""
_HOMES = {name: module for module, names in _MODULES.items() for name in names}

__all__ = ["latest_experiment", "require_store", "Board", "ranked_rows", "empty_reason", "feasibility_note", "DEFAULT_OBJECTIVES", "LEADERBOARD_STATUSES", "LeaderboardRow", "ModelFiles", "Objective",
    "PARAM_CONSTRAINTS", "SUPERNET_ARTIFACTS", "log_supernet_files", "trial_model_files",
    "ParetoScan", "STAGE_NAMES", "StageRuns", "TAG_ARCH_ID", "TAG_ARCH_SUMMARY", "TAG_ERROR",
    "TAG_OBJECTIVES", "TAG_OPTUNA_STORAGE", "TAG_OPTUNA_TRIAL", "TAG_PARENT", "TAG_ROLE", "TAG_STAGE", "TAG_STUDY_NAME", "TAG_SWEEP_ID",
    "TAG_TRIAL_ID", "TAG_POINT", "best_trial", "constraints_by_sweep", "describe_constraints", "end_run", "end_stale_runs",
    "ensure_experiment", "find_runs", "find_sweep_run", "find_tagged_runs", "flatten", "get_client",
    "iter_leaderboard_rows", "leaderboard", "leaderboard_table",
    "log_file_artifact", "log_json_artifact", "log_metrics", "log_new_params", "pareto_mask", "pareto_scan",
    "parse_objectives", "parse_where", "reopen_run", "start_run", "sweep_constraints", "sweep_objectives",
    "tracking_uri", "write_leaderboard", "TAG_SOURCE_RUN", "TAG_RETRAIN_DIR", "RETRAIN_ARTIFACTS",
    "log_retrain_files", "retrained_model_files", "model_run_problem", "with_retrained", "resolve_run_id",
    "points_below"]

if TYPE_CHECKING:
    from nas.tracking.layout import (PARAM_CONSTRAINTS, STAGE_NAMES, TAG_ARCH_ID, TAG_ARCH_SUMMARY, TAG_ERROR,
                                     TAG_OBJECTIVES, TAG_OPTUNA_STORAGE, TAG_OPTUNA_TRIAL, TAG_PARENT, TAG_ROLE,
                                     TAG_POINT, TAG_RETRAIN_DIR, TAG_SOURCE_RUN, TAG_STAGE, TAG_STUDY_NAME,
                                     TAG_SWEEP_ID, TAG_TRIAL_ID, tracking_uri)
    from nas.tracking.model_files import (RETRAIN_ARTIFACTS, SUPERNET_ARTIFACTS, ModelFiles, log_retrain_files,
                                          log_supernet_files, model_run_problem, retrained_model_files,
                                          trial_model_files)
    from nas.tracking.pareto import DEFAULT_OBJECTIVES, Objective, parse_objectives, pareto_mask
    from nas.tracking.query import (LEADERBOARD_STATUSES, ParetoScan, best_trial, iter_leaderboard_rows,
                                    leaderboard, pareto_scan, parse_where, points_below, with_retrained)
    from nas.tracking.rows import LeaderboardRow
    from nas.tracking.runs import (StageRuns, end_run, end_stale_runs, ensure_experiment, find_runs,
                                   find_tagged_runs, flatten, get_client, log_file_artifact, log_json_artifact,
                                   log_metrics, log_new_params, reopen_run, require_store, resolve_run_id,
                                   start_run)
    from nas.tracking.sweeps import (constraints_by_sweep, describe_constraints, find_sweep_run,
                                     latest_experiment, sweep_constraints, sweep_objectives)
    from nas.tracking.writers import leaderboard_table, write_leaderboard
    from nas.tracking.board import Board, empty_reason, feasibility_note, ranked_rows


__getattr__, __dir__ = lazy_exports(globals(), _HOMES)
