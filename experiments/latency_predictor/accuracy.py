"""How well level 1's latency predictor foresees what level 2 measures (issue 40 part 1), on stored measurements.

Step 1, ``measure`` (CPU, quiet machine): time archs of a sweep's space on its fixed workload with
:func:`nas.eval.latency.measure_latency_ratio` (interleaved with the reference, ``search.cpu_per_trial`` threads,
``search.latency_repeats`` rounds), exactly as level 1's predictor samples and level 2's trials are timed. One JSON
file per measurement in ``--out`` (``<arch_id>.<k>.json``, the k-th time that arch was timed), so a kill loses at
most the arch being timed and a rerun continues. The archs: ``--random N`` distinct random ones (the widest and the
narrowest first, as the predictor's samples), then, with ``--archs FILE`` (a JSON list of arch dicts, e.g. a sweep's
level-2 archs), those; ``--repeat K`` times the first ``K`` of them a second time (the measurement's own spread).

Step 2, ``analyse``: draws training sets as a sweep does (``--train`` samples: the widest, the narrowest, random
others), fits each predictor variant on them, and scores every other measured arch:

- the mean absolute percentage error (MAPE) and the bias (mean signed error) of the predicted ratio, on all held-out
  archs and on those near the budget (measured ratio in ``[budget - 0.15, budget + 0.15]``);
- what level 1 does with it: of the held-out archs predicted feasible (``ratio <= budget``), the share measured
  feasible, and the largest 8 of them by FLOP-like size (the archs a BLEU search keeps: BLEU grows with size), how
  many of those 8 are measured feasible;
- the share of the held-out archs measured feasible that the check drops (the price of a margin);
- the same with level 1's margin (``search.evolution.latency_margin: auto``: the training set's 5-fold
  cross-validated MAPE), the predicted ratio times ``1 + margin`` checked against the budget.
- the measurement's own spread: the relative difference between two measurements of one arch.

    python experiments/latency_predictor/accuracy.py measure search_spaces/quickstart.yaml \\
        --supernet nas_runs/quickstart/supernet --random 120 --repeat 20 --out experiments/latency_predictor/acc
    python experiments/latency_predictor/accuracy.py analyse experiments/latency_predictor/acc --budget 1.25
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def measure(args: argparse.Namespace) -> None:
    import torch
    from rich.progress import track

    from nas.atomic import atomic_write_text
    from nas.builders import build_space, build_supernet
    from nas.eval.latency import measure_latency_ratio
    from nas.eval.latency.samples import _sample_archs, resolve_reference
    from nas.eval.latency.timing import describe_device
    from nas.model.supernet import extract
    from nas.space import load_spec
    from nas.space.arch import Arch
    from nas.space.predictor_file import workload_of

    spec = load_spec(args.yaml, check_files=False)
    space = build_space(spec)
    if args.supernet:
        from nas.search.trials import load_supernet
        supernet = load_supernet(str(args.supernet))
    else:  # latency on the fixed workload does not depend on the weights
        torch.manual_seed(0)
        supernet = build_supernet(spec, spec.data.tokenizer.vocab_size, space)
    supernet.eval()
    reference = resolve_reference(spec, space)
    archs = _sample_archs(space, args.random, args.seed, reference) if args.random else []
    if args.archs:
        archs += [Arch.from_dict(a) for a in json.loads(args.archs.read_text())]
    jobs = [(a, 0) for a in archs] + [(a, 1) for a in archs[:args.repeat]]
    threads = max(1, int(spec.search.cpu_per_trial))
    torch.set_num_threads(threads)
    reference_model = extract(supernet, reference).eval()
    args.out.mkdir(parents=True, exist_ok=True)
    for arch, k in track(jobs, description="timing"):
        path = args.out / f"{arch.arch_id}.{k}.json"
        if path.exists():
            continue
        measured = measure_latency_ratio(extract(supernet, arch).eval(), arch, reference_model, reference,
                                         workload=workload_of(spec.search), rounds=spec.search.latency_repeats,
                                         threads=threads)
        atomic_write_text(path, json.dumps({
            "arch": arch.to_dict(), "arch_id": arch.arch_id, "model_dim": supernet.model_dim,
            "workload": workload_of(spec.search), **measured, "device": describe_device(torch.device("cpu")),
            "threads": threads, "reference": arch.arch_id == reference.arch_id}))


def _size(sample: dict) -> float:
    """FLOP-like size of an arch: the sum over layers of width x branches + FFN width (both stacks)."""
    total = 0.0
    for stack in ("encoder", "decoder"):
        s = sample["arch"][stack]
        total += sum(w * b + f for w, b, f in zip(s["width"], s["branches"], s["ffn_width"]))
    return total


VARIANTS = {
    "ridge 3, log ratio (default)": {"hidden_layers": 0, "ridge": 3.0},
    "ridge 1, log ratio": {"hidden_layers": 0, "ridge": 1.0},
    "ridge 0.3, log ratio": {"hidden_layers": 0, "ridge": 0.3},
}


def analyse(args: argparse.Namespace) -> None:
    from nas.eval.latency import LatencyPredictor, cross_validate

    first, second = {}, {}
    if args.folder.is_file():  # a JSON list of samples (collect_samples', e.g. a sweep's predictor samples)
        first = {s["arch_id"]: s for s in json.loads(args.folder.read_text())}
    for path in sorted(args.folder.glob("*.json")) if args.folder.is_dir() else []:
        sample = json.loads(path.read_text())
        (first if path.name.endswith(".0.json") else second)[sample["arch_id"]] = sample
    pairs = [abs(second[a]["latency_ratio"] - first[a]["latency_ratio"]) / first[a]["latency_ratio"]
             for a in second if a in first]
    if pairs:
        print(f"measurement spread: {len(pairs)} archs timed twice, |r2 - r1| / r1 median {100 * statistics.median(pairs):.1f}%, "
              f"max {100 * max(pairs):.1f}%")
    samples = list(first.values())
    ratios = sorted(s["latency_ratio"] for s in samples)
    print(f"{len(samples)} archs measured, ratio {ratios[0]:.2f}-{ratios[-1]:.2f} (median {statistics.median(ratios):.2f})")
    by_size = sorted(samples, key=_size)
    ends = {by_size[0]["arch_id"], by_size[-1]["arch_id"]}
    others = [s for s in samples if s["arch_id"] not in ends]
    print(f"training sets of {args.train} (widest, narrowest, {args.train - 2} random), {args.draws} draws; "
          f"budget {args.budget}")
    print(f"{'variant':32s} {'MAPE':>6s} {'bias':>6s} {'MAPE near':>9s} {'bias near':>9s} "
          f"{'pred-feasible ok':>16s} {'top-8 ok':>8s} {'top-8 max err':>13s} {'feasible lost':>13s}")
    rows = [(name, kwargs, False) for name, kwargs in VARIANTS.items()]
    rows.append(("ridge 3 + margin auto (CV MAPE)", VARIANTS["ridge 3, log ratio (default)"], True))
    for name, kwargs, guarded in rows:
        errs, near, ok, top_ok, top_err, lost, margins = [], [], [], [], [], [], []
        for d in range(args.draws):
            rng = random.Random(d)
            train = [s for s in samples if s["arch_id"] in ends] + rng.sample(others, args.train - 2)
            held = [s for s in samples if s not in train]
            p = LatencyPredictor(samples[0]["model_dim"], workload=samples[0]["workload"], **kwargs)
            # the margin a sweep would use: the training set's 5-fold CV MAPE (as fit_predictor_file saves it)
            margin = min(0.5, cross_validate(p, train)["cv_mape"] / 100) if guarded else 0.0
            margins.append(margin)
            p.fit(train, holdout=0.0)
            pred = p.predict_ratio_many([s["arch"] for s in held])
            rel = [(q - s["latency_ratio"]) / s["latency_ratio"] for q, s in zip(pred, held)]
            errs += rel
            near += [e for e, s in zip(rel, held) if abs(s["latency_ratio"] - args.budget) <= 0.15]
            feasible = [(s, q) for s, q in zip(held, pred) if q * (1 + margin) <= args.budget]
            ok += [s["latency_ratio"] <= args.budget for s, _ in feasible]  # pooled over the draws
            kept = {s["arch_id"] for s, _ in feasible}
            lost += [s["arch_id"] not in kept for s in held if s["latency_ratio"] <= args.budget]
            top = sorted(feasible, key=lambda sq: _size(sq[0]))[-8:]
            top_ok.append(sum(s["latency_ratio"] <= args.budget for s, _ in top))
            top_err += [max(abs(q - s["latency_ratio"]) / s["latency_ratio"] for s, q in top)] if top else []
        mape = lambda e: 100 * statistics.fmean(abs(x) for x in e)
        bias = lambda e: 100 * statistics.fmean(e)
        print(f"{name:32s} {mape(errs):5.1f}% {bias(errs):+5.1f}% {mape(near):8.1f}% {bias(near):+8.1f}% "
              f"{100 * statistics.fmean(ok):15.0f}% {statistics.fmean(top_ok):8.1f} {100 * statistics.fmean(top_err or [0]):12.1f}% "
              f"{100 * statistics.fmean(lost):12.0f}%"
              + (f"  (margin {100 * min(margins):.1f}-{100 * max(margins):.1f}%, median "
                 f"{100 * statistics.median(margins):.1f}%)" if guarded else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure")
    m.add_argument("yaml", type=Path)
    m.add_argument("--supernet", type=Path, help="a trained supernet folder (default: freshly initialised)")
    m.add_argument("--random", type=int, default=0)
    m.add_argument("--archs", type=Path, help="JSON list of arch dicts to time too")
    m.add_argument("--repeat", type=int, default=0)
    m.add_argument("--seed", type=int, default=1)
    m.add_argument("--out", type=Path, required=True)
    a = sub.add_parser("analyse")
    a.add_argument("folder", type=Path, help="a folder of `measure` or a JSON list of samples")
    a.add_argument("--train", type=int, default=30)
    a.add_argument("--draws", type=int, default=50)
    a.add_argument("--budget", type=float, default=1.25)
    args = ap.parse_args()
    measure(args) if args.command == "measure" else analyse(args)


if __name__ == "__main__":
    main()
