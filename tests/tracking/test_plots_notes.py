"""What the Pareto plot says (issue 40): why it is empty, and the quickstart's budget (``latency_ratio``) on its
axis with the milliseconds beside it. Figures are read back from matplotlib, the scans from a real MLflow store."""

from __future__ import annotations

import pytest

from nas import tracking
from nas.tracking import Objective
from nas.tracking.plots import NO_BOTH_METRICS, empty_plot_note, pareto_figure, pareto_png, write_pareto_plot

EXP = "quickstart"
RATIO = (Objective("bleu", True), Objective("latency_ratio", False))
"""The quickstart's objectives (search.metrics of search_spaces/quickstart.yaml)."""


def _texts(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].texts]


def test_empty_plot_names_the_filter_that_removed_every_trial(quickstart_store, tmp_path):
    scan = tracking.pareto_scan(EXP, RATIO, where=["latency_ms<=20"], keep_points=True)
    assert scan.scanned == 0 and scan.before_where == 3
    note = empty_plot_note(scan)
    assert note == "the filter --where latency_ms<=20 removed all 3 FINISHED trials"
    assert _texts(pareto_figure([], [], RATIO, empty_note=note)) == [note]
    # the plot written for the scan carries that note, not "no trial with both metrics"
    written = write_pareto_plot(scan, tmp_path / "front.png", title="t").read_bytes()
    assert written == pareto_png([], [], RATIO, title="t", empty_note=note)
    assert written != pareto_png([], [], RATIO, title="t")
    # two filters, named together; a status with no trial says so, and a scan that matched runs needs no note
    scan = tracking.pareto_scan(EXP, RATIO, where=["bleu>=21", "latency_ratio<=1.0"], keep_points=True)
    assert empty_plot_note(scan) == "the filter --where bleu>=21 and latency_ratio<=1.0 removed all 3 FINISHED trials"
    scan = tracking.pareto_scan(EXP, RATIO, status="FAILED", where=["bleu>=1"], keep_points=True)
    assert scan.before_where == 0 and empty_plot_note(scan) == "no FAILED trials to plot"
    assert empty_plot_note(tracking.pareto_scan(EXP, RATIO, keep_points=True)) is None


def test_empty_plot_says_why_when_nothing_is_on_the_front():
    assert _texts(pareto_figure([], [], RATIO)) == ["no trial to plot"]
    # trials that all break their sweep's constraints are drawn as crosses: the note says so
    fig = pareto_figure([(20.0, 1.7)], [False], RATIO, feasible=[False])
    assert _texts(fig) == ["no trial meets its sweep's search.constraints"]
    assert _texts(pareto_figure([(20.0, None)], [False], RATIO)) == [NO_BOTH_METRICS]
    assert _texts(pareto_figure([(20.0, 1.1)], [True], RATIO)) == []  # a front: no note


def test_ratio_axis_keeps_the_milliseconds_beside_it(quickstart_store):
    scan = tracking.pareto_scan(EXP, RATIO, sweep_id="S", keep_points=True)
    assert sorted(scan.latency_ms) == [69.0, 75.0, 108.0]
    fig = pareto_figure(scan.points, scan.front_flags(), scan.objectives, feasible=scan.feasible,
                        latency_ms=scan.latency_ms)
    ax = fig.axes[0]
    assert ax.get_xlabel().startswith("latency ratio (latency_ms / the reference arch's), lower is better")
    assert "69-108 ms" in ax.get_xlabel()
    assert sorted(_texts(fig)) == ["69 ms", "75 ms"]  # the front (the 1.70 trial breaks latency_ratio<=1.25)
    assert ax.get_ylabel() == "BLEU, higher is better"
    # without latency_ms, or on a latency_ms axis, nothing is added
    assert _texts(pareto_figure(scan.points, scan.front_flags(), scan.objectives, feasible=scan.feasible)) == []
    ms = pareto_figure([(20.0, 69.0)], [True], (Objective("bleu", True), Objective("latency_ms", False)),
                       latency_ms=[69.0])
    assert _texts(ms) == [] and ms.axes[0].get_xlabel() == "latency (ms), lower is better"
    with pytest.raises(ValueError, match="1 points but 2 latency_ms values"):
        pareto_figure([(20.0, 1.1)], [True], RATIO, latency_ms=[69.0, 70.0])
