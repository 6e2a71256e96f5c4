"""experiments/proof_of_value.py's report: goal checks, compute accounting, hypervolume and domination, computed from
hand-written result files (no training); and the report is a function of those files alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pov():
    return load_script("experiments/proof_of_value.py")


def _dump(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj), encoding="utf-8")


def _model(test_bleu: float, train_seconds: float, train_flops: float, out_dir: str, arch: str, **extra) -> dict:
    return {"arch_summary": arch, "arch_id": arch, "params_m": 1.0, "bleu": test_bleu - 1, "chrf": 50.0,
            "valid_loss": 2.0, "test_bleu": test_bleu, "test_chrf": 50.0, "latency_ms": 99.0,  # the retrain's own
            "train_seconds": train_seconds, "train_flops": train_flops, "wall_seconds": train_seconds + 5,
            "out_dir": out_dir, **extra}


def _case(out: Path, *, tiny_seed1_searched: float = 23.5, fast_bleu: float = 22.0, fast_ms: float = 10.0) -> None:
    """Baselines Tiny-S (20.0 BLEU, 10 ms), Tiny (22.0 and 22.4, 20 and 22 ms: mean 22.2 at 21 ms), Tiny-L (23.0,
    40 ms); searched A at Tiny's budget (23.6 and ``tiny_seed1_searched``, 19 ms; and from inherited weights), B at
    half Tiny's and at Tiny-S's budget (one folder: ``fast_bleu``, ``fast_ms``), C at Tiny-L's (24.0, 35 ms)."""
    b = out / "baselines"
    _dump(b / "tiny_s_seed0.json", _model(20.0, 60, 4e13, "m/ts0", "S", name="tiny_s", label="Tiny-S", seed=0,
                                          init="scratch"))
    _dump(b / "tiny_seed0.json", _model(22.0, 100, 1e14, "m/t0", "T", name="tiny", label="Transformer-Tiny", seed=0,
                                        init="scratch"))
    _dump(b / "tiny_seed1.json", _model(22.4, 100, 1e14, "m/t1", "T", name="tiny", label="Transformer-Tiny", seed=1,
                                        init="scratch"))
    _dump(b / "tiny_l_seed0.json", _model(23.0, 250, 2.5e14, "m/tl0", "L", name="tiny_l", label="Tiny-L", seed=0,
                                          init="scratch"))
    s = out / "searched"
    inherited = {"inherited_test_bleu": 21.0, "inherited_test_chrf": 48.0, "found": True}
    _dump(s / "tiny_scratch_seed0.json", _model(23.6, 100, 1e14, "m/A-s0", "A", budget="tiny", init="scratch", seed=0,
                                                **inherited))
    _dump(s / "tiny_scratch_seed1.json", _model(tiny_seed1_searched, 100, 1e14, "m/A-s1", "A", budget="tiny",
                                                init="scratch", seed=1, **inherited))
    _dump(s / "tiny_inherited_seed0.json", _model(23.0, 100, 1e14, "m/A-i0", "A", budget="tiny", init="inherited",
                                                  seed=0, **inherited))
    for budget in ("half_tiny", "tiny_s"):  # the same best trial under both budgets: one folder
        _dump(s / f"{budget}_scratch_seed0.json", _model(fast_bleu, 50, 5e13, "m/B-s0", "B", budget=budget,
                                                         init="scratch", seed=0, **inherited))
    _dump(s / "tiny_l_scratch_seed0.json", _model(24.0, 200, 2e14, "m/C-s0", "C", budget="tiny_l", init="scratch",
                                                  seed=0, **inherited))
    _dump(s / "tiny_l_inherited_seed9.json", {"budget": "tiny_l", "budget_ms": 40.0, "init": "inherited", "seed": 9,
                                              "found": False, "reason": "no finished trial meeting latency_ms<=40"})
    quiet = {"baselines/tiny_s_seed0": 10.0, "baselines/tiny_seed0": 20.0, "baselines/tiny_seed1": 22.0,
             "baselines/tiny_l_seed0": 40.0, "searched/tiny_scratch_seed0": 19.0, "searched/tiny_scratch_seed1": 19.0,
             "searched/tiny_inherited_seed0": 19.0, "searched/half_tiny_scratch_seed0": fast_ms,
             "searched/tiny_s_scratch_seed0": fast_ms, "searched/tiny_l_scratch_seed0": 35.0}
    _dump(out / "latency_quiet.json", {"latency_ms": quiet})
    _dump(out / "supernet.json", {"train_seconds": 1000.0, "wall_seconds": 1010.0, "train_flops": 5e15, "steps": 1000})
    _dump(out / "search.json", {"wall_seconds": 300.0, "sweep_id": "S1", "method": "evolution", "trials_completed": 12,
                                "trials_failed": 0, "trials": []})


