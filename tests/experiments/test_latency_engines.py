"""experiments/latency_engines.py: the feasible front it reports per engine, on a hand-made example."""

from __future__ import annotations

from tests.conftest import load_script


def _module():
    return load_script("experiments/latency_engines.py")


def test_the_front_keeps_feasible_archs_no_other_feasible_arch_beats_on_both_and_orders_them_by_ratio():
    rows = [  # a dominates c; b is the fast end; d is best but infeasible; e ties a on both (kept, not dominated)
        {"arch": "a", "bleu": 30.0, "r": 1.1, "feasible_r": True},
        {"arch": "b", "bleu": 25.0, "r": 0.6, "feasible_r": True},
        {"arch": "c", "bleu": 29.0, "r": 1.2, "feasible_r": True},
        {"arch": "d", "bleu": 35.0, "r": 0.5, "feasible_r": False},
        {"arch": "e", "bleu": 30.0, "r": 1.1, "feasible_r": True},
    ]
    assert _module()._front(rows, "r") == ["b", "a", "e"]
