"""Ray Tune + Optuna orchestration (imports ray and optuna: keep it out of nas.model)."""

from nas.search.runner import SweepResult, make_sampler, prepare_sweep_data, run_sweep

__all__ = ["run_sweep", "prepare_sweep_data", "SweepResult", "make_sampler"]
