"""The one measurement of an arch's latency: the candidate and the reference arch timed interleaved in one process.

Every figure a sweep compares with a ``latency_ratio`` budget comes from :func:`measure_latency_ratio`: a trial's
(:mod:`nas.search.trials`), level 1's predictor samples (:func:`nas.eval.latency.collect_samples`, also
``nas latency fit``) and ``nas retrain``'s. Nothing else times a reference.

Why interleaved. On the 2-core VMs this project runs on, one beam search of the same arch takes anywhere from 48 to
105 ms from one moment to the next, and one run of the quickstart measured its reference arch at 88.7 ms in level 1
and at 44.2 and 59.4 ms in two level-2 worker processes: a ratio that divides by a reference timed once, at another
moment or in another process, depends on which process scored the trial. Here the reference and the candidate
alternate (reference, candidate, reference, ..., reference), each candidate run is divided by the mean of the two
reference runs around it, and the median of these per-round ratios is the figure; slow and fast phases of the
machine fall on both sides of each quotient. The medians of the candidate's and the reference's runs (ms) are
reported beside it.

This departs from HAT (Wang et al. 2020, sec. 4), which times each arch alone (5 warm-up runs, 20 timed, the top and
bottom 10% dropped, the rest averaged) and reports milliseconds: on a shared CPU an absolute time is not
reproducible, a ratio timed this way is (``benchmarks/bench_latency_ratio.py`` measures the spread).

The engine. By default each run is the model's own beam search in PyTorch (:func:`fixed_workload_run`). A caller
may pass ``runner``, a function that turns (model, arch, workload) into the call to time: ``search.latency_engine:
onnxruntime`` passes :func:`nas.export.latency_engine.onnx_runner`'s, which exports both models to ONNX and times
the exported translator. The runner comes from above (the export layer): this module does not know the engines.
"""

from __future__ import annotations

import gc
import statistics
import time
from contextlib import nullcontext
from typing import Callable, Mapping

import torch

from nas.eval.latency.timing import DEFAULT_WORKLOAD, fixed_workload_run, torch_threads
from nas.eval.measure_lock import MeasureLock
from nas.model.supernet import SuperTransformer
from nas.space.arch import Arch
from nas.space.schema.search import DEFAULT_LATENCY_ROUNDS

__all__ = ["DEFAULT_ROUNDS", "WARMUP_ROUNDS", "measure_latency_ratio", "interleaved_timings", "summarize_interleaved",
           "latency_device", "Runner"]

Runner = Callable[[SuperTransformer, "Arch | None", Mapping[str, int]], Callable[[], None]]
"""(model, arch, workload) -> the call to time, built before timing starts (:func:`fixed_workload_run` by default)."""

DEFAULT_ROUNDS = DEFAULT_LATENCY_ROUNDS
"""Interleaved rounds (one candidate run between two reference runs) of ``search.latency_repeats``' default: the
ratio's spread over repeated measurements stops shrinking past about 15 on a 2-core VM
(``benchmarks/bench_latency_ratio.py``; the figures are in ``docs/search.md``)."""

WARMUP_ROUNDS = 2
"""Untimed runs of each model (alternating) before the timed rounds: allocations, kernel selection, caches."""


def latency_device(named: str, scoring: torch.device) -> torch.device:
    """The device ``search.latency_device`` (``named``: ``trial``, ``cpu`` or ``cuda``) times on when the arch is
    scored on ``scoring``: trials, level 1's samples and ``nas retrain`` all choose it here.

    Raises:
        NasError: ``cuda`` named but the scoring device is no GPU (names the key and what to set).
    """
    from nas.errors import NasError

    if named == "trial":
        return scoring
    if named == "cuda" and scoring.type != "cuda":
        raise NasError(f"search.latency_device: cuda, but this trial scores on {scoring}: Ray gave it no GPU or "
                       f"torch sees none here; set search.gpu_per_trial > 0 on a GPU cluster, or latency_device: "
                       f"trial or cpu")
    return scoring if named == "cuda" else torch.device("cpu")


