"""Is a trial's ``latency_ms`` the latency the arch has? Repeatability and order of measured latencies.

Run: ``python benchmarks/bench_latency.py [search_spaces/quickstart.yaml] [--rounds 5] [--archs 2] [--scorers 1]``
(on an otherwise idle machine)

Sub-Transformers of the space: the widest, the middle, the narrowest, ``--archs`` random ones (seeded) and the
reference of ``latency_ratio`` (``search.latency_reference``), extracted from the supernet (the trained one in
``<workdir>/<name>/supernet`` if there is one, else ``nas.builders.build_supernet``'s untrained weights;
``--supernet DIR`` picks one: the fixed workload does not depend on the weights). Each is measured as a sweep's
trial measures it (:func:`nas.eval.latency.measure_fixed_latency` on ``search.latency_workload``: a dummy source,
exactly ``tgt_tokens`` beam-search decoder steps, ``search.latency_repeats`` timed runs after 5 untimed ones, the
top and bottom 10% dropped, ``search.cpu_per_trial`` threads), ``--rounds`` times, the archs interleaved in every
round. Printed side by side from one run, for three conditions:

- ``alone``: nothing else of ours computes;
- ``locked``: ``--scorers`` processes decode validation sentences beside it (as other trials score their
  BLEU), holding the node's measurement lock shared, while each measurement holds it exclusively (a sweep now);
- ``unlocked``: the same scorers, no lock (a sweep before the lock).

Per arch and condition: median, min and max of the rounds' latencies (ms) and the spread
``(max - min) / median`` (goal: within 10%), and the arch's ``latency_ratio`` (its median over the reference's,
first condition); then the dominance violations: pairs where a sub-Transformer whose every dimension is at most
another's (depth, and per layer width, FFN width, branches, paths, units; same layout and kernels) measured slower
than it in some round. With a fixed number of decoder steps no output length excuses such a violation.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from nas.data import EOS_ID
from nas.builders import build_space, build_supernet, prepare_sweep_data
from nas.eval.latency import measure_fixed_latency, resolve_reference, workload_of, workload_tag
from nas.eval.measure_lock import MeasureLock
from nas.model.decode import beam_search
from nas.model.io import load_model
from nas.model.supernet import SuperTransformer, extract
from nas.space import load_spec
from nas.space.arch import Arch, StackArch

CONDITIONS = ("alone", "locked", "unlocked")


def _stack_at_most(a: StackArch, b: StackArch) -> bool:
    if a.layers > b.layers:
        return False
    for x, y in zip(a.layer_dims(), b.layer_dims()):  # a's layers against b's first layers
        if (x.layout, x.kernels) != (y.layout, y.kernels):
            return False
        if any(getattr(x, k) > getattr(y, k) for k in ("width", "ffn_width", "branches", "paths", "units",
                                                       "encoder_attention")):
            return False
    return True


def at_most(a: Arch, b: Arch) -> bool:
    """Every dimension of ``a`` is at most ``b``'s (so ``a`` does no more work per token than ``b``)."""
    return ((a.model_width or 0) <= (b.model_width or 0) and _stack_at_most(a.encoder, b.encoder)
            and _stack_at_most(a.decoder, b.decoder))


def _model(spec, vocab_size: int, supernet: str | None) -> tuple[SuperTransformer, str]:
    folder = Path(supernet) if supernet else spec.run_dir / "supernet"
    if (folder / "supernet.safetensors").is_file():
        return load_model(folder, "supernet").eval(), f"trained supernet {folder}"
    if supernet:
        raise SystemExit(f"no supernet.safetensors in {folder}")
    torch.manual_seed(0)
    return build_supernet(spec, vocab_size).eval(), "untrained supernet (build_supernet, seed 0)"


