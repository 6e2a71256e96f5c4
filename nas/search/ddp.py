"""Data-parallel supernet training with Ray Train's ``TorchTrainer`` (N workers, gloo on CPUs, NCCL on GPUs).

Each worker runs :func:`trainers.train_supernet` inside the process group Ray Train sets up. The
loop itself is data-parallel (see its docstring): every rank samples the same sub-Transformers (one
RNG seeded identically), takes rows ``rank::world`` of each batch, and the gradients are summed
with one all-reduce per step, so a step equals the single-process step on the whole batch. Only
rank 0 writes checkpoints and the supernet; a restarted worker group resumes from them
(``max_failures``). Every report carries ``param_sum`` and ``param_sq`` (float64 sums of the
parameters and of their squares) from each rank; :class:`ReportSink`, on the Ray Train
controller, refuses to go on when the ranks disagree.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ray.train.torch import TorchTrainer
from ray.train.v2.api.callback import UserCallback

from nas.search.ray_session import quiet_worker_exit
from nas.data import PreparedData
from nas.space import SweepSpec

__all__ = ["train_supernet_ddp", "ReportSink", "OutOfSyncError"]


class OutOfSyncError(RuntimeError):
    """Data-parallel workers hold different parameters."""


class ReportSink(UserCallback):
    """Ray Train controller callback: checks that every rank reports the same parameters, writes each
    report (all ranks) as a JSON line to ``log_file`` and rank 0's metrics to MLflow.

    Args:
        log_file: JSON-lines file, one line per report: ``{"ranks": [metrics of rank 0, 1, ...]}``.
        mlflow_uri, experiment, supernet_run_id: where rank 0's metrics go (all or none), through
            :class:`nas.tracking.StageRuns` (the supernet run plus one nested run per training stage).
    Raises:
        OutOfSyncError: from :meth:`after_report`, when the ranks' ``param_sum``/``param_sq`` differ.
    """

    def __init__(self, log_file: str | Path | None = None, mlflow_uri: str | None = None,
                 experiment: str | None = None, supernet_run_id: str | None = None) -> None:
        self.log_file = str(log_file) if log_file else None
        self.mlflow_uri, self.experiment, self.supernet_run_id = mlflow_uri, experiment, supernet_run_id
        self._stages = None

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        check_in_sync(metrics)
        if self.log_file:
            with open(self.log_file, "a", encoding="utf-8") as f:
                f.write(json.dumps({"ranks": metrics}) + "\n")
        if self.supernet_run_id:
            if self._stages is None:  # in the controller's process: point MLflow at the driver's store
                import mlflow

                from nas import tracking

                mlflow.set_tracking_uri(self.mlflow_uri)
                self._stages = tracking.StageRuns(self.experiment, self.supernet_run_id)
            self._stages({k: v for k, v in metrics[0].items() if k not in ("param_sum", "param_sq")})


def check_in_sync(metrics: list[dict[str, Any]]) -> None:
    """Raise :class:`OutOfSyncError` unless every rank's ``param_sum`` and ``param_sq`` equal rank 0's."""
    keys = ("param_sum", "param_sq")
    first = tuple(metrics[0].get(k) for k in keys)
    for rank, m in enumerate(metrics[1:], 1):
        other = tuple(m.get(k) for k in keys)
        if other != first:
            raise OutOfSyncError(f"data-parallel rank {rank} holds other parameters than rank 0 at step "
                                 f"{m.get('step')}: (sum, sum of squares) {other} vs {first}")


def _worker(config: dict[str, Any]) -> None:
    """Ray Train worker: the supernet loop in this rank's process group."""
    quiet_worker_exit()  # no "SystemExit" traceback when Ray stops this actor
    import ray.train
    import torch
    from ray.train.torch import get_device

    from trainers import train_supernet

    torch.set_num_threads(max(1, int(config["threads"])))
    # Ray Train sets this process's root logger to INFO with a console handler, and logs "Reporting training result
    # N: TrainingReport(...)" at each report through a logger named after its file; the loop prints its own lines
    logging.getLogger().setLevel(logging.WARNING)
    train_supernet(config["spec"], config["data"], config["out_dir"], report=ray.train.report, progress=False,
                   device=get_device())


