"""What the two-level search is worth on the quickstart space: proxy fidelity, latency, search against random.

Three steps, each resumable (one JSON per result under ``--out``; a rerun skips what exists):

``run`` (on the device the supernet scores on; the GPU check ran it on an H100)
    1. **Proxy fidelity.** 30 random quickstart archs (seed 1234) plus the 5 archs that
       ``experiments/search_value`` trained alone, each scored with inherited weights by every level-1
       candidate score (teacher-forced validation loss and greedy BLEU on the first
       ``search.evolution.subset_sentences`` validation sentences) and by level 2 (beam-4 BLEU and chrF
       on all validation sentences): ``fidelity/<arch_id>.json``.
    2. **Search against random search.** For seeds 0, 1, 2: level 1 (NSGA-II, ``population x generations``
       candidates, the level-1 score that agrees best with level-2 BLEU in step 1, the predicted CPU
       ``latency_ratio`` from ``--predictor``, the YAML's ``latency_ratio`` budget as a constraint) then
       ``search.trials`` archs of its front scored at level 2; against ``search.trials`` uniformly random
       archs scored the same way: ``search/<method>_seed<k>.json``.
``latency`` (on this CPU, nothing else running)
    Fixed-length ``latency_ms`` of every arch that level 2 scored, of the reference and of the widest
    (``latency/<arch_id>.json``: the median of 3 interleaved rounds, each HAT's trimmed mean of 20 runs); the run-to-run spread of one arch (5 timings); the predictor's error on
    20 held-out archs; one arch with random, inherited and trained weights.
``report``
    Kendall tau with a bootstrap 90% interval of each level-1 score against level-2 BLEU (and against the
    standalone BLEU where it exists), the hypervolumes of both searches' fronts (level-2 BLEU against the
    measured ``latency_ratio``; reference point BLEU 0 and the widest's ratio), into ``results.json`` and
    ``results.md``.

    python experiments/two_level.py run --data nas_runs/data/<hash> --supernet DIR --predictor P --device cuda
    python experiments/two_level.py latency --data nas_runs/data/<hash> --supernet DIR --predictor P
    python experiments/two_level.py report
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SPEC = REPO / "search_spaces" / "quickstart.yaml"
OUT = REPO / "experiments" / "two_level"
STANDALONE = [REPO / "experiments" / "search_value" / "baselines" / f"base-{n}.json"
              for n in ("2L-64", "2L-128", "3L-64", "3L-128")] + \
             [REPO / "experiments" / "search_value" / "quickstart" / "retrained_45e5583c61b2.json"]
SEEDS = (0, 1, 2)
N_RANDOM_ARCHS = 30
SCORES = ("valid_loss", "greedy_bleu")
ROUNDS = 3
"""Interleaved timing rounds per arch in ``latency``; the median is kept (this VM's run-to-run spread is ~20%)."""


def _write(path: Path, obj) -> None:
    from nas.atomic import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(obj, indent=1))


