"""The one latency measurement (:mod:`nas.eval.latency.ratio`): the arch and the reference timed interleaved in one
process. Its statistic against a loop transcription, its order of runs, its stability across processes under
different contention, and the same ratio from a trial and from ``nas retrain`` (type-1 archs included)."""

from __future__ import annotations

import multiprocessing
import statistics
import time

import pytest
import torch

import nas.eval.latency.ratio as ratio_module
from nas.eval.latency import interleaved_timings, measure_latency_ratio
from nas.eval.latency.ratio import summarize_interleaved
from tests.eval.latency.conftest import MODEL_DIM, deep_and_shallow, tiny_space, tiny_supernet

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WORKLOAD = {"src_tokens": 10, "tgt_tokens": 8, "beam": 2, "batch": 1}


def test_the_ratio_is_the_median_of_each_run_over_the_mean_of_the_reference_runs_around_it():
    cand = [20.0, 30.0, 22.0]
    ref = [10.0, 10.0, 20.0, 10.0]  # R0 C0 R1 C1 R2 C2 R3: a slow spell around C1
    ratios = []
    for i in range(len(cand)):  # loop transcription: C_i / ((R_i + R_{i+1}) / 2)
        ratios.append(cand[i] / ((ref[i] + ref[i + 1]) / 2))
    assert ratios == [2.0, 2.0, 1.4666666666666666]
    got = summarize_interleaved(cand, ref)
    assert got["latency_ratio"] == statistics.median(ratios) == 2.0
    assert got["latency_ms"] == 22.0 and got["latency_reference_ms"] == 10.0
    assert summarize_interleaved(cand[:1], ref[:2])["latency_ratio"] == 2.0  # a prefix is a 1-round measurement
    assert summarize_interleaved(cand[:1], ref[:2])["latency_ratio_iqr"] == 0.0
    with pytest.raises(ValueError, match="3 candidate and 3 reference runs"):
        summarize_interleaved(cand, ref[:3])


def test_the_spread_is_the_interquartile_range_of_the_round_ratios_over_their_median():
    """Loop transcription: the per-round ratios sorted, quartiles by linear interpolation between order statistics
    at positions (n - 1) / 4 and 3 (n - 1) / 4 (the inclusive method, numpy's default 'linear')."""
    cand = [10.0, 12.0, 11.0, 30.0, 10.5]
    ref = [10.0] * 6  # every reference run 10 ms: round i's ratio is cand[i] / 10
    ratios = sorted(c / 10.0 for c in cand)  # [1.0, 1.05, 1.1, 1.2, 3.0]

    def quantile(q):
        pos = q * (len(ratios) - 1)
        lo = int(pos)
        return ratios[lo] + (pos - lo) * (ratios[min(lo + 1, len(ratios) - 1)] - ratios[lo])

    got = summarize_interleaved(cand, ref)
    assert got["latency_ratio"] == pytest.approx(1.1)
    assert got["latency_ratio_iqr"] == pytest.approx((quantile(0.75) - quantile(0.25)) / 1.1)
    assert got["latency_ratio_iqr"] == pytest.approx((1.2 - 1.05) / 1.1)  # one slow round (3.0x) does not widen it


def test_runs_alternate_reference_first_and_last_after_warmup(monkeypatch):
    order = []

    def fake_run(model, arch, workload):
        name = "C" if model is candidate else "R"

        def run():
            order.append(name)
            time.sleep(0.004 if name == "C" else 0.002)
        return run

    monkeypatch.setattr(ratio_module, "fixed_workload_run", fake_run)
    _, supernet = tiny_supernet(0)
    candidate, reference = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    cand_ms, ref_ms = interleaved_timings(candidate, None, reference, None, rounds=3, warmup=1)
    assert order == ["R", "C"] + ["R", "C", "R", "C", "R", "C", "R"]  # warm-up, then R0 C0 R1 C1 R2 C2 R3
    assert len(cand_ms) == 3 and len(ref_ms) == 4
    assert 1.4 < summarize_interleaved(cand_ms, ref_ms)["latency_ratio"] < 2.6  # 4 ms over 2 ms, sleeps overshoot
    with pytest.raises(ValueError, match="rounds=0"):
        interleaved_timings(candidate, None, reference, None, rounds=0)


def test_models_on_two_devices_are_refused():
    _, supernet = tiny_supernet(0)
    meta = torch.nn.Linear(1, 1, device="meta")
    with pytest.raises(ValueError, match="the candidate is on cpu but the reference on meta"):
        measure_latency_ratio(supernet, None, meta, None, workload=WORKLOAD, rounds=1)


def _busy(stop, computing) -> None:
    torch.set_num_threads(1)
    a = torch.randn(192, 192)
    a = torch.tanh(a @ a)
    computing.set()  # its imports are done: from here on the load is steady
    while not stop.is_set():
        a = torch.tanh(a @ a)


def _ratio_in_a_worker(queue, loaded: bool) -> None:
    """One worker process: the widest arch of :func:`deep_and_shallow` against the narrowest (the median of 5
    measurements of 25 rounds), with or without a busy neighbour process computing throughout.

    The neighbour signals once its imports are done and it computes; timing starts then, so that the contention is
    steady through the measurement (a CI run that started timing 0.5 s after spawning it, while it still imported
    torch, saw 1.85 quiet against 1.96 loaded)."""
    torch.set_num_threads(1)
    space, supernet = deep_and_shallow()
    from nas.model.supernet import extract

    ctx = multiprocessing.get_context("spawn")
    stop, computing = ctx.Event(), ctx.Event()
    neighbour = ctx.Process(target=_busy, args=(stop, computing), daemon=True) if loaded else None
    if neighbour is not None:
        neighbour.start()
        assert computing.wait(120), "the busy neighbour never started computing"
    try:
        wide, narrow = space.widest(), space.narrowest()
        wide_model, narrow_model = extract(supernet, wide), extract(supernet, narrow)
        got = statistics.median(measure_latency_ratio(wide_model, wide, narrow_model, narrow, workload=WORKLOAD,
                                                      rounds=25, threads=1)["latency_ratio"] for _ in range(5))
    finally:
        stop.set()
        if neighbour is not None:
            neighbour.join(5)
    queue.put(got)


@pytest.mark.slow  # over 5 s on 2 cores: out of the inner loop (pytest -m "not slow")
def test_two_worker_processes_under_different_contention_give_the_same_ratio_within_5_percent():
    ctx = multiprocessing.get_context("spawn")
    results = []
    for loaded in (False, True):  # one after the other: each worker's own conditions
        queue = ctx.Queue()
        worker = ctx.Process(target=_ratio_in_a_worker, args=(queue, loaded))
        worker.start()
        results.append(queue.get(timeout=240))
        worker.join(30)
    quiet, loaded = results
    assert quiet > 1.5  # the deep arch is measurably slower than the shallow one
    assert abs(loaded / quiet - 1) <= 0.05, (quiet, loaded)
