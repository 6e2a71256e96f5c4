"""benchmarks/bench_serving.py's fixed-length table: the medians' ratio (the goals) and the rounds' own ratios with
their quartiles, on hand-made worker records (the engines themselves run in ``tests/export``)."""

from __future__ import annotations

from argparse import Namespace

import numpy as np
import pytest

from tests.conftest import load_script


def _bench():
    return load_script("benchmarks/bench_serving.py")


def test_round_ratios_pair_each_round_with_the_baselines_same_round():
    bench = _bench()
    mine, base = [2.0, 3.0, 1.0], [1.0, 2.0, 4.0]
    assert bench.round_ratios(mine, base) == [2.0, 1.5, 0.25]
    with pytest.raises(ValueError, match="3 rounds against the baseline's 2"):
        bench.round_ratios(mine, base[:2])


@pytest.mark.parametrize("values", [[1.3, 0.9, 1.1, 1.0, 1.2, 0.95, 1.05], [1.0, 2.0, 3.0, 4.0], [5.0, 1.0, 3.0]])
def test_quartiles_are_numpys_linear_percentiles(values):
    lo, hi = _bench().quartiles(values)
    assert (lo, hi) == pytest.approx((np.percentile(values, 25), np.percentile(values, 75)))


def test_quartiles_of_one_round_are_that_round():
    assert _bench().quartiles([1.7]) == (1.7, 1.7)


def _worker_record(seconds: float) -> dict:
    return {"fixed": [{"seconds": seconds, "output_lengths": [29], "outputs": [[5] * 29]}]}


def test_the_table_shows_the_medians_ratio_and_the_rounds_quartiles(capsys):
    bench = _bench()
    # the machine drifts: CTranslate2's rounds slow down as ours do, so each round's ratio is near 1.1 while the
    # ratio of the medians (over unpaired rounds) says 1.0
    ct2 = [1.0, 1.0, 2.0, 2.0, 2.0]
    ours = [1.1, 1.1, 1.1, 2.2, 2.2]
    runs = {"pytorch-aot": [_worker_record(s) for s in ours], "ctranslate2-fp32": [_worker_record(s) for s in ct2]}
    args = Namespace(threads=1, rounds=5, untrained=True, fixed=30, grid=[(4, 1)])
    result = bench._report(args, ["pytorch-aot", "ctranslate2-fp32"], runs, {"sources": [], "ids": [[5, 3]] * 32})
    row = next(r for r in result["fixed_length"] if r["engine"] == "pytorch-aot")
    assert row["time_vs_baseline"] == pytest.approx(1.1 / 2.0)  # medians: 1.1 over 2.0
    assert row["ratio_by_round"] == pytest.approx([1.1, 1.1, 0.55, 1.1, 1.1])
    assert row["ratio_quartiles"] == pytest.approx((1.1, 1.1))
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.split()[:2] == ["4", "1"])
    assert line.split()[2:] == ["0.55", "(1.10-1.10)", "1.00", "(16.0)"]
    assert "goal beam 4, batch 1: pytorch-aot at 0.55x CTranslate2 fp32's time (goal 1.0x or less): met" in out
