"""Latency of a sub-Transformer on a fixed workload, and a HAT-style predictor: arch features -> a small MLP -> ms.

A trial's ``latency_ms`` belongs to the arch, not to what its weights emit: :func:`measure_fixed_latency` times
HAT's workload (Wang et al. 2020, "HAT: Hardware-Aware Transformers for Efficient Natural Language Processing",
ACL, sec. 4): ``batch`` dummy sources of ``src_tokens`` tokens, beam search of exactly ``tgt_tokens`` decoder
steps (EOS held back until the last), output layer included; ``warmup`` untimed runs, ``repeats`` timed ones,
the top and bottom 10% dropped and the rest averaged. The workload comes from the YAML
(``search.latency_workload``, resolved by :func:`workload_of`). :func:`measure_latency` (real beam search on real
sentences, so the output length of the weights counts) stays for benchmarks.

Measuring every candidate costs a decode per trial; HAT (sec. 3.3) instead measures a few thousand random
sub-Transformers once per device, fits an MLP on their architecture features (layer counts and averaged
dimensions) and queries it during the search. Here the same recipe runs on this project's unified layer
(branches, paths, Prime layers with kernels, MUTE units):

1. :func:`collect_samples` extracts random sub-Transformers (plus the widest, the narrowest and the reference
   arch of ``latency_ratio``) from a supernet and times each with :func:`measure_fixed_latency`;
2. :meth:`LatencyPredictor.fit` trains the MLP on :func:`arch_features` (standardized) against log latency and
   reports held-out RMSE and MAPE; the predictor keeps the workload and the reference's latency;
3. :meth:`LatencyPredictor.predict` gives milliseconds; :func:`check_drift` compares a prediction with a fresh
   measurement (a predictor fitted on another machine, thread count or torch version drifts, often by more than
   20%).
"""

from __future__ import annotations

import gc
import json
import math
import platform
import random
import statistics
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from safetensors.torch import load_file, save_file
from torch import nn

from nas.errors import NasError
from nas.eval.measure_lock import MeasureLock
from nas.model.decode import beam_search
from nas.io import atomic_path, atomic_write_text
from nas.model.supernet import SuperTransformer, extract
from nas.space.arch import Arch, StackArch
from nas.space.predictor_file import (FEATURE_NAMES, PREDICTOR_FORMAT, read_predictor_meta, workload_mismatch,
                                     workload_of, workload_tag)
from nas.space.schema import SweepSpec
from nas.space.space import SearchSpace

__all__ = ["FEATURE_NAMES", "DEFAULT_WORKLOAD", "REFERENCE_NAMES", "arch_features", "measure_fixed_latency",
           "measure_latency", "trimmed_mean", "workload_of", "workload_tag", "resolve_reference", "collect_samples",
           "collect_fixed_samples", "fit_predictor_file", "describe_device", "LatencyPredictor", "check_drift"]

REFERENCE_ROUNDS = 3
"""The reference arch (``search.latency_reference``) is timed this many times and the median kept: its time divides
every ``latency_ratio`` of a sweep, and one timing on a noisy machine can be 20% off (measured on a 2-core VM)."""

DEFAULT_WORKLOAD: dict[str, int] = {"src_tokens": 30, "tgt_tokens": 30, "beam": 4, "batch": 1}
"""HAT's workload (sec. 4: a 30-token source, 30 decoder steps, batch 1) at this project's default beam (4):
``search.latency_workload``'s defaults with ``search.beam_size: 4``."""

REFERENCE_NAMES = ("narrowest", "widest", "middle")
"""Named values of ``search.latency_reference`` (else an arch as JSON)."""

_BOS_ID, _EOS_ID = 2, 3
"""Special token ids (:mod:`nas.data`'s, not imported here: it loads pyarrow and sentencepiece)."""
_FIRST_WORD_ID = 4
"""The first id that is no special token (PAD, UNK, BOS, EOS)."""


def _stack_features(stack: StackArch) -> list[float]:
    n = stack.layers
    mean_sum = lambda values: [sum(values) / n, float(sum(values))]
    dims = stack.layer_dims()
    return [
        float(n),
        *mean_sum(stack.width), *mean_sum(stack.ffn_width), *mean_sum(stack.branches),
        *mean_sum(stack.paths), *mean_sum(stack.units),
        float(sum(d.layout == "prime" for d in dims)),
        float(sum(sum(d.kernels) for d in dims)),
        float(sum(d.units > 1 and d.unit_dependency == "sequential" for d in dims)),
        float(sum(d.width * d.branches * d.paths * d.units for d in dims)),
        float(sum(d.ffn_width * d.paths * d.units for d in dims)),
    ]


