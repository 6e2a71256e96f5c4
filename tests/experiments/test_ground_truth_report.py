"""experiments/ground_truth.py's report: the true front at seed means, the best arch under each budget, Kendall tau
and top-5 hits, checked against answers worked out by hand; and the committed results.md is reproduced from the
committed JSONs alone."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gt():
    return load_script("experiments/ground_truth.py")


def _stack(layers: int, width: int | list[int] = 128, branches: int | list[int] = 1) -> dict:
    widths = width if isinstance(width, list) else [width] * layers
    bs = branches if isinstance(branches, list) else [branches] * layers
    return {"width": widths, "ffn_width": [256] * layers, "branches": bs}


def _row(key: str, kind: str, bleu: float, ms: float, seed: int = 0, arch_id: str | None = None,
         enc: dict | None = None, dec: dict | None = None) -> dict:
    """A per-model JSON as ``--phase collect`` and ``--phase latency`` write it; the valid loss falls as BLEU rises
    (10 - BLEU / 10), so both orders agree."""
    return {"key": key, "kind": kind, "seed": seed, "arch_id": arch_id or key, "arch_summary": f"arch {key}",
            "arch": {"encoder": enc or _stack(2), "decoder": dec or _stack(2)}, "params": 2_000_000,
            "latency_ms": ms, "latency_ratio": ms / 20.0, "test_bleu": bleu, "test_bleu_paper": bleu + 0.25,
            "test_chrf": 50.0, "valid_loss": 10 - bleu / 10, "valid_bleu": bleu - 1, "valid_chrf": 49.0,
            "steps_done": 806, "train_seconds": 200.0, "device": "GPU X", "latency_cpu": "CPU Y",
            "latency_avx512_bf16": False, "latency_rounds": 15, "averaged_snapshots": [248, 310, 806],
            "recipe": {"checkpoint_every": 62, "max_tokens": 8192, "warmup_steps": 201, "lr": 0.005}}


def _case() -> list[dict]:
    """(test BLEU, ms): Tiny-S (19, 8); A (20, 10); Tiny seeds 22.0 and 22.4 at 20 ms (mean 22.2); B (22.0, 20);
    F (22.5, 18); C (21, 25); D (25, 30); E (25, 35); Tiny-L (24, 40).

    By hand: the front is Tiny-S, A, F, D. B ties Tiny's seed 0 but is dominated by Tiny's mean (and F); Tiny by F;
    Tiny-L by D; E by D (same BLEU, slower)."""
    return [_row("baseline_tiny_s_seed0", "baseline", 19.0, 8.0),
            _row("uniform_a", "uniform", 20.0, 10.0),
            _row("baseline_tiny_seed0", "baseline", 22.0, 20.0, seed=0, arch_id="tiny"),
            _row("baseline_tiny_seed1", "baseline", 22.4, 20.0, seed=1, arch_id="tiny"),
            _row("uniform_b", "uniform", 22.0, 20.0),
            _row("uniform_f", "uniform", 22.5, 18.0),
            _row("uniform_c", "uniform", 21.0, 25.0),
            _row("deep_d", "deep", 25.0, 30.0),
            _row("deep_e", "deep", 25.0, 35.0),
            _row("baseline_tiny_l_seed0", "baseline", 24.0, 40.0, dec=_stack(6))]


def test_the_front_takes_a_baseline_with_two_seeds_at_its_seed_mean(gt):
    rep = gt.report(_case(), None)
    assert [p["key"] for p in rep["front"]] == ["baseline_tiny_s", "uniform_a", "uniform_f", "deep_d"]
    tiny = next(p for p in rep["points"] if p["key"] == "baseline_tiny")
    assert tiny["test_bleu"] == pytest.approx(22.2) and tiny["seeds"] == [0, 1]
    base = {b["key"]: b for b in rep["baselines"]}
    assert base["baseline_tiny_s"]["on_front"] and base["baseline_tiny_s"]["dominated_by"] == []
    assert base["baseline_tiny"]["dominated_by"] == ["uniform_f"]
    assert base["baseline_tiny_l"]["dominated_by"] == ["deep_d"]


def test_best_under_each_budget_and_its_margin_worked_by_hand(gt):
    rep = gt.report(_case(), None)
    b = {x["budget"]: x for x in rep["budgets"]}
    # half Tiny = 10 ms: Tiny-S (19) and A (20); A, 20 - 22.2 against Tiny
    assert b["half_tiny"]["latency_ms"] == pytest.approx(10.0) and b["half_tiny"]["best"]["key"] == "uniform_a"
    assert b["half_tiny"]["margin_bleu"] == pytest.approx(-2.2)
    assert b["tiny_s"]["best"] is None and b["tiny_s"]["candidates"] == 0  # nothing but Tiny-S itself at 8 ms
    assert b["tiny"]["best"]["key"] == "uniform_f" and b["tiny"]["margin_bleu"] == pytest.approx(0.3)
    assert b["tiny"]["candidates"] == 4  # Tiny-S, A, B, F
    assert b["tiny_l"]["best"]["key"] == "deep_d" and b["tiny_l"]["margin_bleu"] == pytest.approx(1.0)  # D ties E
    t = rep["beats_tiny"]
    assert t["archs_better"] == ["uniform_f"] and t["margin_bleu"] == pytest.approx(0.3)
    assert t["seed_spread_bleu"] == pytest.approx(0.4) and t["exceeds_seed_spread"] is False
    md = gt.markdown(rep)
    assert "**1 arch beats Tiny** (22.20, seeds 22.00 and 22.40) at or under its 20.0 ms" in md
    assert "by +0.30 BLEU: no more than Tiny's seed spread `|seed0 - seed1|` = 0.40 BLEU. It ran one seed" in md
    assert "| Tiny-S | 8.0 | 0 | none | - | - | - | Tiny-S 19.00 | - |" in md


def test_kendall_tau_on_pairs_counted_by_hand(gt):
    # pairs of (1, 2, 3, 4) against (1, 3, 2, 4): 5 concordant, 1 discordant -> (5 - 1) / 6
    assert gt.kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    # tau-b with a tie in y: (1, 2, 3) against (1, 1, 2): 2 concordant, 0 discordant, 1 tie in y -> 2 / sqrt(3 * 2)
    assert gt.kendall_tau([1, 2, 3], [1, 1, 2]) == pytest.approx(2 / math.sqrt(6))
    assert gt.kendall_tau([1, 1, 1], [1, 2, 3]) is None and gt.kendall_tau([1], [1]) is None
    # every resample of a perfectly ordered list is perfectly ordered (or constant, and dropped)
    assert gt.bootstrap_tau([1, 2, 3, 4, 5], [2, 4, 6, 8, 10]) == pytest.approx((1.0, 1.0))
    low, high = gt.bootstrap_tau([1, 2, 3, 4], [1, 3, 2, 4])
    assert -1.0 <= low <= 4 / 6 <= high <= 1.0 and (low, high) == gt.bootstrap_tau([1, 2, 3, 4], [1, 3, 2, 4])


def test_top_k_hits_counted_by_hand(gt):
    bleu = {"a": 30, "b": 29, "c": 28, "d": 27, "e": 26, "f": 25, "g": 24}
    loss = {"a": 1.0, "g": 1.1, "b": 1.2, "f": 1.3, "c": 1.4, "d": 1.5, "e": 1.6}
    # true top 5: a b c d e; the supernet's: a g b f c -> a, b, c
    assert gt.top_k_hits(bleu, loss) == (3, 5)
    assert gt.top_k_hits(bleu, loss, k=2) == (1, 2)  # a b against a g
    assert gt.top_k_hits({"b": 29, "g": 24}, loss) == (2, 2)  # k cut to the archs under the budget


def test_ranking_per_snapshot_over_the_archs_in_the_space(gt):
    """Snapshot 10: the inherited loss is the ground truth's valid loss (tau 1 against it and against minus BLEU:
    the same order and the same tie, D = E). Snapshot 20: reversed (tau -1); its top 5 under Tiny-L's 40 ms is
    the 5 worst of the 8 in-space archs (Tiny-S, A, C, B, Tiny) against the true D, E, F, Tiny, B: 2 hits."""
    rows = _case()
    points = gt.arch_points(rows)
    inside = [p for p in points if p["key"] != "baseline_tiny_l"]
    ranking = {"metric": "inherited valid loss", "notes": "hand-made",
               "snapshots": {"20": {"by_arch_id": {p["arch_id"]: -p["valid_loss"] for p in inside}},
                             "10": {"by_arch_id": {p["arch_id"]: p["valid_loss"] for p in inside}}}}
    r = gt.report(rows, ranking)["ranking"]
    first, second = r["snapshots"]
    assert (first["step"], second["step"]) == (10, 20) and first["archs"] == 8
    assert first["outside"] == ["baseline_tiny_l"]
    for key in ("valid_loss", "minus_test_bleu"):
        assert first[key] == {"tau": pytest.approx(1.0), "low": pytest.approx(1.0), "high": pytest.approx(1.0)}
        assert second[key]["tau"] == pytest.approx(-1.0)
    top = {t["budget"]: (t["hits"], t["k"]) for t in second["top_k"]}
    assert top == {"tiny_s": (1, 1), "tiny": (5, 5), "tiny_l": (2, 5)}  # Tiny-S alone; 5 archs at 20 ms
    assert {t["budget"]: t["hits"] for t in first["top_k"]} == {"tiny_s": 1, "tiny": 5, "tiny_l": 5}
    picks = {t["budget"]: (t["pick"]["key"], t["pick"]["true_rank"], t["archs"]) for t in second["top_k"]}
    assert picks == {"tiny_s": ("baseline_tiny_s", 1, 1), "tiny": ("baseline_tiny_s", 5, 5),
                     "tiny_l": ("baseline_tiny_s", 8, 8)}  # the worst arch under each budget
    best = {t["budget"]: (t["pick"]["key"], t["pick"]["true_rank"]) for t in first["top_k"]}
    assert best["tiny_l"] == ("deep_d", 1) and best["tiny"] == ("uniform_f", 1)  # D ties E: the key decides
    md = gt.markdown(gt.report(rows, ranking))
    assert "| 20 | Tiny-S 19.00 (1 of 1) | Tiny-S 19.00 (5 of 5) | Tiny-S 19.00 (8 of 8) |" in md
    assert "| 20 | 8 | -1.000 [-1.000, -1.000] | -1.000 [-1.000, -1.000] | 1 of 1 | 5 of 5 | 2 of 5 |" in md


def test_dimension_groups_name_uniform_and_mixed_stacks(gt):
    rows = [_row("uniform_a", "uniform", 20.0, 10.0, dec=_stack(2, width=[64, 64])),
            _row("uniform_b", "uniform", 24.0, 20.0, dec=_stack(2, width=[64, 128]),
                 enc=_stack(3, branches=[1, 2, 2])),
            _row("baseline_tiny_seed0", "baseline", 22.0, 30.0, arch_id="tiny")]
    d = gt.dimension_groups(gt.arch_points(rows))
    assert [(g["value"], g["archs"]) for g in d["decoder width"]] == [("64", 1), ("128", 1), ("mixed", 1)]
    enc = {g["value"]: g for g in d["encoder branches"]}
    assert enc["1"]["archs"] == 2 and enc["1"]["test_bleu"] == pytest.approx(21.0)
    assert enc["1"]["latency_ms"] == pytest.approx(20.0) and enc["mixed"]["archs"] == 1
    assert [g["value"] for g in d["encoder depth"]] == ["2", "3"]


def test_the_committed_results_md_is_reproduced_from_the_committed_json(gt):
    """experiments/ground_truth/results.md from archs/*.json and supernet_ranking.json (when committed), byte for
    byte; and the verdict it states is the one the numbers give."""
    out = ROOT / "experiments" / "ground_truth"
    ranking = json.loads((out / "supernet_ranking.json").read_text()) if (out / "supernet_ranking.json").is_file() \
        else None
    rep = gt.report(gt.load_rows(out / "archs"), ranking)
    assert gt.markdown(rep).encode("utf-8") == (out / "results.md").read_bytes()
    t = rep["beats_tiny"]
    fit = [p for p in rep["points"] if p["latency_ms"] <= t["tiny_latency_ms"] and p["key"] != "baseline_tiny"]
    assert t["best"]["test_bleu"] == max(p["test_bleu"] for p in fit)
    assert t["seed_spread_bleu"] == pytest.approx(abs(t["tiny_seed_bleu"][0] - t["tiny_seed_bleu"][1]))


def test_the_docs_page_is_the_hand_written_head_and_the_committed_results(gt):
    page = gt.DOCS_PAGE.read_text(encoding="utf-8")
    assert page == gt.docs_page(gt.DOC_HEAD.read_text(encoding="utf-8"),
                                (gt.OUT / "results.md").read_text(encoding="utf-8"))