def test_goals_met_with_the_numbers_computed_by_hand(pov, tmp_path):
    _case(tmp_path)
    g = pov.check_goals(pov.load_rows(tmp_path))
    assert g["tiny_latency_ms"] == pytest.approx(21.0)  # (20 + 22) / 2, quiet
    g1 = g["1_gap_at_tiny_latency"]
    assert g1["searched_seeds"] == [0, 1] and g1["tiny_seeds"] == [0, 1]
    assert g1["gap_bleu"] == pytest.approx(23.5 - 22.4) and g1["within_latency"] and g1["met"] is True
    g2 = g["2_half_latency_within"]
    assert g2["half_latency_ms"] == pytest.approx(10.5) and g2["best"] == "B"
    assert g2["shortfall_bleu"] == pytest.approx(22.2 - 22.0) and g2["met"] is True
    g3 = g["3_baselines_dominated"]
    assert g3["met"] is True and g3["dominated"] == 3
    assert g3["baselines"]["tiny_s"]["dominated_by"] == ["B"]  # 22.0 >= 20.0 at 10 ms <= 10 ms: a tie counts
    assert g3["baselines"]["tiny"]["dominated_by"] == ["A"]  # seed means 23.55 at 19 ms vs 22.2 at 21 ms
    assert g3["baselines"]["tiny_l"]["dominated_by"] == ["A", "C"]


def test_goals_missed_with_the_numbers_computed_by_hand(pov, tmp_path):
    _case(tmp_path, tiny_seed1_searched=23.3, fast_bleu=21.8, fast_ms=10.2)
    g = pov.check_goals(pov.load_rows(tmp_path))
    g1 = g["1_gap_at_tiny_latency"]
    assert g1["gap_bleu"] == pytest.approx(23.3 - 22.4) and g1["met"] is False  # 0.9 < 1.0
    g2 = g["2_half_latency_within"]
    assert g2["shortfall_bleu"] == pytest.approx(22.2 - 21.8) and g2["met"] is False  # 0.4 > 0.3, at 10.2 <= 10.5 ms
    g3 = g["3_baselines_dominated"]
    assert g3["met"] is False and g3["dominated"] == 2
    assert g3["baselines"]["tiny_s"]["dominated_by"] == []  # B is 0.2 ms slower than Tiny-S


def test_goals_undecided_or_missed_when_models_are_absent_or_too_slow(pov, tmp_path):
    _case(tmp_path, fast_ms=11.0)  # B slower than half Tiny (10.5 ms): no candidate for goal 2
    (tmp_path / "searched" / "tiny_scratch_seed1.json").unlink()
    g = pov.check_goals(pov.load_rows(tmp_path))
    assert g["1_gap_at_tiny_latency"]["met"] is None  # seed 1 missing: not decided
    assert g["2_half_latency_within"]["candidates"] == 0 and g["2_half_latency_within"]["met"] is False
    _case(tmp_path)
    quiet = json.loads((tmp_path / "latency_quiet.json").read_text())
    quiet["latency_ms"]["searched/tiny_scratch_seed1"] = 21.5  # quietly slower than Tiny: the budget is broken
    _dump(tmp_path / "latency_quiet.json", quiet)
    g1 = pov.check_goals(pov.load_rows(tmp_path))["1_gap_at_tiny_latency"]
    assert g1["gap_bleu"] >= 1.0 and not g1["within_latency"] and g1["met"] is False


def test_compute_accounting_counts_a_folder_once_and_sums_by_hand(pov, tmp_path):
    _case(tmp_path)
    c = pov.compute_accounting(tmp_path, pov.load_rows(tmp_path))
    hat, base, ratio = c["hat"], c["baselines"], c["ratio_hat_to_baselines"]
    assert hat["retrain_models"] == 5  # A seed 0, A seed 1, A inherited, B (two budgets, one folder), C
    assert hat["retrain_seconds"] == pytest.approx(100 + 100 + 100 + 50 + 200)
    assert hat["retrain_flops"] == pytest.approx(1e14 * 3 + 5e13 + 2e14)
    assert hat["one_off_seconds"] == pytest.approx(1000 + 300)
    assert hat["total_seconds"] == pytest.approx(1850) and hat["per_model_seconds"] == pytest.approx(370)
    assert hat["total_flops"] == pytest.approx(5.55e15) and hat["per_model_flops"] == pytest.approx(1.11e15)
    assert base["models"] == 4 and base["total_seconds"] == pytest.approx(60 + 100 + 100 + 250)
    assert base["total_flops"] == pytest.approx(4.9e14) and base["per_model_seconds"] == pytest.approx(127.5)
    assert ratio["total_seconds"] == pytest.approx(1850 / 510)
    assert ratio["per_model_flops"] == pytest.approx(1.11e15 / 1.225e14)