def arch_features(arch: Arch, model_dim: int) -> list[float]:
    """The fixed-length feature vector of ``arch`` (``len == len(FEATURE_NAMES)``; see there).

    Extends HAT's features (sec. 3.3: layer counts and per-stack averages of the embedding,
    FFN and head dimensions) with the sums and the dimensions of the unified layer.

    Args:
        arch: the sub-Transformer; an optional ``arch.model_width`` (type-1 Scalable
            Transformers) is its model width C, None meaning ``model_dim``.
        model_dim: the supernet's model width (channels).

    Raises:
        ValueError: ``model_dim`` (or ``arch.model_width``) below 1.
    """
    model_width = arch.model_width or model_dim
    if model_width < 1:
        raise ValueError(f"model width {model_width} must be >= 1 (model_dim={model_dim})")
    return [*_stack_features(arch.encoder), *_stack_features(arch.decoder), float(model_width)]


def _batches(sentences: Sequence[Sequence[int]], batch_size: int, device: torch.device) -> list[torch.Tensor]:
    """Length-sorted ``[b, s]`` PAD(0)-padded batches of ``batch_size`` (the last may be smaller)."""
    ordered = sorted(sentences, key=len)
    out = []
    for start in range(0, len(ordered), batch_size):
        chunk = ordered[start:start + batch_size]
        src = torch.zeros(len(chunk), max(len(s) for s in chunk), dtype=torch.long)  # [b, s]
        for row, ids in enumerate(chunk):
            src[row, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
        out.append(src.to(device))
    return out


@torch.no_grad()
def measure_latency(model: SuperTransformer, arch: Arch | None, sentences: Sequence[Sequence[int]], *,
                    batch_size: int = 1, beam_size: int = 4, repeats: int = 3, threads: int = 1,
                    lock: MeasureLock | None = None) -> float:
    """Median wall time (milliseconds) to translate one batch of ``batch_size`` sentences with
    beam search, embeddings and output projection included, on the model's device.

    Sentences are sorted by length and cut into batches. One untimed pass over all batches warms
    up (allocations, kernel selection, caches); then every batch is timed ``repeats`` times, in
    passes over all batches, and the median over all timings is returned. Torch runs on exactly
    ``threads`` threads while measuring (the caller's thread count is restored afterwards) and
    Python's garbage collector is paused during the timed passes. With ``lock``, warm-up and timing
    hold it exclusively (:meth:`MeasureLock.exclusive`): nothing else that holds the node's lock
    computes meanwhile. The output length depends on the weights, so this is what a user of these weights
    waits for on these sentences (benchmarks); a search trial's ``latency_ms`` is :func:`measure_fixed_latency`.

    Args:
        model: a supernet or an extracted model (put in eval mode).
        arch: the sub-Transformer (None: the model's widest).
        sentences: source token ids, each ending in EOS, PAD (0) excluded.
        batch_size: sentences per batch.
        beam_size: beams per sentence (1: greedy).
        repeats: timed passes over all batches.
        threads: torch threads (intra-op) while measuring.
        lock: the node's measurement lock (:class:`nas.eval.measure_lock.MeasureLock`); None: no lock.

    Raises:
        ValueError: fewer sentences than ``batch_size``, an empty sentence, or
            ``batch_size``/``repeats``/``threads`` below 1.
    """
    if batch_size < 1 or repeats < 1 or threads < 1:
        raise ValueError(f"batch_size={batch_size}, repeats={repeats} and threads={threads} must be >= 1")
    if len(sentences) < batch_size:
        raise ValueError(f"batch_size={batch_size} needs at least {batch_size} sentences; got {len(sentences)}")
    if any(len(s) == 0 for s in sentences):
        raise ValueError("an empty sentence; each needs at least its EOS id")
    model.eval()
    device = next(model.parameters()).device
    batches = _batches(sentences, batch_size, device)
    with (lock.exclusive() if lock is not None else nullcontext()), _threads(threads):
        return _time_batches(model, arch, batches, beam_size, repeats, device)


def _time_batches(model: SuperTransformer, arch: Arch | None, batches: list[torch.Tensor], beam_size: int,
                  repeats: int, device: torch.device) -> float:
    """Warm up on every batch once, then the median ms of ``repeats`` timed passes over ``batches``."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for src in batches:  # warm-up
        beam_search(model, src, arch, beam_size=beam_size)
    times = []
    collecting = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            for src in batches:
                sync()
                t0 = time.perf_counter()
                beam_search(model, src, arch, beam_size=beam_size)
                sync()
                times.append((time.perf_counter() - t0) * 1000.0)
    finally:
        if collecting:
            gc.enable()
    return statistics.median(times)


def trimmed_mean(times_ms: Sequence[float], fraction: float = 0.1) -> float:
    """HAT's latency statistic: sort, drop ``int(fraction * n)`` timings at each end, average the rest.

    With 20 timings and ``fraction=0.1`` the 2 fastest and the 2 slowest are dropped and 16 averaged; fewer than
    10 timings are all averaged.

    Raises:
        ValueError: no timings, or ``fraction`` outside [0, 0.5).
    """
    if not times_ms:
        raise ValueError("no timings to average")
    if not 0.0 <= fraction < 0.5:
        raise ValueError(f"fraction={fraction} must be in [0, 0.5)")
    ordered = sorted(times_ms)
    cut = int(fraction * len(ordered))
    kept = ordered[cut:len(ordered) - cut]
    return sum(kept) / len(kept)


def _fixed_source(src_tokens: int, batch_size: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[batch_size, src_tokens]`` dummy sources: the non-special ids 4, 5, 6, ... (wrapping within the
    vocabulary), then EOS; no PAD, the same in every row and every call."""
    if vocab_size <= _FIRST_WORD_ID:
        raise ValueError(f"vocab_size={vocab_size} has no word ids (ids 0-3 are PAD, UNK, BOS, EOS)")
    words = [_FIRST_WORD_ID + i % (vocab_size - _FIRST_WORD_ID) for i in range(src_tokens - 1)]
    return torch.tensor([words + [_EOS_ID]] * batch_size, dtype=torch.long, device=device)  # [b, s]


@torch.no_grad()
def measure_fixed_latency(model: SuperTransformer, arch: Arch | None, *, src_tokens: int = 30, tgt_tokens: int = 30,
                          beam_size: int = 4, batch_size: int = 1, repeats: int = 20, warmup: int = 5,
                          threads: int = 1, lock: MeasureLock | None = None) -> float:
    """Milliseconds of one beam search on HAT's fixed workload (Wang et al. 2020, sec. 4): what a trial's
    ``latency_ms`` is, a function of the arch and the device only, never of the weights.

    The source is ``[batch_size, src_tokens]``: the word ids 4, 5, 6, ... and EOS (id 3) last, no PAD. Beam search
    (:func:`nas.model.decode.beam_search`, embeddings, key/value cache and output projection included) runs
    exactly ``tgt_tokens`` decoder steps: EOS is held back until the last step, which forces it
    (``min_len = max_len_b = tgt_tokens``, ``max_len_a = 0``). ``warmup`` untimed runs, then ``repeats`` timed runs
    (CUDA synchronized before and after each on a GPU); returns their :func:`trimmed_mean` (the top and bottom 10%
    dropped, HAT's statistic). Torch runs on exactly ``threads`` threads while measuring (the caller's count is
    restored afterwards) and Python's garbage collector is paused during the timed runs. With ``lock``, warm-up and
    timing hold it exclusively (:meth:`MeasureLock.exclusive`).

    Args:
        model: a supernet or an extracted model (put in eval mode), on the device to time.
        arch: the sub-Transformer (None: the model's widest).
        src_tokens: source length (tokens, EOS included).
        tgt_tokens: decoder steps (the last emits EOS); at most ``model.max_positions - 1``.
        beam_size: beams per sentence (1: greedy).
        batch_size: sentences per batch.
        repeats: timed runs.
        warmup: untimed runs before them.
        threads: torch threads (intra-op) while measuring.
        lock: the node's measurement lock (:class:`nas.eval.measure_lock.MeasureLock`); None: no lock.

    Raises:
        ValueError: ``src_tokens``/``tgt_tokens``/``beam_size``/``batch_size``/``repeats``/``threads`` below 1,
            ``warmup`` below 0, or a length beyond ``model.max_positions``.
    """
    sizes = {"src_tokens": src_tokens, "tgt_tokens": tgt_tokens, "beam_size": beam_size, "batch_size": batch_size,
             "repeats": repeats, "threads": threads}
    bad = [f"{k}={v} must be >= 1" for k, v in sizes.items() if v < 1] + ([f"warmup={warmup} must be >= 0"]
                                                                          if warmup < 0 else [])
    if bad:
        raise ValueError("; ".join(bad))
    if src_tokens > model.max_positions or tgt_tokens > model.max_positions - 1:
        raise ValueError(f"src_tokens={src_tokens} / tgt_tokens={tgt_tokens} exceed the model's max_positions="
                         f"{model.max_positions} (tgt_tokens at most max_positions - 1)")
    model.eval()
    device = next(model.parameters()).device
    src = _fixed_source(src_tokens, batch_size, model.vocab_size, device)  # [b, s]
    run = lambda: beam_search(model, src, arch, beam_size=beam_size, bos_id=_BOS_ID, eos_id=_EOS_ID,  # noqa: E731
                              min_len=tgt_tokens, max_len_a=0.0, max_len_b=tgt_tokens)
    with (lock.exclusive() if lock is not None else nullcontext()), _threads(threads):
        return trimmed_mean(_time_runs(run, warmup, repeats, device))


def _time_runs(run, warmup: int, repeats: int, device: torch.device) -> list[float]:
    """``warmup`` untimed calls of ``run``, then the milliseconds of ``repeats`` timed ones (GC paused)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        run()
    times = []
    collecting = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            run()
            sync()
            times.append((time.perf_counter() - t0) * 1000.0)
    finally:
        if collecting:
            gc.enable()
    return times


def describe_device(device: torch.device | str = "cpu") -> str:
    """Where latencies are measured, e.g. ``"cpu: Intel(R) Xeon(R) ... (1 thread), torch 2.13.0"``.

    Stored with a fitted predictor: its predictions hold only on the same device, thread
    count and torch version.
    """
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    threads = torch.get_num_threads()
    return f"{device.type}: {name} ({threads} thread{'s' if threads != 1 else ''}), torch {torch.__version__}"


def _progress(enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]latency"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                    console=Console(stderr=True), disable=not enabled)


def resolve_reference(spec: SweepSpec, space: SearchSpace) -> Arch:
    """The arch ``latency_ratio`` divides by: ``search.latency_reference`` (``narrowest``, ``widest``, ``middle`` of
    ``space``, the sweep's (:func:`nas.builders.build_space`); or an arch as JSON, :meth:`Arch.to_json`).

    Raises:
        NasError: the value is none of the names and no arch JSON, or the arch exceeds the supernet (names
            ``search.latency_reference`` and the value).
    """
    named = spec.search.latency_reference
    if named in REFERENCE_NAMES:
        return getattr(space, named)()
    try:
        arch = Arch.from_json(named)
        arch.check_within(space.supernet_maxima(spec))
    except (ValueError, TypeError, AttributeError) as e:  # JSONDecodeError and ArchError are ValueErrors
        raise NasError(f"search.latency_reference: {named!r} is not {', '.join(REFERENCE_NAMES)} or an arch of this "
                       f"supernet as JSON (Arch.to_json(), e.g. from `nas space sample`): {e}") from None
    return arch


def _sample_archs(space: SearchSpace, n: int, seed: int, reference: Arch) -> list[Arch]:
    """The widest, the narrowest, then distinct random archs: ``n`` in all, fewer if the space is smaller; then
    ``reference`` when it is not among them."""
    rng = random.Random(seed)
    archs: dict[str, Arch] = {}
    candidates = [space.widest(), space.narrowest()]
    attempts = 0
    while len(archs) < n and attempts < 20 * n + 20:
        arch = candidates.pop(0) if candidates else space.sample(rng)
        archs.setdefault(arch.arch_id, arch)
        attempts += 1
    archs.setdefault(reference.arch_id, reference)
    return list(archs.values())


def collect_samples(supernet: SuperTransformer, space: SearchSpace, n: int, *,
                    workload: Mapping[str, int] | None = None, reference: Arch | None = None, seed: int = 0,
                    repeats: int = 20, warmup: int = 5, threads: int | None = None, lock: MeasureLock | None = None,
                    progress: bool = True) -> list[dict[str, Any]]:
    """Measure the latency of ``n`` distinct sub-Transformers of ``space`` on one workload (HAT sec. 3.3's dataset).

    The first two are the widest and the narrowest, the rest uniformly random (``space.sample`` with
    ``random.Random(seed)``); fewer than ``n`` when the space is smaller; then ``reference`` (``latency_ratio``'s
    denominator) if it is not among them. Each is extracted (:func:`nas.model.supernet.extract`) and timed with
    :func:`measure_fixed_latency` on ``workload``, with a rich progress bar on stderr.

    Args:
        supernet: the (trained or untrained) supernet: the fixed workload does not depend on the weights.
        space: where the archs come from (each must fit the supernet).
        n: number of archs (besides the reference).
        workload: ``src_tokens``, ``tgt_tokens``, ``beam``, ``batch`` (:func:`workload_of` of the sweep's
            ``search``; None: :data:`DEFAULT_WORKLOAD`).
        reference: the arch ``latency_ratio`` divides by (:func:`nas.search.trials.resolve_reference`; None: the
            narrowest).
        repeats, warmup: timed and untimed runs per arch (:func:`measure_fixed_latency`).
        threads: torch threads while measuring (None: the process's; the sweep's trials run with
            ``search.cpu_per_trial``), restored afterwards.
        lock: the node's measurement lock, held exclusively during each measurement (None: none).

    Returns:
        One JSON-ready dict per arch: ``arch`` (:meth:`Arch.to_dict`), ``arch_id``, ``model_dim``, ``workload``,
        ``batch_size`` and ``beam_size`` (the workload's), ``latency_ms``, ``device`` (:func:`describe_device`),
        ``reference`` (True for the reference arch only).

    Raises:
        ValueError: ``n`` below 1, or an arch beyond the supernet's maxima (names the choice).
    """
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    workload = dict(DEFAULT_WORKLOAD if workload is None else workload)
    reference = space.narrowest() if reference is None else reference
    archs = _sample_archs(space, n, seed, reference)
    device = next(supernet.parameters()).device
    with _threads(threads or torch.get_num_threads()):
        return _measure_all(supernet, archs, workload, reference, repeats, warmup, device, lock, progress)


def collect_fixed_samples(supernet: SuperTransformer, spec: SweepSpec, n: int, *, space: SearchSpace,
                          seed: int | None = None,
                          threads: int | None = None, lock: MeasureLock | None = None,
                          progress: bool = False) -> list[dict[str, Any]]:
    """:func:`collect_samples` as a sweep times its trials: ``space`` (the sweep's, :func:`nas.builders.build_space`),
    the workload (:func:`workload_of`), reference
    (:func:`resolve_reference`) and ``search.latency_repeats`` of ``spec``; ``seed`` None: ``search.seed``;
    ``threads`` None: ``search.cpu_per_trial``.

    Raises:
        NasError: a bad ``search.latency_reference``.
        ValueError: as :func:`collect_samples`.
    """
    return collect_samples(supernet, space, n, workload=workload_of(spec.search),
                           reference=resolve_reference(spec, space),
                           seed=spec.search.seed if seed is None else seed, repeats=spec.search.latency_repeats,
                           threads=threads or max(1, int(spec.search.cpu_per_trial)), lock=lock, progress=progress)


def fit_predictor_file(samples: Sequence[Mapping[str, Any]], spec: SweepSpec, path: str | Path, *,
                       seed: int = 0) -> dict[str, float]:
    """Fit a :class:`LatencyPredictor` on ``samples`` (from :func:`collect_fixed_samples`) for ``spec``'s workload,
    keep the reference sample's latency and arch, and save it to ``path`` (+ ``.json``): what ``nas latency fit``
    and the evolutionary search write.

    Returns:
        The fit's metrics (:meth:`LatencyPredictor.fit`).

    Raises:
        NasError: no samples, or fewer than 2 on the workload.
    """
    if not samples:
        raise NasError("no latency samples to fit a predictor on")
    reference = next((s for s in samples if s.get("reference")), None)
    predictor = LatencyPredictor(int(samples[0].get("model_dim", spec.supernet.model_dim)),
                                 workload=workload_of(spec.search), device=str(samples[0].get("device", "")),
                                 reference_ms=None if reference is None else float(reference["latency_ms"]),
                                 reference_arch=None if reference is None else _as_arch(reference["arch"]).to_json())
    metrics = predictor.fit(samples, seed=seed)
    predictor.save(path)
    return metrics


def _measure_all(supernet: SuperTransformer, archs: list[Arch], workload: dict[str, int], reference: Arch,
                 repeats: int, warmup: int, device: torch.device, lock: MeasureLock | None,
                 progress: bool) -> list[dict[str, Any]]:
    where = describe_device(device)
    threads = torch.get_num_threads()
    samples = []
    with _progress(progress) as bar:
        task = bar.add_task("archs", total=len(archs), info="")
        for arch in archs:
            model = extract(supernet, arch).to(device)
            rounds = REFERENCE_ROUNDS if arch.arch_id == reference.arch_id else 1
            ms = statistics.median(
                measure_fixed_latency(model, arch, src_tokens=workload["src_tokens"], tgt_tokens=workload["tgt_tokens"],
                                      beam_size=workload["beam"], batch_size=workload["batch"], repeats=repeats,
                                      warmup=warmup, threads=threads, lock=lock)
                for _ in range(rounds))
            samples.append({"arch": arch.to_dict(), "arch_id": arch.arch_id, "model_dim": supernet.model_dim,
                            "workload": dict(workload), "batch_size": workload["batch"], "beam_size": workload["beam"],
                            "latency_ms": ms, "device": where, "reference": arch.arch_id == reference.arch_id})
            bar.update(task, advance=1, info=f"{arch.arch_id}: {ms:.1f} ms")
    return samples


def _mlp(features: int, hidden: int, hidden_layers: int) -> nn.Sequential:
    """HAT's predictor: ``hidden_layers`` Linear+ReLU blocks of ``hidden`` units, then one output."""
    layers: list[nn.Module] = []
    width = features
    for _ in range(hidden_layers):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


@contextmanager
def _threads(n: int) -> Iterator[None]:
    """Run on ``n`` torch threads; the process's thread count is restored afterwards. A tiny MLP runs on one:
    more threads only add synchronization (30 ms/step instead of 2 on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _as_arch(arch: Arch | Mapping[str, Any]) -> Arch:
    return arch if isinstance(arch, Arch) else Arch.from_dict(arch)


class LatencyPredictor:
    """An MLP from standardized :func:`arch_features` to log latency (HAT sec. 3.3) on one fixed workload.

    HAT uses 3 hidden layers of 400 units; the default here is smaller (64), ample for a
    few hundred samples. The target is ``log(latency_ms)`` standardized, so the squared
    error is a relative one (latencies span an order of magnitude across a space).

    Args:
        model_dim: the supernet's model width C (channels), for :func:`arch_features`.
        hidden: units per hidden layer.
        hidden_layers: hidden Linear+ReLU layers.
        workload: the workload it predicts (``src_tokens``, ``tgt_tokens``, ``beam``, ``batch``:
            :func:`workload_of`; None: :data:`DEFAULT_WORKLOAD`); ``fit`` uses only samples measured on it.
        device: where the samples were measured (:func:`describe_device`).
        reference_ms: the measured latency (ms) of ``reference_arch`` on the workload, ``latency_ratio``'s
            denominator with ``search.latency: predicted`` (None: not measured).
        reference_arch: that arch (:meth:`Arch.to_json`).

    Raises:
        ValueError: ``hidden`` or ``hidden_layers`` below 1; a workload lacking a key; ``reference_ms`` not
            positive.
    """

    def __init__(self, model_dim: int, *, hidden: int = 64, hidden_layers: int = 3,
                 workload: Mapping[str, int] | None = None, device: str = "", reference_ms: float | None = None,
                 reference_arch: str | None = None) -> None:
        if hidden < 1 or hidden_layers < 1:
            raise ValueError(f"hidden={hidden} and hidden_layers={hidden_layers} must be >= 1")
        workload = dict(DEFAULT_WORKLOAD if workload is None else workload)
        missing = [k for k in DEFAULT_WORKLOAD if k not in workload]
        if missing:
            raise ValueError(f"workload {workload} lacks {', '.join(missing)}")
        if reference_ms is not None and not (math.isfinite(reference_ms) and reference_ms > 0):
            raise ValueError(f"reference_ms={reference_ms} must be positive and finite")
        self.model_dim, self.hidden, self.hidden_layers = model_dim, hidden, hidden_layers
        self.workload = {k: int(workload[k]) for k in DEFAULT_WORKLOAD}
        self.device, self.reference_ms, self.reference_arch = device, reference_ms, reference_arch
        self.net = _mlp(len(FEATURE_NAMES), hidden, hidden_layers)
        self.feature_mean = torch.zeros(len(FEATURE_NAMES))
        self.feature_std = torch.ones(len(FEATURE_NAMES))
        self.target_mean, self.target_std = 0.0, 1.0
        self.metrics: dict[str, float] = {}
        self.fitted = False

    @property
    def batch_size(self) -> int:
        """Sentences per batch of the workload."""
        return self.workload["batch"]

    @property
    def beam_size(self) -> int:
        """Beams per sentence of the workload."""
        return self.workload["beam"]

    def _measured_on_mine(self, sample: Mapping[str, Any]) -> bool:
        """A sample with a ``workload`` must have this one; an older one without, this batch and beam size."""
        if "workload" in sample:
            return workload_mismatch(sample["workload"], self.workload) is None
        return (sample.get("batch_size", self.batch_size), sample.get("beam_size", self.beam_size)) == \
            (self.batch_size, self.beam_size)

    def _x(self, archs: Sequence[Arch]) -> torch.Tensor:
        x = torch.tensor([arch_features(a, self.model_dim) for a in archs], dtype=torch.float64)  # [n, F]
        return ((x - self.feature_mean.double()) / self.feature_std.double()).float()

    def _ms(self, y: torch.Tensor) -> torch.Tensor:
        """Standardized log latency ``[n]`` -> milliseconds ``[n]``."""
        return torch.exp(y.double() * self.target_std + self.target_mean)

    def fit(self, samples: Sequence[Mapping[str, Any]], *, holdout: float = 0.2, epochs: int = 1000,
            lr: float = 3e-3, weight_decay: float = 1e-4, seed: int = 0) -> dict[str, float]:
        """Train on the samples measured on this predictor's workload.

        A seeded random ``holdout`` fraction (at least one sample) is kept out of training
        and scored; the MLP is trained full-batch with Adam on the rest (MSE on the
        standardized log latency). Standardization statistics come from the training part.

        Args:
            samples: dicts with ``arch`` (an :class:`Arch` or its dict), ``latency_ms`` (> 0) and ``workload``
                (or, without one, optionally ``batch_size``/``beam_size``), as from :func:`collect_samples`.
            holdout: fraction in [0, 1) held out; 0 trains on all and reports training error.
            epochs: full-batch optimizer steps.

        Returns:
            ``rmse_ms`` (root mean squared error, ms) and ``mape`` (mean absolute percentage
            error, %) on the held-out samples, ``train_samples``, ``holdout_samples``.

        Raises:
            NasError: fewer than 2 samples on this workload (names the workloads present).
            ValueError: a latency that is not positive and finite, or ``holdout`` outside [0, 1).
        """
        if not 0.0 <= holdout < 1.0:
            raise ValueError(f"holdout={holdout} must be in [0, 1)")
        rows = [s for s in samples if self._measured_on_mine(s)]
        if len(rows) < 2:
            present = sorted({workload_tag(s["workload"]) if "workload" in s
                              else f"batch{s.get('batch_size')}-beam{s.get('beam_size')}" for s in samples})
            raise NasError(f"{len(rows)} samples on workload {workload_tag(self.workload)} (need >= 2); the "
                           f"samples were measured on {present}")
        for i, s in enumerate(rows):
            if not (math.isfinite(s["latency_ms"]) and s["latency_ms"] > 0):
                raise ValueError(f"samples[{i}].latency_ms={s['latency_ms']} must be positive and finite")
        archs = [_as_arch(s["arch"]) for s in rows]
        log_ms = torch.tensor([math.log(s["latency_ms"]) for s in rows], dtype=torch.float64)  # [n]
        x_raw = torch.tensor([arch_features(a, self.model_dim) for a in archs], dtype=torch.float64)  # [n, F]
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(rows), generator=g)
        n_hold = max(1, round(holdout * len(rows))) if holdout > 0 else 0
        hold, train = order[:n_hold], order[n_hold:]
        self.feature_mean = x_raw[train].mean(0).float()
        std = x_raw[train].std(0) if len(train) > 1 else torch.zeros(x_raw.size(1), dtype=torch.float64)
        self.feature_std = torch.where(std > 1e-9, std, torch.ones_like(std)).float()  # constant feature: keep 0
        self.target_mean = float(log_ms[train].mean())
        self.target_std = float(log_ms[train].std()) if len(train) > 1 and float(log_ms[train].std()) > 1e-9 else 1.0
        x = ((x_raw - self.feature_mean.double()) / self.feature_std.double()).float()  # [n, F]
        y = ((log_ms - self.target_mean) / self.target_std).float()  # [n]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.net = _mlp(len(FEATURE_NAMES), self.hidden, self.hidden_layers)
        opt = torch.optim.AdamW(self.net.parameters(), lr=lr, weight_decay=weight_decay)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(epochs, 1))
        self.net.train()
        with _threads(1):
            for _ in range(epochs):
                loss = nn.functional.mse_loss(self.net(x[train]).squeeze(1), y[train])
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
        self.net.eval()
        self.fitted = True
        scored = hold if n_hold else train
        with torch.no_grad():
            pred = self._ms(self.net(x[scored]).squeeze(1))  # [m] ms
        true = log_ms[scored].exp()
        self.metrics = {
            "rmse_ms": float(((pred - true) ** 2).mean().sqrt()),
            "mape": float(((pred - true).abs() / true).mean() * 100.0),
            "train_samples": float(len(train)),
            "holdout_samples": float(n_hold),
        }
        return dict(self.metrics)

    @torch.no_grad()
    def predict_many(self, archs: Sequence[Arch | Mapping[str, Any]]) -> list[float]:
        """Predicted latency (ms) of each arch on this predictor's workload.

        Raises:
            RuntimeError: the predictor was neither fitted nor loaded.
        """
        if not self.fitted:
            raise RuntimeError("the latency predictor is not fitted; call fit() or LatencyPredictor.load()")
        if not archs:
            return []
        with _threads(1):
            return self._ms(self.net(self._x([_as_arch(a) for a in archs])).squeeze(1)).tolist()

    def predict(self, arch: Arch | Mapping[str, Any]) -> float:
        """Predicted latency (ms) of one arch; see :meth:`predict_many`."""
        return self.predict_many([arch])[0]

    def _sidecar(self) -> dict[str, Any]:
        return {
            "format": PREDICTOR_FORMAT,
            "feature_names": list(FEATURE_NAMES),
            "feature_mean": self.feature_mean.tolist(),
            "feature_std": self.feature_std.tolist(),
            "target": "log_latency_ms",
            "target_mean": self.target_mean,
            "target_std": self.target_std,
            "model_dim": self.model_dim,
            "hidden": self.hidden,
            "hidden_layers": self.hidden_layers,
            "workload": dict(self.workload),
            "batch_size": self.batch_size,
            "beam_size": self.beam_size,
            "reference_ms": self.reference_ms,
            "reference_arch": self.reference_arch,
            "device": self.device,
            "metrics": self.metrics,
        }

    def save(self, path: str | Path) -> Path:
        """Write the weights to ``path`` (safetensors) and the rest to ``path`` with suffix ``.json``.

        Both files are written atomically (:mod:`nas.io`: a temporary sibling, fsync, ``os.replace``).
        Returns the weights' path.

        Raises:
            RuntimeError: the predictor was neither fitted nor loaded.
        """
        if not self.fitted:
            raise RuntimeError("the latency predictor is not fitted; nothing to save")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            save_file({k: v.detach().contiguous() for k, v in self.net.state_dict().items()}, str(tmp))
        atomic_write_text(path.with_suffix(".json"), json.dumps(self._sidecar(), indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "LatencyPredictor":
        """Read a predictor written by :meth:`save` (``path`` and its ``.json`` sidecar).

        Raises:
            FileNotFoundError: either file is missing.
            PredictorFileError: (a :class:`NasError`) the sidecar is not a predictor's, it names no latency
                workload (fitted before the fixed workload), or it was fitted on other features than this
                version's :data:`FEATURE_NAMES` (refit with ``nas latency fit``).
        """
        path = Path(path)
        meta = read_predictor_meta(path)  # format, feature names, workload, keys, weights header (torch-free)
        pred = cls(meta["model_dim"], hidden=meta["hidden"], hidden_layers=meta["hidden_layers"],
                   workload=meta["workload"], device=meta.get("device", ""), reference_ms=meta.get("reference_ms"),
                   reference_arch=meta.get("reference_arch"))
        pred.net.load_state_dict(load_file(str(path)))
        pred.net.eval()
        pred.feature_mean = torch.tensor(meta["feature_mean"], dtype=torch.float32)
        pred.feature_std = torch.tensor(meta["feature_std"], dtype=torch.float32)
        pred.target_mean, pred.target_std = float(meta["target_mean"]), float(meta["target_std"])
        pred.metrics = dict(meta.get("metrics", {}))
        pred.fitted = True
        return pred


def check_drift(predicted_ms: float, measured_ms: float, tolerance: float = 0.2) -> str | None:
    """A warning when a prediction is more than ``tolerance`` (relative) off a fresh measurement.

    The error is ``|predicted - measured| / measured``; a predictor is only valid on the
    device, thread count and torch version it was fitted on, and HAT users report drifts
    above 20% after such changes.

    Returns:
        The warning text (both values, the error and what to do), or None within tolerance.

    Raises:
        ValueError: ``measured_ms`` not positive, ``predicted_ms`` negative or not finite,
            or ``tolerance`` negative.
    """
    if not (math.isfinite(measured_ms) and measured_ms > 0):
        raise ValueError(f"measured_ms={measured_ms} must be positive and finite")
    if not (math.isfinite(predicted_ms) and predicted_ms >= 0):
        raise ValueError(f"predicted_ms={predicted_ms} must be non-negative and finite")
    if tolerance < 0:
        raise ValueError(f"tolerance={tolerance} must be >= 0")
    error = abs(predicted_ms - measured_ms) / measured_ms
    if error <= tolerance:
        return None
    return (f"latency predictor drift: predicted {predicted_ms:.1f} ms, measured {measured_ms:.1f} ms "
            f"({error:.0%} off, tolerance {tolerance:.0%}); the predictor was fitted on another device, "
            f"thread count or torch version, or the space changed; refit with `nas latency fit` on this machine")
