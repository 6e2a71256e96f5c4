"""How stable is a ``latency_ratio``? The interleaved measurement against timing the reference apart, quiet and
under contention, and the number of rounds it needs.

Run: ``python benchmarks/bench_latency_ratio.py [search_spaces/quickstart.yaml] [--reps 5] [--rounds 25]
[--archs 3]``

Sub-Transformers of the space (the widest, the middle, ``--archs``-2 random ones, seeded) and the reference of
``latency_ratio`` (``search.latency_reference``) are extracted from the sweep's supernet (untrained: the fixed
workload does not depend on the weights) and timed on ``search.latency_workload`` at ``search.cpu_per_trial``
threads, in two conditions:

- ``quiet``: nothing else of ours computes;
- ``loaded``: a second process multiplies matrices on one thread throughout (another trial scoring beside it, a
  busy neighbour on the VM).

Two methods, each repeated ``--reps`` times per arch and condition:

- ``interleaved`` (:func:`nas.eval.latency.interleaved_timings`, what every ``latency_ratio`` is now):
  ``--rounds`` rounds; the figures for fewer rounds are the prefixes of the same runs (a prefix of an interleaved
  measurement is a measurement of that many rounds);
- ``apart`` (how trials measured before): the reference timed once per process (the median of 3
  :func:`measure_fixed_latency` calls of 20 runs after 5 untimed), the arch later (one call); the quotient.

Printed per method, rounds and condition, over archs: the spread of the repeated ratios, ``(max - min) / median``
(median over archs, and the worst arch), and the shift of the median ratio from quiet to loaded. The choice of
``search.latency_repeats``' default (``DEFAULT_LATENCY_ROUNDS``) reads these columns.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import time

import torch

from nas.builders import build_space, build_supernet
from nas.eval.latency import describe_device, interleaved_timings, resolve_reference, workload_of, workload_tag
from nas.eval.latency.ratio import summarize_interleaved
from nas.eval.latency.timing import measure_fixed_latency, torch_threads
from nas.model.supernet import extract
from nas.space import load_spec

PREFIXES = (5, 10, 15, 20, 25)


def _busy(stop) -> None:
    """One thread of matrix products until ``stop`` is set (the ``loaded`` condition's neighbour)."""
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    while not stop.is_set():
        for _ in range(20):
            a = torch.tanh(a @ a)


def _apart(model, arch, ref_model, reference, workload, threads: int) -> float:
    kw = dict(src_tokens=workload["src_tokens"], tgt_tokens=workload["tgt_tokens"], beam_size=workload["beam"],
              batch_size=workload["batch"], repeats=20, warmup=5, threads=threads)
    ref = statistics.median(measure_fixed_latency(ref_model, reference, **kw) for _ in range(3))
    return measure_fixed_latency(model, arch, **kw) / ref


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", nargs="?", default="search_spaces/quickstart.yaml")
    parser.add_argument("--reps", type=int, default=5, help="repeated measurements per arch and condition")
    parser.add_argument("--rounds", type=int, default=max(PREFIXES), help="interleaved rounds per measurement")
    parser.add_argument("--archs", type=int, default=3, help="archs: widest, middle, then random ones")
    parser.add_argument("--no-apart", action="store_true", help="skip the old method (halves the run time)")
    args = parser.parse_args()

    spec = load_spec(args.spec)
    space, se = build_space(spec), spec.search
    threads, workload = max(1, int(se.cpu_per_trial)), workload_of(se)
    torch.manual_seed(0)
    supernet = build_supernet(spec, spec.data.tokenizer.vocab_size).eval()
    reference = resolve_reference(spec, space)
    rng = random.Random(0)
    archs = [space.widest(), space.middle()] + [space.sample(rng) for _ in range(max(0, args.archs - 2))]
    ref_model = extract(supernet, reference).eval()
    models = [extract(supernet, a).eval() for a in archs]
    prefixes = [p for p in PREFIXES if p <= args.rounds] or [args.rounds]
    with torch_threads(threads):
        where = describe_device("cpu")
    print(f"{spec.name}: {where}; workload {workload_tag(workload)}; reference {reference.summary()}; "
          f"{args.reps} repetitions per arch and condition", flush=True)

    # ratios[(method, rounds, condition)][arch index] -> list of repeated ratios
    ratios: dict[tuple[str, int, str], list[list[float]]] = {}
    started = time.monotonic()
    for condition in ("quiet", "loaded"):
        spawn = multiprocessing.get_context("spawn")
        stop, neighbour = spawn.Event(), None
        if condition == "loaded":
            neighbour = spawn.Process(target=_busy, args=(stop,), daemon=True)
            neighbour.start()
            time.sleep(1.0)
        try:
            for i, (arch, model) in enumerate(zip(archs, models)):
                for _ in range(args.reps):
                    cand, ref = interleaved_timings(model, arch, ref_model, reference, workload=workload,
                                                    rounds=args.rounds, threads=threads)
                    for k in prefixes:
                        ratios.setdefault(("interleaved", k, condition), [[] for _ in archs])[i].append(
                            summarize_interleaved(cand[:k], ref[:k + 1])["latency_ratio"])
                    if not args.no_apart:
                        ratios.setdefault(("apart", 20, condition), [[] for _ in archs])[i].append(
                            _apart(model, arch, ref_model, reference, workload, threads))
                print(f"  {condition} {arch.summary()} done ({time.monotonic() - started:.0f} s)", flush=True)
        finally:
            stop.set()
            if neighbour is not None:
                neighbour.join(5)

    print(f"\n{'method':<12}{'rounds':>7}  {'spread quiet':>13}{'worst':>7}  {'spread loaded':>14}{'worst':>7}  "
          f"{'quiet->loaded shift':>20}")
    for method, k in [("interleaved", k) for k in prefixes] + ([] if args.no_apart else [("apart", 20)]):
        quiet, loaded = ratios[(method, k, "quiet")], ratios[(method, k, "loaded")]
        sq, sl = [_spread(v) for v in quiet], [_spread(v) for v in loaded]
        shift = [abs(statistics.median(l) / statistics.median(q) - 1) for q, l in zip(quiet, loaded)]
        print(f"{method:<12}{k:>7}  {statistics.median(sq):>12.1%}{max(sq):>7.1%}  {statistics.median(sl):>13.1%}"
              f"{max(sl):>7.1%}  {statistics.median(shift):>12.1%} (max {max(shift):.1%})")
    print("\nmedian ratio per arch (quiet, interleaved, most rounds):")
    for arch, values in zip(archs, ratios[("interleaved", prefixes[-1], "quiet")]):
        print(f"  {statistics.median(values):.3f}  {arch.summary()}")


if __name__ == "__main__":
    main()