def test_hypervolume_and_domination_by_hand(pov):
    # by latency: 20 x (44 - 10) = 680, then (22 - 20) x (44 - 21) = 46; the dominated and the outside points add 0
    points = [(20.0, 10.0), (22.0, 21.0), (21.0, 30.0), (30.0, 50.0), (-1.0, 5.0)]
    assert pov.hypervolume(points, 44.0) == pytest.approx(726.0)
    assert pov.hypervolume([], 44.0) == 0.0
    a, b = {"test_bleu": 22.0, "latency_ms": 10.0}, {"test_bleu": 22.0, "latency_ms": 10.0}
    assert pov.dominates(a, b) and pov.dominates(b, a)  # a tie counts
    assert not pov.dominates({"test_bleu": 22.1, "latency_ms": 10.1}, b)
    assert pov.dominates({"test_bleu": 23.0, "latency_ms": 9.0}, b) and not pov.dominates(b, {"test_bleu": 23.0,
                                                                                              "latency_ms": 9.0})


def test_budgets_are_baseline_seed_means_and_half_tiny(pov):
    quiet = {"baselines/tiny_seed0": 20.0, "baselines/tiny_seed1": 22.0, "baselines/tiny_s_seed0": 10.0,
             "searched/tiny_scratch_seed0": 5.0}
    assert pov.budgets_ms(quiet) == {"tiny": 21.0, "half_tiny": 10.5, "tiny_s": 10.0}
    assert pov.reference_ms({"baselines/tiny_s_seed0": 10.0}) is None


def test_report_is_reproduced_from_the_json_alone(pov, tmp_path):
    _case(tmp_path)
    results = pov.phase_report(tmp_path)
    first_md, first_json = (tmp_path / "results.md").read_bytes(), (tmp_path / "results.json").read_bytes()
    (tmp_path / "results.md").unlink()
    (tmp_path / "results.json").unlink()
    pov.phase_report(tmp_path)
    assert (tmp_path / "results.md").read_bytes() == first_md
    assert (tmp_path / "results.json").read_bytes() == first_json
    assert (tmp_path / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # means: Tiny-S (20, 10), Tiny (22.2, 21), Tiny-L (23, 40); reference 1.1 x 40 = 44 ms
    assert results["hypervolume"]["reference"]["latency_ms"] == pytest.approx(44.0)
    assert results["hypervolume"]["test_bleu"]["baselines"] == pytest.approx(20 * 34 + 2.2 * 23 + 0.8 * 4)
    md = first_md.decode()
    assert "+1.10 BLEU" in md and md.count("**met**") == 3 and "3 of 3" in md
    assert "| Transformer-Tiny | - | scratch | 1 | `T` | 1.00 | 22.0 | 1.05 | 22.40 |" in md
    assert "No trial within the tiny_l budget (40.0 ms) for inherited seed 9" in md
    assert "| **HAT pipeline, total** | 1850 | 5550.0 |" in md


def test_the_committed_gpu_report_is_reproduced_from_its_json(pov, tmp_path):
    """experiments/proof_of_value/gpu/results.md (the GPU protocol's tables in the docs) from the committed JSON
    files alone, byte for byte; and the goals it states are the ones the numbers give."""
    import shutil

    committed = ROOT / "experiments" / "proof_of_value" / "gpu"
    out = tmp_path / "gpu"
    shutil.copytree(committed, out)
    (out / "results.md").unlink()
    results = pov.phase_report(out)
    assert (out / "results.md").read_bytes() == (committed / "results.md").read_bytes()
    g1 = results["goals"]["1_gap_at_tiny_latency"]
    scratch = [r for r in results["models"] if r["kind"] == "searched" and r["budget"] == "tiny"]
    tiny = [r for r in results["models"] if r["kind"] == "baseline" and r["label"] == "Transformer-Tiny"]
    assert g1["gap_bleu"] == pytest.approx(min(r["test_bleu"] for r in scratch) - max(r["test_bleu"] for r in tiny))
    assert g1["met"] is (g1["gap_bleu"] >= 1.0)
