"""Ray Tune + Optuna orchestration of a sweep (imports ray and optuna: kept out of the model and trainers).

- ``runner``: a sweep end to end (data, supernet stage, search stage, fine-tune stage), resume, status;
- ``tune``: Ray Tune plumbing shared by the stages (experiment folders, restore, run configs);
- ``searcher``: the durable Optuna searcher (the study is the state) and ``StudyRef``;
- ``trials``: the Ray Tune trainables (supernet training, inherited-weight scoring);
- ``callbacks``: MLflow child runs from Ray Tune results (one writer: the driver);
- ``finetune``: the ASHA fine-tune stage of the best candidates;
- ``ddp``: data-parallel supernet training through Ray Train.
"""

from nas.search.runner import SweepFailed, SweepResult, SweepStatus, run_sweep, sweep_status

__all__ = ["run_sweep", "SweepResult", "SweepFailed", "SweepStatus", "sweep_status"]
