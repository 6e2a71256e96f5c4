"""Plots of a sweep: BLEU against latency (or any two objectives) with the Pareto front highlighted.

Rendered with matplotlib's Agg canvas (no display, no global pyplot state), written as PNG.
"""

from __future__ import annotations

import io
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from nas import tracking
from nas.atomic import atomic_write_bytes
from nas.tracking.pareto import Objective

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["PARETO_PLOT", "NO_BOTH_METRICS", "empty_plot_note", "log_pareto_plot", "pareto_figure", "pareto_png",
           "write_pareto_plot"]

PARETO_PLOT = "pareto.png"
"""Artifact name of the plot on a sweep's parent run."""

_LABELS = {"bleu": "BLEU", "chrf": "chrF", "latency_ms": "latency (ms)", "params_m": "parameters (M)",
           "valid_loss": "validation loss (nats/token)",
           "latency_ratio": "latency ratio (latency_ms / the reference arch's)"}
NO_BOTH_METRICS = "no trial with both metrics"
"""The empty plot's note when trials were plotted but none has a value for both objectives."""


def _label(o: Objective) -> str:
    return f"{_LABELS.get(o.metric, o.metric)}, {'higher' if o.maximize else 'lower'} is better"


def pareto_png(points: Sequence[Sequence[float | None]], on_front: Sequence[bool],
               objectives: Sequence[Objective], *, title: str = "", feasible: Sequence[bool] | None = None,
               latency_ms: Sequence[float | None] | None = None, empty_note: str | None = None) -> bytes:
    """The PNG (bytes) of :func:`pareto_figure` (same arguments and errors)."""
    buf = io.BytesIO()
    pareto_figure(points, on_front, objectives, title=title, feasible=feasible, latency_ms=latency_ms,
                  empty_note=empty_note).savefig(buf, format="png")
    return buf.getvalue()