def measure_latency_ratio(model: SuperTransformer, arch: Arch | None, reference_model: SuperTransformer,
                          reference_arch: Arch | None, *, workload: Mapping[str, int] | None = None,
                          rounds: int = DEFAULT_ROUNDS, warmup: int = WARMUP_ROUNDS, threads: int = 1,
                          lock: MeasureLock | None = None, runner: Runner | None = None) -> dict[str, float]:
    """``latency_ms``, ``latency_reference_ms`` and ``latency_ratio`` of ``arch`` on the fixed workload, the
    reference timed interleaved with it in this process (see the module docstring).

    Each run is one beam search on HAT's fixed workload (Wang et al. 2020, sec. 4; :func:`fixed_workload_run`:
    ``[batch, src_tokens]`` dummy sources, exactly ``tgt_tokens`` decoder steps, output layer included). After
    ``warmup`` untimed runs of each model, the order is R_0, C_0, R_1, C_1, ..., C_{n-1}, R_n for ``n = rounds``;
    round i's ratio is ``C_i / ((R_i + R_{i+1}) / 2)``.

    Args:
        model: the candidate (an extracted sub-Transformer, a standalone model or a supernet), on the device to time.
        arch: what ``model`` runs (None: its widest).
        reference_model: the reference arch's model (``search.latency_reference``), on the same device.
        reference_arch: what ``reference_model`` runs (None: its widest).
        workload: ``src_tokens``, ``tgt_tokens``, ``beam``, ``batch`` (:func:`nas.space.predictor_file.workload_of`;
            None: :data:`DEFAULT_WORKLOAD`).
        rounds: timed candidate runs (``search.latency_repeats``); the reference runs once more.
        warmup: untimed runs of each model first.
        threads: torch threads (intra-op) while timing; the caller's count is restored afterwards.
        lock: the node's measurement lock, held exclusively for warm-up and timing (None: none).
        runner: builds each model's call to time (None: :func:`fixed_workload_run`, PyTorch's beam search;
            ``search.latency_engine: onnxruntime``: :func:`nas.export.latency_engine.onnx_runner`'s).

    Returns:
        ``latency_ms`` (median of the candidate's runs, ms), ``latency_reference_ms`` (median of the reference's
        runs, ms), ``latency_ratio`` (median of the per-round ratios; not the quotient of the two medians) and
        ``latency_ratio_iqr`` (the per-round ratios' interquartile range over their median, a fraction: how much the
        rounds disagreed; 0 for one round). A trial prints it beside its ratio, so that a measured ratio far from
        level 1's prediction can be told apart as a noisy measurement (a wide IQR) or a predictor error (a narrow one).

    Raises:
        ValueError: ``rounds`` or ``threads`` below 1, ``warmup`` below 0, the two models on different devices, or a
            workload the models cannot run (:func:`fixed_workload_run`).
    """
    cand_ms, ref_ms = interleaved_timings(model, arch, reference_model, reference_arch, workload=workload,
                                          rounds=rounds, warmup=warmup, threads=threads, lock=lock, runner=runner)
    return summarize_interleaved(cand_ms, ref_ms)


def summarize_interleaved(cand_ms: list[float], ref_ms: list[float]) -> dict[str, float]:
    """The figures of :func:`measure_latency_ratio` from its runs (quartiles: :func:`statistics.quantiles`, inclusive
    method): ``cand_ms`` ``[n]`` (C_0..C_{n-1}) and ``ref_ms``
    ``[n + 1]`` (R_0..R_n), milliseconds in the order they ran. A prefix of both (``cand_ms[:k]``,
    ``ref_ms[:k + 1]``) is a measurement of ``k`` rounds.

    Raises:
        ValueError: no candidate run, or not exactly one reference run more than candidate runs.
    """
    if not cand_ms or len(ref_ms) != len(cand_ms) + 1:
        raise ValueError(f"{len(cand_ms)} candidate and {len(ref_ms)} reference runs; need n >= 1 and n + 1")
    ratios = [c / ((ref_ms[i] + ref_ms[i + 1]) / 2.0) for i, c in enumerate(cand_ms)]
    median = statistics.median(ratios)
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else (median,) * 3
    return {"latency_ms": statistics.median(cand_ms), "latency_reference_ms": statistics.median(ref_ms),
            "latency_ratio": median, "latency_ratio_iqr": (q3 - q1) / median}


@torch.no_grad()
def interleaved_timings(model: SuperTransformer, arch: Arch | None, reference_model: SuperTransformer,
                        reference_arch: Arch | None, *, workload: Mapping[str, int] | None = None,
                        rounds: int = DEFAULT_ROUNDS, warmup: int = WARMUP_ROUNDS, threads: int = 1,
                        lock: MeasureLock | None = None, runner: Runner | None = None) -> tuple[list[float], list[float]]:
    """The runs of :func:`measure_latency_ratio` (same arguments and errors): ``(cand_ms [rounds], ref_ms
    [rounds + 1])``, milliseconds in the order R_0, C_0, R_1, ..., C_{rounds-1}, R_rounds ran."""
    if rounds < 1 or threads < 1 or warmup < 0:
        raise ValueError(f"rounds={rounds} and threads={threads} must be >= 1, warmup={warmup} >= 0")
    device = next(model.parameters()).device
    if next(reference_model.parameters()).device != device:
        raise ValueError(f"the candidate is on {device} but the reference on "
                         f"{next(reference_model.parameters()).device}: time both on one device")
    workload = dict(DEFAULT_WORKLOAD if workload is None else workload)
    model.eval()
    reference_model.eval()
    runner = runner or fixed_workload_run
    candidate = runner(model, arch, workload)
    reference = runner(reference_model, reference_arch, workload)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(run) -> float:
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        return (time.perf_counter() - t0) * 1000.0

    with (lock.exclusive() if lock is not None else nullcontext()), torch_threads(threads):
        for _ in range(warmup):
            reference()
            candidate()
        collecting = gc.isenabled()
        gc.disable()
        try:
            ref_ms = [timed(reference)]
            cand_ms = []
            for _ in range(rounds):
                cand_ms.append(timed(candidate))
                ref_ms.append(timed(reference))
        finally:
            if collecting:
                gc.enable()
    return cand_ms, ref_ms
