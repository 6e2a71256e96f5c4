"""Driver-side Ray Tune callback that mirrors trials into MLflow child runs.

The driver is the only MLflow writer (no "database is locked" with SQLite). Each search trial
becomes one child run of the sweep's parent run, keyed by its Optuna trial number (tag
``nas.optuna_trial``; the current Ray trial id is tag ``nas.trial_id``), and so does each fine-tuned
one (role ``finetune``, :mod:`nas.search.finetune`); the supernet training is one child run keyed by its
role. A trial started from a named ``search.points_to_evaluate`` entry is tagged ``nas.point`` with its name.
A trial that starts again (a retry, or a re-run after the driver was killed) reuses its run: no
duplicate runs, params logged once, and a run that was FINISHED stays as it is.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ray.tune import Callback
from nas.console import make_console

from nas import tracking
from nas.redact import redact_url
from nas.search.searcher import CONTROL_KEYS, FINISHED_KEY, OPTUNA_TRIAL_KEY, POINT_KEY, error_line

__all__ = ["MlflowTrialCallback"]

_console = make_console()  # module level: the callback itself is pickled by Ray
_NOT_METRICS = {"step", "training_iteration", "time_this_iter_s", "time_total_s", "timestamp", "time_since_restore",
                "iterations_since_restore", "pid", "done", *CONTROL_KEYS}


class MlflowTrialCallback(Callback):
    """One MLflow child run per trial, reused when the trial starts again.

    Args:
        experiment: MLflow experiment name.
        sweep_id: the sweep whose parent run (``nas.role=sweep``) the child runs go under; looked up
            when the experiment starts, so a callback restored by ``Tuner.restore`` finds it again.
        role: ``supernet``, ``trial`` or ``finetune`` (the ``nas.role`` tag); a run is keyed by role and
            Optuna trial number (``nas.optuna_trial``) when the trial's config carries one.
        tags: extra tags for every child run (sweep id, supernet folder, data folder).
        params: extra params for every child run (flattened).
    """

    def __init__(self, experiment: str, sweep_id: str, role: str, tags: dict[str, str],
                 params: dict[str, Any] | None = None) -> None:
        self.experiment, self.sweep_id, self.role = experiment, sweep_id, role
        self.tags, self.params = dict(tags), dict(params or {})
        self._reset()

    def _reset(self) -> None:
        self.parent_run_id: str | None = None
        self.run_ids: dict[str, str] = {}
        self.done: set[str] = set()  # Ray trial ids whose run was FINISHED before this driver started them
        self.stages: dict[str, tracking.StageRuns] = {}  # supernet role: one nested MLflow run per training stage
        self.finished = 0

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for key in ("parent_run_id", "run_ids", "done", "finished"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    def setup(self, **info) -> None:
        runs = tracking.find_tagged_runs(self.experiment, {tracking.TAG_ROLE: "sweep", tracking.TAG_SWEEP_ID: self.sweep_id})
        if not runs:
            raise RuntimeError(f"no MLflow parent run for sweep {self.sweep_id!r} in experiment {self.experiment!r} "
                               f"at {redact_url(tracking.tracking_uri())}; was MLFLOW_TRACKING_URI changed since the "
                               "sweep started?")
        self.parent_run_id = runs[0].info.run_id

    def on_trial_start(self, iteration: int, trials: list, trial, **info) -> None:
        self.run_ids[trial.trial_id] = self._run_for(trial)

    def on_trial_recover(self, iteration: int, trials: list, trial, **info) -> None:
        run_id = self.run_ids.get(trial.trial_id)
        if run_id is not None:
            error = error_line(getattr(trial, "error_file", None))
            client = tracking.get_client()
            client.set_tag(run_id, "nas.retries", str(trial.num_failures))
            client.set_tag(run_id, "nas.last_error", error[:4000])
            _console.print(f"[yellow]{self.role} {trial.trial_id} failed, retrying[/yellow]: {error}")

    def _run_for(self, trial) -> str:
        """The trial's existing child run (reopened unless FINISHED) or a new one."""
        key = {tracking.TAG_PARENT: self.parent_run_id, tracking.TAG_ROLE: self.role}
        tags = {**self.tags, tracking.TAG_TRIAL_ID: trial.trial_id}
        config = {k: v for k, v in trial.config.items() if k not in CONTROL_KEYS}
        number = trial.config.get(OPTUNA_TRIAL_KEY)
        if number is not None:
            key[tracking.TAG_OPTUNA_TRIAL] = tags[tracking.TAG_OPTUNA_TRIAL] = str(number)
        if trial.config.get(POINT_KEY):  # started from search.points_to_evaluate: the leaderboard marks it
            tags[tracking.TAG_POINT] = str(trial.config[POINT_KEY])
        params = {**self.params, **config}
        existing = tracking.find_tagged_runs(self.experiment, key)
        if not existing:
            name = f"{self.role}-{number}" if number is not None else f"{self.role}-{trial.trial_id}"
            return tracking.start_run(self.experiment, name, role=self.role, parent_run_id=self.parent_run_id,
                                      tags=tags, params=params)
        run = existing[0]
        run_id = run.info.run_id
        if run.info.status == "FINISHED" or (run.info.status == "FAILED" and trial.config.get(FINISHED_KEY) == "FAIL"):
            self.done.add(trial.trial_id)  # recorded before: left as it is
            return run_id
        if run.info.status != "RUNNING":
            tracking.reopen_run(run_id)
        tracking.get_client().set_tag(run_id, tracking.TAG_TRIAL_ID, trial.trial_id)
        conflicts = tracking.log_new_params(run_id, params)
        if conflicts:
            _console.print(f"[yellow]run {run_id}: params kept at their first values[/yellow]: "
                           + ", ".join(f"{k}={old!r} (now {new!r})" for k, (old, new) in conflicts.items()))
        return run_id

    def on_trial_result(self, iteration: int, trials: list, trial, result: dict, **info) -> None:
        run_id = self.run_ids.get(trial.trial_id)
        if run_id is None or trial.trial_id in self.done:
            return
        metrics = {k: float(v) for k, v in result.items()
                   if k not in _NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool)}
        step = int(result.get("step", result.get("training_iteration", 0)))
        if self.role == "supernet":  # the supernet run, and the stage's nested run (Scalable Transformers sec. 3.3)
            if trial.trial_id not in self.stages:
                self.stages[trial.trial_id] = tracking.StageRuns(self.experiment, run_id, self.tags)
            self.stages[trial.trial_id]({**metrics, "step": step})
        else:
            tracking.log_metrics(run_id, metrics, step=step)
        if "arch" in result:
            arch = json.loads(result["arch"])
            tracking.log_json_artifact(run_id, arch, "arch.json")
            tracking.get_client().set_tag(run_id, tracking.TAG_ARCH_SUMMARY, str(result.get("arch_summary", "")))
            tracking.get_client().set_tag(run_id, tracking.TAG_ARCH_ID, str(result.get("arch_id", "")))

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        run_id = self.run_ids.pop(trial.trial_id, None)
        if run_id is None:
            return
        last = trial.last_result or {}
        stages = self.stages.pop(trial.trial_id, None)
        if stages is not None:
            stages.close()
        if trial.trial_id not in self.done:
            bad = [k for k, v in last.items() if isinstance(v, float) and math.isnan(v)]
            tracking.end_run(run_id, "FAILED" if bad else "FINISHED")
        self.finished += 1
        if self.role == "trial":
            _console.print(f"trial {last.get(OPTUNA_TRIAL_KEY, trial.config.get(OPTUNA_TRIAL_KEY, '?'))} done: "
                           f"BLEU {last.get('bleu', float('nan')):.2f} "
                           f"chrF {last.get('chrf', float('nan')):.2f} {_latency_text(last)} "
                           f"params {last.get('params_m', float('nan')):.2f} M  {last.get('arch_summary', '')}")

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        run_id = self.run_ids.pop(trial.trial_id, None)
        stages = self.stages.pop(trial.trial_id, None)
        if stages is not None:
            stages.close("FAILED")
        error = error_line(getattr(trial, "error_file", None))
        if run_id is not None and trial.trial_id not in self.done:
            tracking.get_client().set_tag(run_id, tracking.TAG_ERROR, error[:4000])
            tracking.end_run(run_id, "FAILED")
        _console.print(f"[red]{self.role} {trial.config.get(OPTUNA_TRIAL_KEY, trial.trial_id)} failed[/red]: {error}")


def _latency_text(result: dict) -> str:
    """A trial's latency for its one line: ``latency 1.12x the reference (predicted 1.08x, 4% off; rounds' IQR 2%),
    76.5 ms``; the prediction and the interleaved rounds' spread (``latency_ratio_iqr``) only where the trial reported
    them."""
    nan = float("nan")
    text = f"latency {result.get('latency_ratio', nan):.2f}x the reference"
    notes = []
    if "latency_ratio_pred" in result:
        notes.append(f"predicted {result['latency_ratio_pred']:.2f}x, {result.get('latency_drift', nan):.0%} off")
    if "latency_ratio_iqr" in result:
        notes.append(f"rounds' IQR {result['latency_ratio_iqr']:.0%}")
    text += f" ({'; '.join(notes)})" if notes else ""
    return f"{text}, {result.get('latency_ms', nan):.1f} ms"
