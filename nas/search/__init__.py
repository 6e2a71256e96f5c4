"""Ray Tune + Optuna orchestration of a sweep (imports ray and optuna: kept out of the model and trainers).

- ``runner``: a sweep end to end (data, supernet stage, search stage, fine-tune stage), resume, status;
- ``tune``: Ray Tune plumbing shared by the stages (experiment folders, restore, run configs);
- ``searcher``: the durable Optuna searcher (the study is the state) and ``StudyRef``;
- ``trials``: the Ray Tune trainables (supernet training, inherited-weight scoring);
- ``callbacks``: MLflow child runs from Ray Tune results (one writer: the driver);
- ``finetune``: the ASHA fine-tune stage of the best candidates;
- ``ddp``: data-parallel supernet training through Ray Train;
- ``fidelity``: ranking fidelity, inherited-weight scores against standalone training (``nas fidelity``;
  imports no ray or optuna).

The public names below come from ``runner`` and are loaded on first use (PEP 562), so importing
``nas.search.fidelity`` does not import ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nas.lazy import lazy_exports

if TYPE_CHECKING:
    from nas.search.runner import SweepFailed, SweepResult, SweepStatus, run_sweep, sweep_status

__all__ = ["run_sweep", "SweepResult", "SweepFailed", "SweepStatus", "sweep_status"]


__getattr__, __dir__ = lazy_exports(globals(), {name: "runner" for name in __all__})
