"""Ray Tune + Optuna orchestration of a sweep (imports ray and optuna: kept out of the model and trainers).

- ``runner``: a sweep end to end (data, supernet stage, search stage, fine-tune stage), resume, status;
- ``tune``: Ray Tune plumbing shared by the stages (experiment folders, restore, run configs);
- ``searcher``: the durable Optuna searcher (the study is the state) and ``StudyRef``;
- ``trials``: the Ray Tune trainables (supernet training, inherited-weight scoring);
- ``callbacks``: MLflow child runs from Ray Tune results (one writer: the driver);
- ``finetune``: the ASHA fine-tune stage of the best candidates;
- ``ddp``: data-parallel supernet training through Ray Train;
- ``fidelity``: ranking fidelity, inherited-weight scores against standalone training (``nas fidelity``;
  imports no ray or optuna);
- ``latency_fit``: the HAT latency predictor of a trained supernet on this machine (``nas latency fit``).

The public names below are loaded on first use (PEP 562), so importing ``nas.search`` or
``nas.search.fidelity`` does not import ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nas.lazy import lazy_exports

if TYPE_CHECKING:
    from nas.search.fidelity import METRICS as FIDELITY_METRICS
    from nas.search.fidelity import check_supernet, log_fidelity, run_fidelity, warning_text
    from nas.search.latency_fit import LatencyFit, default_predictor_path, fit_latency
    from nas.search.failures import SweepFailed, SweepStopped
    from nas.search.runner import SPEC_COPY, SweepResult, SweepStatus, read_sweep_record, run_sweep, sweep_status

_MODULES = {
    "runner": ("run_sweep", "SweepResult", "SweepStatus", "sweep_status", "read_sweep_record", "SPEC_COPY"),
    "failures": ("SweepFailed", "SweepStopped"),
    "fidelity": ("check_supernet", "log_fidelity", "run_fidelity", "warning_text"),
    "latency_fit": ("LatencyFit", "default_predictor_path", "fit_latency"),
}
"""Submodule -> the public names it defines (what the CLI and the API import; the rest are internals)."""
__all__ = [name for names in _MODULES.values() for name in names] + ["FIDELITY_METRICS"]

_lazy_getattr, __dir__ = lazy_exports(globals(), {name: module for module, names in _MODULES.items() for name in names})


def __getattr__(name: str):
    if name == "FIDELITY_METRICS":  # nas.search.fidelity.METRICS under a name that says whose metrics they are
        from nas.search.fidelity import METRICS

        return METRICS
    return _lazy_getattr(name)
