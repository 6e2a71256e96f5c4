"""The timing harness: milliseconds of beam search on HAT's fixed workload (:func:`measure_fixed_latency`, a
trial's ``latency_ms``) or on real sentences (:func:`measure_latency`, benchmarks), HAT's statistic
(:func:`trimmed_mean`), the device a time belongs to (:func:`describe_device`), and :func:`torch_threads`, the torch
thread count held while measuring or fitting.

Quiet measurement: torch runs on exactly the given threads, Python's garbage collector is paused during timed runs,
CUDA is synchronized around each, and with a :class:`~nas.eval.measure_lock.MeasureLock` nothing else that holds the
node's lock computes meanwhile.
"""

from __future__ import annotations

import gc
import platform
import statistics
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import torch

from nas.eval.measure_lock import MeasureLock
from nas.model.decode import beam_search
from nas.model.supernet import SuperTransformer
from nas.space.arch import Arch

__all__ = ["DEFAULT_WORKLOAD", "fixed_workload_run", "fixed_workload_source", "measure_fixed_latency", "measure_latency", "trimmed_mean",
           "describe_device", "torch_threads"]

DEFAULT_WORKLOAD: dict[str, int] = {"src_tokens": 30, "tgt_tokens": 30, "beam": 4, "batch": 1}
"""HAT's workload (sec. 4: a 30-token source, 30 decoder steps, batch 1) at this project's default beam (4):
``search.latency_workload``'s defaults with ``search.beam_size: 4``."""

_BOS_ID, _EOS_ID = 2, 3
"""Special token ids (:mod:`nas.data`'s, not imported here: it loads pyarrow and sentencepiece)."""
_FIRST_WORD_ID = 4
"""The first id that is no special token (PAD, UNK, BOS, EOS)."""


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run on ``n`` torch threads; the process's thread count is restored afterwards. A tiny MLP runs on one:
    more threads only add synchronization (30 ms/step instead of 2 on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
    with (lock.exclusive() if lock is not None else nullcontext()), torch_threads(threads):
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


def fixed_workload_source(model: SuperTransformer, workload: Mapping[str, int], device: torch.device) -> torch.Tensor:
    """The ``[batch, src_tokens]`` dummy sources of :func:`fixed_workload_run` for ``model``'s vocabulary, on
    ``device`` (other engines run the same sentences).

    Raises:
        ValueError: a vocabulary without word ids.
    """
    return _fixed_source(int(workload["src_tokens"]), int(workload["batch"]), model.vocab_size, device)


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
    model.eval()
    device = next(model.parameters()).device
    # fixed_workload_run checks the lengths against max_positions
    run = fixed_workload_run(model, arch, {"src_tokens": src_tokens, "tgt_tokens": tgt_tokens, "beam": beam_size,
                                           "batch": batch_size})
    with (lock.exclusive() if lock is not None else nullcontext()), torch_threads(threads):
        return trimmed_mean(_time_runs(run, warmup, repeats, device))


def fixed_workload_run(model: SuperTransformer, arch: Arch | None, workload: Mapping[str, int]) -> Callable[[], None]:
    """One beam search of HAT's fixed workload (Wang et al. 2020, sec. 4) as a call: ``[batch, src_tokens]`` dummy
    sources (the word ids 4, 5, 6, ... and EOS last, no PAD), beam ``beam``, exactly ``tgt_tokens`` decoder steps
    (EOS held back until the last step, which forces it), embeddings, key/value cache and output projection
    included. The model stays on its device; the caller times the call.

    Raises:
        ValueError: a size below 1, a length beyond ``model.max_positions`` (``tgt_tokens`` at most
            ``max_positions - 1``), or a vocabulary without word ids.
    """
    src_tokens, tgt_tokens = int(workload["src_tokens"]), int(workload["tgt_tokens"])
    beam_size, batch_size = int(workload["beam"]), int(workload["batch"])
    bad = [f"{k}={v} must be >= 1" for k, v in workload.items() if int(v) < 1]
    if bad:
        raise ValueError("; ".join(bad))
    if src_tokens > model.max_positions or tgt_tokens > model.max_positions - 1:
        raise ValueError(f"src_tokens={src_tokens} / tgt_tokens={tgt_tokens} exceed the model's max_positions="
                         f"{model.max_positions} (tgt_tokens at most max_positions - 1)")
    src = _fixed_source(src_tokens, batch_size, model.vocab_size, next(model.parameters()).device)  # [b, s]

    def run() -> None:
        beam_search(model, src, arch, beam_size=beam_size, bos_id=_BOS_ID, eos_id=_EOS_ID, min_len=tgt_tokens,
                    max_len_a=0.0, max_len_b=tgt_tokens)
    return run


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