def _load_all(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []


def _spec():
    from nas.space import load_spec

    return load_spec(SPEC, check_files=False)


def _fidelity_archs(space, n_random: int = N_RANDOM_ARCHS) -> list[tuple[str, object, dict]]:
    """(source, arch, extra) for the 30 random archs and the 5 trained alone."""
    from nas.space.arch import Arch

    rng = random.Random(1234)
    archs: dict[str, tuple[str, object, dict]] = {}
    while len(archs) < n_random:
        arch = space.sample(rng)
        archs.setdefault(arch.arch_id, ("random", arch, {}))
    for path in STANDALONE:
        d = json.loads(path.read_text())
        arch = Arch.from_dict(d["arch"] if isinstance(d["arch"], dict) else ast.literal_eval(d["arch"]))
        extra = {"standalone_bleu": d["bleu"], "standalone_valid_loss": d["valid_loss"], "name": d.get("name", path.stem)}
        src, _, old = archs.get(arch.arch_id, ("standalone", arch, {}))
        archs[arch.arch_id] = ("random+standalone" if src == "random" else "standalone", arch, {**old, **extra})
    return list(archs.values())


class Scorer:
    """Level-1 and level-2 scores of archs with the supernet's inherited weights."""

    def __init__(self, spec, data, model) -> None:
        from nas.eval.validation import ValidationSet

        self.spec, self.model = spec, model
        self.subset = ValidationSet.load(data, spec.search.evolution.subset_sentences)
        self.full = ValidationSet.load(data, spec.search.valid_sentences)

    def level1(self, arch, score: str) -> float:
        from nas.eval.validation import validation_scores

        if score == "valid_loss":
            return validation_scores(self.model, arch, self.subset, beam_size=None, loss=True,
                                     max_tokens=self.spec.train.max_tokens)["valid_loss"]
        return validation_scores(self.model, arch, self.subset, beam_size=1, loss=False)["bleu"]

    def level2(self, arch) -> dict[str, float]:
        from nas.eval.validation import validation_scores

        return validation_scores(self.model, arch, self.full, beam_size=self.spec.search.beam_size, loss=True,
                                 max_tokens=self.spec.train.max_tokens)


def run_fidelity(scorer: Scorer, space, out: Path, n_random: int = N_RANDOM_ARCHS) -> None:
    for source, arch, extra in _fidelity_archs(space, n_random):
        path = out / "fidelity" / f"{arch.arch_id}.json"
        if path.is_file():
            continue
        t0 = time.perf_counter()
        row = {"arch_id": arch.arch_id, "arch": arch.to_json(), "arch_summary": arch.summary(), "source": source,
               **extra, **{f"level1_{s}": scorer.level1(arch, s) for s in SCORES}}
        row.update({f"level2_{k}": v for k, v in scorer.level2(arch).items()})
        row["seconds"] = time.perf_counter() - t0
        _write(path, row)
        print(f"fidelity {arch.arch_id}: {row['level1_valid_loss']:.3f} / {row['level1_greedy_bleu']:.2f} -> "
              f"BLEU {row['level2_bleu']:.2f}", flush=True)


def chosen_score(out: Path) -> str:
    """The level-1 score whose Kendall tau with level-2 BLEU is highest over the fidelity archs."""
    rows = _load_all(out / "fidelity")
    taus = {s: _tau([_oriented(r, s) for r in rows], [r["level2_bleu"] for r in rows]) for s in SCORES}
    return max(taus, key=taus.get)


def _oriented(row: dict, score: str) -> float:
    """A level-1 score oriented so that larger is better (the loss negated)."""
    value = row[f"level1_{score}"]
    return -value if score == "valid_loss" else value


def _tau(x, y) -> float:
    from scipy.stats import kendalltau

    return float(kendalltau(x, y).statistic)


def run_search(scorer: Scorer, space, predictor, out: Path, score: str, seeds=SEEDS) -> None:
    import optuna

    from nas.search.evolution import gene_choices, nsga2_sampler, select_level2, suggest_genes, tell

    spec = scorer.spec
    ev, k = spec.search.evolution, spec.search.trials
    constraints = [c for c in spec.search.parsed_constraints() if c.metric == "latency_ratio"]
    genes = gene_choices(space)
    reference_ms = predictor.reference_ms
    for seed in seeds:
        path = out / "search" / f"evolution_seed{seed}.json"
        if not path.is_file():
            t0 = time.perf_counter()
            directions = ["minimize" if score == "valid_loss" else "maximize", "minimize"]
            seeded = spec.model_copy(update={"search": spec.search.model_copy(update={"seed": seed})})
            study = optuna.create_study(directions=directions, sampler=nsga2_sampler(seeded))
            for _ in range(ev.population * ev.generations):
                trial = study.ask()
                arch = suggest_genes(space, trial, genes)
                trial.set_user_attr("arch_summary", arch.summary())
                ms = predictor.predict(arch)
                tell(study, {"number": trial.number, "score": scorer.level1(arch, score), "latency_ms": ms,
                             "latency_ratio": ms / reference_ms}, constraints)
            level1_s = time.perf_counter() - t0
            chosen = select_level2(study.get_trials(deepcopy=False), k, directions)
            rows = []
            for t in chosen:
                arch = space.from_params(t.params)
                rows.append({"arch": arch.to_json(), "arch_id": arch.arch_id, "arch_summary": arch.summary(),
                             "level1_score": t.values[0], "predicted_ratio": t.values[1], **scorer.level2(arch)})
            _write(path, {"method": "evolution", "seed": seed, "score": score, "level1_candidates": len(study.trials),
                          "level1_seconds": level1_s, "seconds": time.perf_counter() - t0, "level2": rows})
            print(f"evolution seed {seed}: {len(study.trials)} candidates in {level1_s:.0f} s, level 2 "
                  f"BLEU {[round(r['bleu'], 2) for r in rows]}", flush=True)
        path = out / "search" / f"random_seed{seed}.json"
        if not path.is_file():
            rng = random.Random(10_000 + seed)
            rows = []
            for _ in range(k):
                arch = space.sample(rng)
                ms = predictor.predict(arch)
                rows.append({"arch": arch.to_json(), "arch_id": arch.arch_id, "arch_summary": arch.summary(),
                             "predicted_ratio": ms / reference_ms, **scorer.level2(arch)})
            _write(path, {"method": "random", "seed": seed, "level2": rows})
            print(f"random seed {seed}: level 2 BLEU {[round(r['bleu'], 2) for r in rows]}", flush=True)


def cmd_run(args) -> None:
    import torch

    from nas.data import PreparedData
    from nas.eval.latency import LatencyPredictor
    from nas.model.io import load_model
    from nas.space.space import SearchSpace

    torch.manual_seed(0)
    spec = _spec()
    if args.smoke:  # a minute on a CPU: is the whole path wired?
        se = spec.search
        spec = spec.model_copy(update={"search": se.model_copy(update={
            "valid_sentences": 16, "trials": 2,
            "evolution": se.evolution.model_copy(update={"population": 4, "generations": 2, "subset_sentences": 8})})})
    data = PreparedData.open(Path(args.data).resolve())
    model = load_model(args.supernet, "supernet").to(args.device).eval()
    space = SearchSpace.from_spec(spec)
    scorer = Scorer(spec, data, model)
    t0 = time.perf_counter()
    run_fidelity(scorer, space, args.out, 3 if args.smoke else N_RANDOM_ARCHS)
    print(f"fidelity done in {time.perf_counter() - t0:.0f} s", flush=True)
    score = chosen_score(args.out)
    print(f"level-1 score chosen by tau against level-2 BLEU: {score}", flush=True)
    run_search(scorer, space, LatencyPredictor.load(args.predictor), args.out, score, (0,) if args.smoke else SEEDS)


def cmd_latency(args) -> None:
    """CPU, quiet: measured fixed-length latencies (weight-independent, so any weights do)."""
    import torch

    from nas.eval.latency import LatencyPredictor, measure_fixed_latency, resolve_reference, workload_of
    from nas.model.io import load_model
    from nas.model.supernet import extract
    from nas.space.arch import Arch
    from nas.space.space import SearchSpace

    spec = _spec()
    se = spec.search
    w = workload_of(se)
    kw = dict(src_tokens=w["src_tokens"], tgt_tokens=w["tgt_tokens"], beam_size=w["beam"], batch_size=w["batch"],
              repeats=se.latency_repeats, threads=1)
    model = load_model(args.supernet, "supernet").eval()
    space = SearchSpace.from_spec(spec)
    lat_dir = args.out / "latency"

    def timed(arch, model_=model) -> float:
        return measure_fixed_latency(extract(model_, arch).eval(), arch, **kw)

    archs = {a.arch_id: a for a in (resolve_reference(spec, space), space.widest())}
    for f in _load_all(args.out / "search"):
        for row in f["level2"]:
            archs.setdefault(row["arch_id"], Arch.from_json(row["arch"]))
    todo = [a for a in archs.values() if not (lat_dir / f"{a.arch_id}.json").is_file()]
    rounds: dict[str, list[float]] = {a.arch_id: [] for a in todo}
    for _ in range(ROUNDS):  # interleaved rounds: a slow spell of the machine spreads over every arch
        for a in todo:
            rounds[a.arch_id].append(timed(a))
    for a in todo:
        _write(lat_dir / f"{a.arch_id}.json", {"arch_id": a.arch_id, "arch_summary": a.summary(),
                                                "latency_ms": statistics.median(rounds[a.arch_id]),
                                                "rounds_ms": rounds[a.arch_id]})
    extra = args.out / "latency_checks.json"
    if not extra.is_file():
        torch.manual_seed(0)
        arch = space.middle()
        spread = [measure_fixed_latency(extract(model, arch).eval(), arch, **kw) for _ in range(5)]
        predictor = LatencyPredictor.load(args.predictor)
        rng = random.Random(777)
        held = []
        while len(held) < 20:
            a = space.sample(rng)
            if a.arch_id not in {h.arch_id for h in held}:
                held.append(a)
        measured = [measure_fixed_latency(extract(model, a).eval(), a, **kw) for a in held]
        predicted = predictor.predict_many(held)
        mape = 100 * sum(abs(p - m) / m for p, m in zip(predicted, measured)) / len(held)
        weights = {}
        sub = extract(model, arch).eval()
        weights["inherited"] = measure_fixed_latency(sub, arch, **kw)
        with torch.no_grad():
            for p in sub.parameters():
                p.normal_(0, 0.3)
        weights["random"] = measure_fixed_latency(sub, arch, **kw)
        if args.trained:
            trained = load_model(args.trained, "supernet").eval()
            weights["initialization"] = measure_fixed_latency(extract(trained, arch).eval(), arch, **kw)
        _write(extra, {"arch": arch.summary(), "spread_ms": spread,
                       "spread_rel": (max(spread) - min(spread)) / statistics.median(spread),
                       "heldout": [{"arch": a.summary(), "measured_ms": m, "predicted_ms": p}
                                   for a, m, p in zip(held, measured, predicted)],
                       "predictor_mape": mape, "weights_ms": weights,
                       "weights_rel": (max(weights.values()) - min(weights.values())) / min(weights.values())})
        print(f"spread {spread}, MAPE {mape:.1f}%, weights {weights}", flush=True)


def _bootstrap_tau(x, y, n=2000, seed=0) -> tuple[float, float]:
    rng = random.Random(seed)
    taus = []
    idx = list(range(len(x)))
    for _ in range(n):
        pick = [rng.choice(idx) for _ in idx]
        t = _tau([x[i] for i in pick], [y[i] for i in pick])
        if not math.isnan(t):
            taus.append(t)
    taus.sort()
    return taus[int(0.05 * len(taus))], taus[int(0.95 * len(taus)) - 1]


def hypervolume(points, ref_ratio: float) -> float:
    """2-D hypervolume of (BLEU maximized, latency_ratio minimized) points against (BLEU 0, ``ref_ratio``)."""
    pts = sorted((r, b) for b, r in points if r < ref_ratio and b > 0)
    hv, best = 0.0, 0.0
    for i, (r, b) in enumerate(pts):  # each ratio slab [r_i, r_i+1): the best BLEU among ratios <= r_i
        best = max(best, b)
        nxt = pts[i + 1][0] if i + 1 < len(pts) else ref_ratio
        hv += (nxt - r) * best
    return hv


def cmd_report(args) -> None:
    import numpy as np

    rows = _load_all(args.out / "fidelity")
    result: dict = {"fidelity": {"archs": len(rows)}}
    level2 = [r["level2_bleu"] for r in rows]
    borda = _borda(rows)
    for s in (*SCORES, "both"):
        x = [_oriented(r, s) for r in rows] if s != "both" else borda
        lo, hi = _bootstrap_tau(x, level2)
        result["fidelity"][s] = {"tau_level2_bleu": _tau(x, level2), "ci90": [lo, hi]}
        alone = [(xi, r["standalone_bleu"]) for xi, r in zip(x, rows) if "standalone_bleu" in r]
        if len(alone) >= 3:
            result["fidelity"][s]["tau_standalone_bleu"] = _tau(*zip(*alone))
            result["fidelity"][s]["standalone_archs"] = len(alone)
    lat = {p["arch_id"]: p["latency_ms"] for p in _load_all(args.out / "latency")}
    spec = _spec()
    from nas.eval.latency import resolve_reference
    from nas.space.space import SearchSpace

    space = SearchSpace.from_spec(spec)
    ref_ms = lat.get(resolve_reference(spec, space).arch_id)
    widest_ratio = lat[space.widest().arch_id] / ref_ms if ref_ms else None
    searches = {}
    for f in _load_all(args.out / "search"):
        pts = [(r["bleu"], lat[r["arch_id"]] / ref_ms) for r in f["level2"] if r["arch_id"] in lat]
        if len(pts) < len(f["level2"]) or widest_ratio is None:
            continue
        hv = hypervolume(pts, widest_ratio)
        from optuna._hypervolume import compute_hypervolume

        inside = np.array([[-b, r] for b, r in pts if r < widest_ratio and b > 0] or [[0.0, widest_ratio]])
        check = compute_hypervolume(inside, np.array([0.0, widest_ratio]))
        assert abs(check - hv) < 1e-6 * max(1.0, hv), (hv, check)  # an independent reference
        searches[f"{f['method']}_seed{f['seed']}"] = {"hypervolume": hv, "points": pts,
                                                       **({"level1_candidates": f["level1_candidates"],
                                                           "level1_seconds": f["level1_seconds"], "score": f["score"]}
                                                          if f["method"] == "evolution" else {})}
    result["search"] = searches
    result["reference_ms"], result["widest_ratio"] = ref_ms, widest_ratio
    margins = [searches[f"evolution_seed{s}"]["hypervolume"] - searches[f"random_seed{s}"]["hypervolume"]
               for s in SEEDS if f"evolution_seed{s}" in searches and f"random_seed{s}" in searches]
    result["hv_margins"] = margins
    checks = args.out / "latency_checks.json"
    if checks.is_file():
        result["latency_checks"] = json.loads(checks.read_text())
    _write(args.out / "results.json", result)
    print(json.dumps({k: v for k, v in result.items() if k != "search"}, indent=1))
    for name, s in sorted(searches.items()):
        print(f"{name}: hypervolume {s['hypervolume']:.3f}")
    print(f"margins (evolution - random) per seed: {margins}")


def _borda(rows) -> list[float]:
    """Mean rank of the two level-1 scores (both oriented larger-is-better)."""
    from scipy.stats import rankdata

    ranks = [rankdata([_oriented(r, s) for r in rows]) for s in SCORES]
    return [float(sum(r[i] for r in ranks) / len(ranks)) for i in range(len(rows))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("run", "latency", "report"):
        p = sub.add_parser(name)
        p.add_argument("--out", type=Path, default=OUT)
        if name != "report":
            p.add_argument("--data", required=True)
            p.add_argument("--supernet", type=Path, required=True)
            p.add_argument("--predictor", type=Path, required=True)
        if name == "run":
            p.add_argument("--device", default="cpu")
            p.add_argument("--smoke", action="store_true", help="3 archs, 16 sentences, 8 candidates, one seed")
        if name == "latency":
            p.add_argument("--trained", type=Path, help="another supernet folder (e.g. its weights at initialization) for the weights check")
    args = parser.parse_args()
    {"run": cmd_run, "latency": cmd_latency, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
