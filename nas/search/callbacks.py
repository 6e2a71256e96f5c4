"""Driver-side Ray Tune callback that mirrors trials into MLflow child runs.

The driver is the only MLflow writer (no "database is locked" with SQLite). Each Ray
trial becomes one child run of the sweep's parent run, tagged with its trial id.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ray.tune import Callback
from rich.console import Console

from nas import tracking

__all__ = ["MlflowTrialCallback"]

_console = Console(stderr=True, highlight=False)  # module level: the callback itself is pickled by Ray
_NOT_METRICS = {"step", "training_iteration", "time_this_iter_s", "time_total_s", "timestamp", "time_since_restore",
                "iterations_since_restore", "pid", "done"}


class MlflowTrialCallback(Callback):
    """One MLflow child run per Ray trial.

    Args:
        experiment: MLflow experiment name.
        parent_run_id: the sweep's parent run.
        role: ``supernet`` or ``trial`` (the ``nas.role`` tag).
        tags: extra tags for every child run (sweep id, supernet folder, data folder).
        params: extra params for every child run (flattened).
    """

    def __init__(self, experiment: str, parent_run_id: str, role: str, tags: dict[str, str],
                 params: dict[str, Any] | None = None) -> None:
        self.experiment, self.parent_run_id, self.role = experiment, parent_run_id, role
        self.tags, self.params = dict(tags), dict(params or {})
        self.run_ids: dict[str, str] = {}
        self.finished = 0

    def on_trial_start(self, iteration: int, trials: list, trial, **info) -> None:
        name = f"{self.role}-{trial.trial_id}"
        self.run_ids[trial.trial_id] = tracking.start_run(
            self.experiment, name, role=self.role, parent_run_id=self.parent_run_id,
            tags={**self.tags, "nas.trial_id": trial.trial_id}, params={**self.params, **trial.config})

    def on_trial_result(self, iteration: int, trials: list, trial, result: dict, **info) -> None:
        run_id = self.run_ids.get(trial.trial_id)
        if run_id is None:
            return
        metrics = {k: float(v) for k, v in result.items()
                   if k not in _NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool)}
        tracking.log_metrics(run_id, metrics, step=int(result.get("step", result.get("training_iteration", 0))))
        if "arch" in result:
            arch = json.loads(result["arch"])
            tracking.log_json_artifact(run_id, arch, "arch.json")
            tracking.get_client().set_tag(run_id, "nas.arch_summary", str(result.get("arch_summary", "")))
            tracking.get_client().set_tag(run_id, "nas.arch_id", str(result.get("arch_id", "")))

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        run_id = self.run_ids.pop(trial.trial_id, None)
        if run_id is None:
            return
        last = trial.last_result or {}
        bad = [k for k, v in last.items() if isinstance(v, float) and math.isnan(v)]
        tracking.end_run(run_id, "FAILED" if bad else "FINISHED")
        self.finished += 1
        if self.role == "trial":
            _console.print(f"trial {self.finished} done: BLEU {last.get('bleu', float('nan')):.2f} "
                               f"chrF {last.get('chrf', float('nan')):.2f} latency {last.get('latency_ms', float('nan')):.1f} ms "
                               f"params {last.get('params_m', float('nan')):.2f} M  {last.get('arch_summary', '')}")

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        run_id = self.run_ids.pop(trial.trial_id, None)
        if run_id is not None:
            error = _last_error_line(getattr(trial, "error_file", None))
            tracking.get_client().set_tag(run_id, "nas.error", str(error)[:4000])
            tracking.end_run(run_id, "FAILED")
            _console.print(f"[red]{self.role} {trial.trial_id} failed[/red]: {error}")


def _last_error_line(error_file: str | None) -> str:
    """The exception line of a Ray trial's error file (its full traceback stays in the file)."""
    try:
        lines = [line for line in open(error_file, encoding="utf-8").read().splitlines() if line.strip()]
    except (OSError, TypeError):
        return "see the Ray trial logs"
    return f"{lines[-1] if lines else ''} ({error_file})"
