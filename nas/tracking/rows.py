"""A leaderboard row: one finished trial's metrics (no mlflow; :mod:`nas.tracking.query` fills them)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LeaderboardRow", "ROW_METRICS", "LOWER_IS_BETTER"]

ROW_METRICS = ("bleu", "chrf", "params_m", "latency_ms", "valid_loss", "latency_ratio", "latency_reference_ms")
"""The metrics a row carries (the columns after ``arch``), in the order error messages list them."""
LOWER_IS_BETTER = frozenset({"latency_ms", "params_m", "valid_loss", "latency_ratio", "latency_reference_ms"})
"""Row metrics that rank ascending."""


@dataclass(frozen=True)
class LeaderboardRow:
    """One finished trial. Metric units: BLEU and chrF in [0, 100], ``params_m`` in millions of
    parameters, ``latency_ms`` in milliseconds; ``None`` where the run lacks the metric."""

    run_id: str
    arch: str
    bleu: float | None
    chrf: float | None
    params_m: float | None
    latency_ms: float | None
    valid_loss: float | None
    sweep_id: str | None
    arch_id: str | None
    pareto: bool | None = None
    """On the Pareto front of the trials scanned (:func:`pareto_scan`); ``None`` where not computed."""
    feasible: bool | None = None
    """Meets the ``search.constraints`` of its sweep (read from the sweep's parent run,
    :func:`nas.space.constraints.violated`); ``None`` where its sweep records no constraints."""
    latency_ratio: float | None = None
    """``latency_ms`` over its sweep's reference arch's (``search.latency_reference``); ``None`` where not reported."""
    latency_reference_ms: float | None = None
    """The reference arch's latency (ms) on the same workload and device; ``None`` where not reported."""
    retrain_bleu: float | None = None
    """BLEU of this trial's arch trained alone (``nas retrain``; the newest FINISHED retrain run naming this trial
    in ``nas.source_run_id``), beside the inherited ``bleu``; ``None`` where it was not retrained."""
    retrain_chrf: float | None = None
    """chrF of that retrained model."""
    retrain_latency_ms: float | None = None
    """Fixed-length latency (ms) of that retrained model, timed when it finished."""
    retrain_run_id: str | None = None
    """That retrain run (``nas export --run-id`` exports its weights)."""
    point: str | None = None
    """The name of the ``search.points_to_evaluate`` entry the trial was started from (tag ``nas.point``: ``tiny`` for
    a named arch, ``narrowest``, ``points_to_evaluate.2``); ``None`` for a sampled trial."""