QUIET_RAY_TRAIN_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
"""Ray Train settings (environment variables its controller passes on to the workers) that keep a sweep's output
its own; a value the user set wins. The print patch sends every ``print`` of a worker to the root logger *and*
to the console, so each step line came twice; the preemption watcher (a node-drain monitor for preemptible
clusters) prints a ``core_worker.cc`` error at each start (ray-project/ray#53727). Set
``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=1`` on preemptible nodes to have it back."""


class _QuietTorchTrainer(TorchTrainer):
    """``TorchTrainer`` without Ray Train's ``PlacementGroupCleanerCallback``.

    That callback starts an actor that asks Ray's State API every second whether the controller lives. The
    State API needs the dashboard, which ``nas`` starts Ray without (:func:`nas.search.ray_session.connect`),
    so the actor logged "Failed to query Ray Train Controller actor state" every second, and, with a second
    Ray instance on the host (two sweeps at once), crashed its thread with a traceback. What it guards, a
    placement group left behind by a controller that died while the driver lives, costs nothing here: the
    controller's failure ends ``fit`` and the sweep, and Ray frees a finished job's placement groups."""

    def _create_default_callbacks(self):  # a private hook of Ray Train v2 (ray 2.60, pinned in the image)
        try:
            from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
        except ImportError:  # another Ray: nothing to drop
            return super()._create_default_callbacks()
        return [c for c in super()._create_default_callbacks() if not isinstance(c, PlacementGroupCleanerCallback)]


def train_supernet_ddp(spec: SweepSpec, data: PreparedData, out_dir: str | Path, *, storage_path: str | Path,
                       name: str = "supernet-ddp", log_file: str | Path | None = None,
                       mlflow_uri: str | None = None, experiment: str | None = None,
                       supernet_run_id: str | None = None, max_failures: int = 0) -> dict[str, Any]:
    """Train the sweep's supernet with ``spec.resources.workers`` data-parallel Ray Train workers.

    Needs a running Ray (``ray.init``). Each worker gets ``resources.cpu`` CPUs and, when
    ``resources.gpu`` > 0, a GPU (NCCL); without GPUs the backend is gloo.

    Args:
        spec, data: the sweep and its prepared corpus.
        out_dir: the supernet folder (shared by the workers: a shared filesystem on a multi-node cluster).
        storage_path: Ray Train's run folder (a local path or URI).
        log_file, mlflow_uri, experiment, supernet_run_id: see :class:`ReportSink`.
        max_failures: worker-group restarts (each resumes from the last checkpoint in ``out_dir``).
    Returns:
        The final metrics of :func:`trainers.train_supernet` (rank 0's ``metrics.json``).
    Raises:
        ray.train.TrainingFailedError: a worker failed more than ``max_failures`` times, or the ranks
            went out of sync (:class:`OutOfSyncError`).
    """
    from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    for key, value in QUIET_RAY_TRAIN_ENV.items():
        os.environ.setdefault(key, value)

    res = spec.resources
    use_gpu = res.gpu > 0
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    trainer = _QuietTorchTrainer(
        _worker,
        train_loop_config={"spec": spec, "data": data, "out_dir": str(out_dir), "threads": res.cpu},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=res.workers, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": res.cpu, **({"GPU": res.gpu} if use_gpu else {})}),
        run_config=RunConfig(name=name, storage_path=str(Path(storage_path).resolve()) if "://" not in str(storage_path)
                             else str(storage_path),
                             callbacks=[ReportSink(log_file, mlflow_uri, experiment, supernet_run_id)],
                             failure_config=FailureConfig(max_failures=max_failures),
                             logging_config=LoggingConfig(log_level="WARNING")),
    )
    try:
        trainer.fit()
    finally:
        if supernet_run_id:  # stage runs the controller left open (stage_eval off, or a failure)
            from nas import tracking

            done = (out_dir / "metrics.json").is_file()
            for run in tracking.find_tagged_runs(experiment, {tracking.TAG_PARENT: supernet_run_id}, status="RUNNING"):
                tracking.end_run(run.info.run_id, "FINISHED" if done else "FAILED")
    return json.loads((out_dir / "metrics.json").read_text())

