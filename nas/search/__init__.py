"""Ray Tune + Optuna orchestration (imports ray and optuna: keep it out of nas.model)."""

from nas.search.runner import (SweepFailed, SweepResult, SweepStatus, make_sampler, prepare_sweep_data, run_sweep,
                               sweep_status)

__all__ = ["run_sweep", "prepare_sweep_data", "SweepResult", "SweepFailed", "SweepStatus", "make_sampler",
           "sweep_status"]