def pareto_figure(points: Sequence[Sequence[float | None]], on_front: Sequence[bool],
                  objectives: Sequence[Objective], *, title: str = "", feasible: Sequence[bool] | None = None,
                  latency_ms: Sequence[float | None] | None = None, empty_note: str | None = None) -> Figure:
    """A matplotlib ``Figure`` (Agg canvas, 640x440 px) of ``points`` (``[n][2]``: values of ``objectives[0]``,
    ``objectives[1]``) with the first objective on the y axis and the second on the x axis (BLEU against
    latency_ms by default). Points with ``on_front[i]`` are drawn in red and joined by a step line; the others are
    grey; with ``feasible`` given, points violating the sweep's constraints are grey crosses. Points with a
    missing or NaN value are left out.

    An axis of ``latency_ratio`` (the budget of the quickstart) keeps the milliseconds beside it when ``latency_ms``
    (``[n]``, ms) is given: the front's points are labelled with their ``latency_ms`` and the axis label gives the
    range of the plotted points'. With no point on the front the plot carries a note: ``empty_note`` if given (the
    caller knows that a filter removed every trial), else "no trial to plot", "no trial meets its sweep's
    search.constraints" or :data:`NO_BOTH_METRICS`.

    Raises:
        ValueError: not exactly two objectives, or ``points`` and ``on_front`` (or ``feasible``,
            ``latency_ms``) differ in length.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if len(objectives) != 2:
        raise ValueError(f"a Pareto plot needs exactly two objectives, got {len(objectives)}")
    if len(points) != len(on_front):
        raise ValueError(f"{len(points)} points but {len(on_front)} front flags")
    feasible = [True] * len(points) if feasible is None else list(feasible)
    if len(feasible) != len(points):
        raise ValueError(f"{len(points)} points but {len(feasible)} feasibility flags")
    ms = [None] * len(points) if latency_ms is None else list(latency_ms)
    if len(ms) != len(points):
        raise ValueError(f"{len(points)} points but {len(ms)} latency_ms values")
    ok = [(p, f, g, t) for p, f, g, t in zip(points, on_front, feasible, ms)
          if all(v is not None and not math.isnan(v) for v in p)]
    fig = Figure(figsize=(6.4, 4.4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    infeasible = [p for p, f, g, t in ok if not g]
    if infeasible:
        ax.scatter([p[1] for p in infeasible], [p[0] for p in infeasible], s=22, c="0.75", marker="x",
                   label=f"violate constraints ({len(infeasible)})")
    rest = [p for p, f, g, t in ok if g and not f]
    front = sorted(((p, t) for p, f, g, t in ok if g and f), key=lambda pt: pt[0][1])  # along the x axis
    if rest:
        ax.scatter([p[1] for p in rest], [p[0] for p in rest], s=18, c="0.6", label=f"trials ({len(rest)})")
    if front:
        xs, ys = [p[1] for p, _ in front], [p[0] for p, _ in front]
        ax.step(xs, ys, where="post", c="tab:red", lw=1, alpha=0.7)
        ax.scatter(xs, ys, s=30, c="tab:red", zorder=3, label=f"Pareto front ({len(front)})")
        ax.legend(loc="best", fontsize=8)
    else:
        note = empty_note or ("no trial to plot" if not points else
                              "no trial meets its sweep's search.constraints" if infeasible else NO_BOTH_METRICS)
        ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, wrap=True)
    labels = [_label(objectives[0]), _label(objectives[1])]
    shown = [t for _, _, _, t in ok if t is not None and not math.isnan(t)]
    for axis, o in enumerate(objectives):
        if o.metric == "latency_ratio" and shown:  # the budget's axis, with the milliseconds beside it
            labels[axis] += f"\n(these trials: {min(shown):.0f}-{max(shown):.0f} ms; the front's points labelled in ms)"
            for p, t in front:
                if t is not None and not math.isnan(t):
                    ax.annotate(f"{t:.0f} ms", (p[1], p[0]), textcoords="offset points", xytext=(4, 4),
                                fontsize=7, color="tab:red")
            break
    ax.set_xlabel(labels[1])
    ax.set_ylabel(labels[0])
    ax.grid(True, alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def empty_plot_note(scan: tracking.ParetoScan) -> str | None:
    """The note of an empty plot of ``scan`` when it matched no run: that its ``--where`` filter removed every
    trial (named, with their number), or that there was no trial of its status; None when it matched runs."""
    if scan.scanned:
        return None
    kind = "trials" if scan.status == "all" else f"{scan.status} trials"
    if scan.where and scan.before_where:
        return f"the filter --where {' and '.join(scan.where)} removed all {scan.before_where} {kind}"
    return f"no {kind} to plot"


def write_pareto_plot(scan: tracking.ParetoScan, out: str | Path, *, title: str = "") -> Path:
    """Write the plot of a :func:`nas.tracking.pareto_scan` made with ``keep_points=True`` to the PNG
    file ``out`` (written to a temporary sibling, then moved into place); returns its path.

    Raises:
        ValueError: the scan kept no points although it matched runs, or has not two objectives.
    """
    if scan.scanned and not scan.points:
        raise ValueError("this Pareto scan kept no points; call pareto_scan(..., keep_points=True)")
    png = pareto_png(scan.points, scan.front_flags(), scan.objectives, title=title, feasible=scan.feasible,
                     latency_ms=scan.latency_ms or None, empty_note=empty_plot_note(scan))
    return atomic_write_bytes(Path(out), png)


def log_pareto_plot(experiment: str, sweep_id: str, parent_run_id: str) -> str | None:
    """Plot the FINISHED trials of sweep ``sweep_id`` in ``experiment`` (the objectives of
    :func:`nas.tracking.sweep_objectives`, BLEU against latency_ms by default) and log the PNG as
    artifact ``pareto.png`` of the parent run ``parent_run_id``.

    Returns the artifact path, or None (nothing logged) when the sweep has no finished trial.

    Raises:
        LookupError: no active experiment named ``experiment``.
        mlflow.MlflowException: unknown run or store errors.
    """
    parent = tracking.get_client().get_run(parent_run_id)
    objectives = tracking.sweep_objectives(parent)
    constraints = tracking.sweep_constraints(parent)
    scan = tracking.pareto_scan(experiment, objectives, sweep_id=sweep_id, keep_points=True)
    if not scan.scanned:
        return None
    feasible = f" ({sum(scan.feasible)} feasible: {', '.join(c.key for c in constraints)})" if constraints else ""
    with tempfile.TemporaryDirectory() as tmp:
        path = write_pareto_plot(scan, Path(tmp) / PARETO_PLOT,
                                 title=f"sweep {sweep_id}: {len(scan.front)} of {scan.scanned} trials on the front"
                                       + feasible)
        tracking.log_file_artifact(parent_run_id, path)
    return PARETO_PLOT