def _scorer(spec_file: str, supernet: str | None, folder: str | None, stop, ready) -> None:
    """A background trial decoding validation sentences (beam search, widest arch, 1 thread) until ``stop``;
    with ``folder`` it holds the lock there shared for every batch of 8 sentences, as a trial's scoring does."""
    torch.set_num_threads(1)
    spec = load_spec(spec_file)
    data = prepare_sweep_data(spec, progress=False)
    model, _ = _model(spec, data.vocab_size, supernet)
    widest = build_space(spec).widest()
    src_ids, _ = data.load_split("valid")
    rows = [ids[: model.max_positions // 2 - 1] + [EOS_ID] for ids in src_ids[:64]]
    lock = MeasureLock(folder) if folder else None
    batches = [_padded(rows[i:i + 8]) for i in range(0, len(rows), 8)]
    ready.set()
    while not stop.is_set():
        for src in batches:
            if lock is None:
                beam_search(model, src, widest, beam_size=spec.search.beam_size)
            else:
                with lock.shared():
                    beam_search(model, src, widest, beam_size=spec.search.beam_size)


def _padded(rows: list[list[int]]) -> torch.Tensor:
    src = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)  # [b, s], PAD 0
    for r, ids in enumerate(rows):
        src[r, : len(ids)] = torch.tensor(ids)
    return src


def _measure(condition: str, args, spec, archs: dict[str, Arch], subs: dict, folder: str) -> dict[str, list]:
    """``--rounds`` interleaved measurements of every arch under ``condition``: name -> [ms per round]."""
    ctx = multiprocessing.get_context("spawn")
    stop, procs = ctx.Event(), []
    if condition != "alone":
        for _ in range(args.scorers):
            ready = ctx.Event()
            procs.append(ctx.Process(target=_scorer, args=(args.spec, args.supernet,
                                                           folder if condition == "locked" else None, stop, ready)))
            procs[-1].start()
            ready.wait(300)
        time.sleep(1.0)  # the scorers are decoding
    lock = MeasureLock(folder) if condition != "unlocked" else None
    se = spec.search
    w = workload_of(se)
    try:
        times: dict[str, list] = {name: [] for name in archs}
        for _ in range(args.rounds):
            for name, arch in archs.items():
                times[name].append(measure_fixed_latency(
                    subs[name], arch, src_tokens=w["src_tokens"], tgt_tokens=w["tgt_tokens"], beam_size=w["beam"],
                    batch_size=w["batch"], repeats=se.latency_repeats, threads=max(1, int(se.cpu_per_trial)),
                    lock=lock))
        return times
    finally:
        stop.set()
        for p in procs:
            p.join(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", nargs="?", default="search_spaces/quickstart.yaml")
    parser.add_argument("--rounds", type=int, default=5, help="measurements per arch and condition")
    parser.add_argument("--archs", type=int, default=2, help="random archs besides widest, middle and narrowest")
    parser.add_argument("--scorers", type=int, default=1, help="background scoring processes (locked, unlocked)")
    parser.add_argument("--supernet", default=None, help="supernet folder (default: the trained one, if any)")
    parser.add_argument("--conditions", default=",".join(CONDITIONS), help="comma-separated subset of "
                                                                          + ", ".join(CONDITIONS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    conditions = [c for c in args.conditions.split(",") if c]
    if not conditions or set(conditions) - set(CONDITIONS):
        raise SystemExit(f"--conditions: a comma-separated subset of {', '.join(CONDITIONS)}")
    spec = load_spec(args.spec)
    se = spec.search
    data = prepare_sweep_data(spec, progress=False)
    model, where = _model(spec, data.vocab_size, args.supernet)
    space = build_space(spec)
    rng = random.Random(args.seed)
    archs = {"widest": space.widest(), "middle": space.middle()}
    archs.update({f"random {i}": space.sample(rng) for i in range(args.archs)})
    archs["narrowest"] = space.narrowest()
    reference = resolve_reference(spec, space)
    ref_name = next((name for name, arch in archs.items() if arch == reference), "reference")
    archs.setdefault(ref_name, reference)
    subs = {name: extract(model, arch).eval() for name, arch in archs.items()}
    with tempfile.TemporaryDirectory() as folder:  # this run's own lock: a sweep running beside it is not waited for
        results = {c: _measure(c, args, spec, archs, subs, folder) for c in conditions}

    print(f"{spec.name}: {where}; workload {workload_tag(workload_of(se))} x {se.latency_repeats} timed runs, "
          f"{max(1, int(se.cpu_per_trial))} thread(s); {args.rounds} interleaved rounds per condition; "
          f"{args.scorers} background scorer(s) in locked/unlocked; reference ({se.latency_reference}): {ref_name}")
    head = "".join(f"{c + ' median':>16}{'min':>8}{'max':>8}{'spread':>8}" for c in conditions)
    print(f"{'arch':<11}{'ratio':>7}{head}  sub-Transformer")
    first = results[conditions[0]]
    for name, arch in archs.items():
        cells = ""
        for c in conditions:
            v = results[c][name]
            med = statistics.median(v)
            cells += f"{med:>16.2f}{min(v):>8.2f}{max(v):>8.2f}{(max(v) - min(v)) / med:>8.1%}"
        ratio = statistics.median(first[name]) / statistics.median(first[ref_name])
        print(f"{name:<11}{ratio:>7.3f}{cells}  {arch.summary()}")
    pairs = [(a, b) for a in archs for b in archs if a != b and at_most(archs[a], archs[b]) and archs[a] != archs[b]]
    for c in conditions:
        v = results[c]
        worst = max((max((v[n][r] - med) / med for r in range(args.rounds))
                     for n in archs for med in [statistics.median(v[n])]), default=0.0)
        spreads = [(max(v[n]) - min(v[n])) / statistics.median(v[n]) for n in archs]
        bad = [(a, b, sum(x > y for x, y in zip(v[a], v[b]))) for a, b in pairs]
        bad = [(a, b, k) for a, b, k in bad if k]
        print(f"{c}: spread max {max(spreads):.1%} (goal <= 10%), worst round {worst:+.1%} over its median; "
              f"dominance violations {len(bad)} of {len(pairs)} ordered pairs"
              + ("".join(f"\n  {a} <= {b} in every dimension, yet slower in {k} of {args.rounds} rounds"
                         for a, b, k in bad)))


if __name__ == "__main__":
    main()
