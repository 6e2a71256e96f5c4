"""Ground truth for ``search_spaces/quickstart_depth.yaml``: archs of the space trained alone with Transformer-Tiny's
recipe, so that "the search missed" can be told apart from "the space holds nothing better".

Phases (``--phase``, in this order):

- ``plan``: the archs and the recipe. The 3 baselines (Tiny-S 2+2, Transformer-Tiny 4+4 with 2 seeds, Tiny-L 6+6),
  :data:`DEEP` (deep encoder, shallow decoder: 5-6 encoder layers, 1-2 decoder layers, across the widths, FFN widths
  and branches) and :data:`UNIFORM` archs drawn uniformly from the space with seed :data:`SEED`. Writes
  ``experiments/ground_truth/plan.json`` (committed) and ``.gtgpu/`` (ignored by git: the YAML, the data and its
  cache), which travels to the GPU machine for ``experiments/ground_truth_gpu.py``.
- ``collect --results F``: split the GPU's ``results.json`` into one JSON per arch under
  ``experiments/ground_truth/archs/`` and add the paper-comparable BLEU of the test hypotheses
  (:func:`nas.eval.scores.paper_bleu`).
- ``latency``: time every arch on this CPU with the YAML's fixed workload, one thread, interleaved with
  Transformer-Tiny (:func:`nas.eval.latency.measure_latency_ratio`), fresh weights (latency is a function of the arch
  and the device); adds ``latency_ms`` and ``latency_ratio`` to each arch's JSON. Run it with nothing else running.
- ``report``: reads only the JSONs (and ``supernet_ranking.json`` when there: the ``quickstart_depth`` supernet's
  inherited validation loss of each in-space arch at fixed steps) and writes ``results.json``, ``results.md`` and
  ``front.png`` under ``experiments/ground_truth/``: every model, the true front against the baselines, the best
  arch under each baseline's latency, the supernet's rank correlations and top-5 hits, the dimensions that matter
  and the protocol's caveats (:func:`report`, :func:`markdown`, :func:`front_png`).

**The recipe** (:data:`RECIPE`) is Wu et al.'s (ACL 2021, LividWo/Revisit-MMT ``README-baseline.md`` and fairseq's
defaults): lr 0.005, inverse-square-root warm-up from 1e-7, 8,192 tokens per update (one batch here: one GPU holds
it), no gradient clipping, dropout 0.3, label smoothing 0.1, Adam (0.9, 0.98), the last 10 epochs averaged (a snapshot
every 62 updates, one epoch of Multi30k at 8,192 padded tokens), beam 5, length penalty 1. **Departures** (the
device time of a session): the run is :data:`STEPS` updates, not 8,000, and the warm-up is scaled with it (a quarter
of the run, as 2,000 of 8,000 is); it stays pre-norm with a SentencePiece vocabulary on raw text. The GPU run may
lower the step count further, the same for every arch (``steps_target`` in each JSON).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

YAML = ROOT / "search_spaces" / "quickstart_depth.yaml"
DATA = ROOT.parent / "shared" / "data" / "multi30k"
TEST = ("test_2016_flickr.en.gz", "test_2016_flickr.de.gz")
OUT = ROOT / "experiments" / "ground_truth"
CARRY = ROOT / ".gtgpu"
"""What travels to the GPU machine (ignored by git): plan, YAML, data and the data cache."""
SEED = 2026
UNIFORM = 20
EPOCH_UPDATES = 62
"""Updates of 8,192 padded tokens in one epoch of Multi30k (29,000 pairs x 17.6 padded tokens)."""
STEPS = 13 * EPOCH_UPDATES
"""Updates of the GPU run (806, 13 epochs): what 33 archs reach in about 5 minutes of one H200 shared by 33 processes
(about 3 updates a second each, measured in the first run)."""
RECIPE: dict[str, Any] = {
    "steps": STEPS, "lr": 0.005, "warmup_steps": STEPS // 4, "warmup_init_lr": 1e-7, "clip_norm": 0.0,
    "accumulate": 1, "max_tokens": 8192, "dropout": 0.3, "label_smoothing": 0.1, "drop_branch": 0.0,
    "average_last": 10, "checkpoint_every": EPOCH_UPDATES, "beam_size": 5, "length_penalty": 1.0}
BASELINES: dict[str, tuple[int, int, int, tuple[int, ...]]] = {
    # key: (layers per stack, width, FFN width, seeds); one branch
    "tiny_s": (2, 128, 256, (0,)),
    "tiny": (4, 128, 256, (0, 1)),
    "tiny_l": (6, 128, 512, (0,)),
}
DEEP: tuple[tuple[str, str], ...] = (
    # (encoder, decoder): per layer "width/ffn" with "x2" for two branches
    ("128/512 " * 6, "128/512"),
    ("128/512 " * 6, "128/512 128/512"),
    ("128/512x2 " * 6, "128/512 128/512"),
    ("128/512x2 " * 6, "128/256"),
    ("128/256 " * 5, "128/256 128/256"),
    ("128/512x2 " * 5, "64/256"),
    ("64/512 " * 6, "128/512 128/512"),
    ("128/512x2 " * 5, "128/512x2 128/512x2"),
    ("128/256x2 " * 6, "64/512 64/512"),
)
SUPERNET = {"steps": 6000, "checkpoint_every": 250, "keep_steps": [500, 1000, 2000, 4000]}
"""The ``quickstart_depth`` supernet trained beside the ground truth (issue "The search finds what the space holds",
part 1): its YAML's recipe, ``train.steps`` raised; fp16 weights come back at these steps and at the last."""


def _stack(text: str):
    from nas.space.arch import StackArch

    layers = text.split()
    width, ffn, branches = [], [], []
    for layer in layers:
        wf, _, b = layer.partition("x")
        w, f = wf.split("/")
        width.append(int(w))
        ffn.append(int(f))
        branches.append(int(b or 1))
    return StackArch(width=tuple(width), ffn_width=tuple(ffn), branches=tuple(branches))


def baseline_arch(key: str):
    """The hand-designed Transformer ``key`` of :data:`BASELINES` (uniform layers, one branch)."""
    from nas.space.arch import Arch, StackArch

    layers, width, ffn, _ = BASELINES[key]
    stack = StackArch(width=(width,) * layers, ffn_width=(ffn,) * layers, branches=(1,) * layers)
    return Arch(encoder=stack, decoder=stack)


def plan_models(spec) -> list[dict[str, Any]]:
    """The plan's models in order: baselines (by seed), :data:`DEEP`, then :data:`UNIFORM` distinct uniform draws
    (seed :data:`SEED`) that are neither a baseline nor a deep arch."""
    from nas.builders import build_space
    from nas.space.arch import Arch

    models: list[dict[str, Any]] = []
    seen: set[str] = set()

    def add(key: str, kind: str, arch, seed: int = 0) -> None:
        models.append({"key": key, "kind": kind, "seed": seed, "arch": arch.to_dict(), "arch_id": arch.arch_id,
                       "arch_summary": arch.summary()})
        seen.add(arch.arch_id)

    for name, (*_, seeds) in BASELINES.items():
        for s in seeds:
            add(f"baseline_{name}_seed{s}", "baseline", baseline_arch(name), s)
    for i, (enc, dec) in enumerate(DEEP):
        add(f"deep_{i:02d}", "deep", Arch(encoder=_stack(enc), decoder=_stack(dec)))
    space, rng = build_space(spec), random.Random(SEED)
    i = 0
    while i < UNIFORM:
        arch = space.sample(rng)
        if arch.arch_id in seen:
            continue
        add(f"uniform_{i:02d}", "uniform", arch)
        i += 1
    return models


def phase_plan(smoke: bool) -> None:
    """Write ``plan.json`` and the folder that travels (:data:`CARRY`)."""
    import yaml

    from nas.builders import prepare_sweep_data
    from nas.space import load_spec

    spec = load_spec(YAML)
    data = prepare_sweep_data(spec, progress=False)
    models = plan_models(spec)
    if CARRY.exists():
        shutil.rmtree(CARRY)  # ours: written only by this phase (ignored by git)
    (CARRY / "data").mkdir(parents=True)
    for name in ("train.en.gz", "train.de.gz", "val.en.gz", "val.de.gz", *TEST):
        shutil.copyfile(DATA / name, CARRY / "data" / name)
    raw = yaml.safe_load(YAML.read_text(encoding="utf-8"))
    for split, (src, tgt) in {"train": ("train.en.gz", "train.de.gz"), "valid": ("val.en.gz", "val.de.gz")}.items():
        raw["data"][split] = {"src": f".gtgpu/data/{src}", "tgt": f".gtgpu/data/{tgt}"}
    raw["data"]["cache_dir"] = ".gtgpu/cache"
    raw["workdir"] = ".gtgpu/runs"
    (CARRY / "sweep.yaml").write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    shutil.copytree(Path(spec.data.cache_dir), CARRY / "cache")
    recipe = dict(RECIPE)
    supernet = {**SUPERNET, "yaml": ".gtgpu/sweep.yaml"}
    if smoke:  # the CPU dry run: a few steps of everything
        recipe.update({"steps": 8, "warmup_steps": 2, "checkpoint_every": 2, "max_tokens": 1024})
        supernet.update({"steps": 6, "checkpoint_every": 2, "keep_steps": [2, 4]})
    plan = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "yaml": ".gtgpu/sweep.yaml",
            "test": [f".gtgpu/data/{n}" for n in TEST], "recipe": recipe, "keep_snapshots": 40,
            "supernet": supernet, "smoke": smoke, "vocab_size": data.vocab_size, "models": models}
    (CARRY / "plan.json").write_text(json.dumps(plan, indent=2), encoding="utf-8")
    if not smoke:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "plan.json").write_text(json.dumps(plan, indent=2) + "\n", encoding="utf-8")
    kinds = {k: sum(m["kind"] == k for m in models) for k in ("baseline", "deep", "uniform")}
    print(f"plan: {len(models)} models {kinds}, {recipe['steps']} steps; {CARRY}", file=sys.stderr, flush=True)


ARCHS = OUT / "archs"
"""One JSON per trained model (``<key>.json``)."""
ROW_KEYS = ("key", "kind", "seed", "arch_id", "arch_summary", "arch", "params", "steps_planned", "steps_target",
            "steps_done", "averaged_snapshots", "train_seconds", "wall_seconds", "train_loss", "device", "recipe",
            "valid_loss", "valid_bleu", "valid_chrf", "test_bleu", "test_chrf")


def _write(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


def phase_collect(results: Path) -> None:
    """One JSON per model of the GPU's ``results.json`` (``.json`` or ``.json.gz``) under :data:`ARCHS`, with the
    paper-comparable test BLEU (``test_bleu_paper``) of its hypotheses; the CPU latency of an earlier ``latency``
    phase is kept."""
    import gzip

    from nas.eval.scores import paper_bleu

    opener = gzip.open if results.suffix == ".gz" else open
    with opener(results, "rt", encoding="utf-8") as f:
        raw = json.load(f)
    with gzip.open(DATA / TEST[1], "rt", encoding="utf-8") as f:
        refs = [line.rstrip("\n") for line in f]
    done = 0
    for m in raw["models"]:
        if m.get("failed"):
            print(f"collect: {m['key']} failed on the GPU (exit {m.get('returncode')}); skipped", file=sys.stderr)
            continue
        path = ARCHS / f"{m['key']}.json"
        old = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        row = {k: m.get(k) for k in ROW_KEYS}
        row["test_bleu_paper"] = paper_bleu(m["test_hypotheses"], refs, "de")
        row["source"] = str(results.relative_to(ROOT)) if results.is_relative_to(ROOT) else str(results)
        row.update({k: v for k, v in old.items() if k.startswith("latency")})
        _write(path, row)
        done += 1
    print(f"collect: {done} models -> {ARCHS.relative_to(ROOT)}", file=sys.stderr, flush=True)


def phase_latency(rounds: int) -> None:
    """Time every collected arch on this CPU against Transformer-Tiny (fresh weights, one thread, ``rounds``
    interleaved rounds, the YAML's fixed workload); an arch already timed with these settings is skipped, so a
    killed run continues. Run it with nothing else running: the ratio cancels most load, the milliseconds do not."""
    import platform

    import torch

    from nas.builders import prepare_sweep_data
    from nas.eval.latency import measure_latency_ratio
    from nas.model.supernet import SuperTransformer
    from nas.retraining import _arch_config
    from nas.space import load_spec
    from nas.space.arch import Arch
    from nas.space.predictor_file import workload_of

    spec = load_spec(YAML)
    data = prepare_sweep_data(spec, progress=False)
    workload = workload_of(spec.search)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    bf16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text()

    def fresh(arch):
        torch.manual_seed(0)
        return SuperTransformer.from_config(_arch_config(spec, data.vocab_size, arch)).eval()

    reference = fresh(baseline_arch("tiny"))
    by_arch: dict[str, dict[str, float]] = {}
    for path in sorted(ARCHS.glob("*.json")):
        row = json.loads(path.read_text(encoding="utf-8"))
        if row.get("latency_rounds") == rounds and row.get("latency_workload") == workload:
            continue
        if row["arch_id"] not in by_arch:
            arch = Arch.from_dict(row["arch"])
            by_arch[row["arch_id"]] = measure_latency_ratio(fresh(arch), arch, reference, None, workload=workload,
                                                            rounds=rounds, threads=1)
        m = by_arch[row["arch_id"]]
        row.update({"latency_ms": m["latency_ms"], "latency_reference_ms": m["latency_reference_ms"],
                    "latency_ratio": m["latency_ratio"], "latency_rounds": rounds, "latency_workload": workload,
                    "latency_cpu": cpu, "latency_avx512_bf16": bf16, "latency_threads": 1})
        _write(path, row)
        print(f"latency {row['key']}: {m['latency_ms']:.1f} ms, {m['latency_ratio']:.3f}x Tiny", file=sys.stderr,
              flush=True)


RANKING = OUT / "supernet_ranking.json"
"""The supernet's inherited validation loss of each in-space arch at fixed steps (written beside the ground truth)."""
PAPER_STEPS = 8000
"""Transformer-Tiny's updates in Wu et al. (ACL 2021), for the caveats."""
BASELINE_LABELS = {"tiny_s": "Tiny-S", "tiny": "Tiny", "tiny_l": "Tiny-L"}
TOP_K = 5
BOOTSTRAP_DRAWS = 1000
PAPER_BLEU_HEADER = "test2016 BLEU (lowercased, Moses-tokenized, as Wu et al.)"
"""The paper-comparable column's name (:data:`nas.eval.scores.PAPER_BLEU_LABEL`; not imported: it imports torch)."""


def load_rows(folder: Path = ARCHS) -> list[dict[str, Any]]:
    """The per-model JSONs of :data:`ARCHS`, by file name."""
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted(folder.glob("*.json"))]


def _baseline_name(key: str) -> str:
    """``baseline_tiny_s_seed0`` -> ``tiny_s``."""
    return key.removeprefix("baseline_").rsplit("_seed", 1)[0]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def arch_points(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per arch (``arch_id``), its seeds averaged (BLEU, chrF, losses, milliseconds), sorted by latency then
    key. A baseline's point is keyed ``baseline_<name>`` and labelled (``Tiny``); another arch keeps its model key."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_id.setdefault(r["arch_id"], []).append(r)
    points = []
    for arch_id, group in by_id.items():
        group = sorted(group, key=lambda r: r["seed"])
        first = group[0]
        name = _baseline_name(first["key"]) if first["kind"] == "baseline" else None
        point = {"key": f"baseline_{name}" if name else first["key"], "kind": first["kind"], "arch_id": arch_id,
                 "label": BASELINE_LABELS.get(name, name) if name else first["key"], "baseline": name,
                 "arch_summary": first["arch_summary"], "arch": first["arch"], "seeds": [r["seed"] for r in group],
                 "models": [r["key"] for r in group], "params": first["params"]}
        for k in ("test_bleu", "test_bleu_paper", "test_chrf", "valid_loss", "latency_ms", "latency_ratio"):
            point[k] = _mean([r[k] for r in group])
        point["test_bleu_seeds"] = [r["test_bleu"] for r in group]
        points.append(point)
    return sorted(points, key=lambda p: (p["latency_ms"], p["key"]))


def pareto_front(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The non-dominated points (test sacreBLEU up, ``latency_ms`` down; :func:`nas.tracking.pareto.pareto_mask`),
    by latency."""
    from nas.tracking.pareto import pareto_mask

    mask = pareto_mask([(p["test_bleu"], p["latency_ms"]) for p in points], (True, False))
    return sorted((p for p, m in zip(points, mask) if m), key=lambda p: (p["latency_ms"], p["key"]))


def _dominates(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["test_bleu"] >= b["test_bleu"] and a["latency_ms"] <= b["latency_ms"]
            and (a["test_bleu"] > b["test_bleu"] or a["latency_ms"] < b["latency_ms"]))


def best_under(points: Sequence[dict[str, Any]], budget_ms: float, exclude: str | None = None) -> dict | None:
    """The point of highest test sacreBLEU at ``latency_ms <= budget_ms`` (ties: the faster, then the key), other
    than the arch ``exclude``; None when there is none."""
    fit = [p for p in points if p["latency_ms"] <= budget_ms and p["arch_id"] != exclude]
    return min(fit, key=lambda p: (-p["test_bleu"], p["latency_ms"], p["key"]), default=None)


def kendall_tau(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Kendall's tau-b of two paired lists (``scipy.stats.kendalltau``); None where undefined (fewer than 2 points,
    or a constant list)."""
    import math

    from scipy.stats import kendalltau

    if len(x) < 2:
        return None
    t = float(kendalltau(x, y).statistic)
    return None if math.isnan(t) else t


def bootstrap_tau(x: Sequence[float], y: Sequence[float], draws: int = BOOTSTRAP_DRAWS,
                  level: float = 0.95) -> tuple[float, float] | None:
    """Percentile bootstrap interval of :func:`kendall_tau`: the pairs resampled with replacement ``draws`` times
    (``numpy.random.default_rng(0)``, fresh for each call); resamples where tau is undefined are dropped. None when
    every resample is."""
    import numpy as np

    rng = np.random.default_rng(0)
    n, taus = len(x), []
    for _ in range(draws):
        idx = rng.integers(0, n, size=n)
        t = kendall_tau([x[i] for i in idx], [y[i] for i in idx])
        if t is not None:
            taus.append(t)
    if not taus:
        return None
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(taus, [tail, 100 - tail])
    return float(low), float(high)


def top_k_hits(true_bleu: dict[str, float], inherited_loss: dict[str, float], k: int = TOP_K) -> tuple[int, int]:
    """How many of the true top ``k`` (highest test BLEU) the supernet's top ``k`` (lowest inherited loss) holds,
    over the archs of ``true_bleu`` (ties broken by key); ``k`` is cut to their number. Returns ``(hits, k)``."""
    k = min(k, len(true_bleu))
    true = sorted(true_bleu, key=lambda a: (-true_bleu[a], a))[:k]
    guess = sorted(true_bleu, key=lambda a: (inherited_loss[a], a))[:k]
    return len(set(true) & set(guess)), k


def _interval(x: list[float], y: list[float]) -> dict[str, Any]:
    ci = bootstrap_tau(x, y)
    return {"tau": kendall_tau(x, y), "low": ci[0] if ci else None, "high": ci[1] if ci else None}


def ranking_report(points: Sequence[dict[str, Any]], ranking: dict[str, Any],
                   budgets: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per snapshot of ``ranking`` (``{"snapshots": {step: {"by_arch_id": {arch_id: loss}}}}``), over the points in
    it: Kendall tau of the inherited loss against the ground truth's valid loss and against minus its test BLEU,
    with bootstrap 95% intervals; under each budget (``latency_ms``) the top-5 hits and the supernet's pick (its
    lowest inherited loss) with its true test BLEU and rank."""
    snapshots = []
    for step in sorted(ranking["snapshots"], key=int):
        loss = ranking["snapshots"][step]["by_arch_id"]
        inside = [p for p in points if p["arch_id"] in loss]
        x = [loss[p["arch_id"]] for p in inside]
        top = []
        for b in budgets:
            fit = {p["arch_id"]: p["test_bleu"] for p in inside if p["latency_ms"] <= b["latency_ms"]}
            hits, k = top_k_hits(fit, loss)
            pick = min(fit, key=lambda a: (loss[a], a), default=None)
            top.append({"budget": b["budget"], "label": b["label"], "latency_ms": b["latency_ms"], "archs": len(fit),
                        "k": k, "hits": hits, "pick": _pick(inside, fit, pick)})
        level1 = {}
        for score, sign in (("valid_loss", 1.0), ("greedy_bleu", -1.0)):  # both as "lower is better"
            values = ranking["snapshots"][step].get("level1", {}).get(score, {})
            if all(p["arch_id"] in values for p in inside):
                level1[score] = _interval([sign * values[p["arch_id"]] for p in inside],
                                          [-p["test_bleu"] for p in inside])
        snapshots.append({"step": int(step), "archs": len(inside),
                          "outside": sorted(p["key"] for p in points if p["arch_id"] not in loss),
                          "valid_loss": _interval(x, [p["valid_loss"] for p in inside]),
                          "minus_test_bleu": _interval(x, [-p["test_bleu"] for p in inside]), "top_k": top,
                          "level1": level1})
    return {"metric": ranking.get("metric"), "notes": ranking.get("notes"), "snapshots": snapshots}


def _pick(points: Sequence[dict[str, Any]], fit: dict[str, float], arch_id: str | None) -> dict[str, Any] | None:
    """The supernet's pick under a budget: its key, true test BLEU and rank by it among ``fit`` (1 = the best)."""
    if arch_id is None:
        return None
    p = next(p for p in points if p["arch_id"] == arch_id)
    return {"key": p["key"], "label": _point_name(p), "test_bleu": p["test_bleu"],
            "true_rank": 1 + sum(b > fit[arch_id] for b in fit.values())}


def _share(values: Sequence[int]) -> str:
    """``"64"`` when every value is 64, ``"mixed"`` when they differ."""
    return str(values[0]) if len(set(values)) == 1 else "mixed"


DIMENSIONS = {
    "encoder depth": lambda a: str(len(a["encoder"]["width"])),
    "decoder depth": lambda a: str(len(a["decoder"]["width"])),
    "decoder width": lambda a: _share(a["decoder"]["width"]),
    "encoder branches": lambda a: _share(a["encoder"]["branches"]),
}
"""The groupings of :func:`dimension_groups`: arch dict -> group name."""


def dimension_groups(points: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per dimension of :data:`DIMENSIONS`, per value: the number of archs and their mean test BLEU and latency."""
    out = {}
    for dim, of in DIMENSIONS.items():
        groups: dict[str, list[dict[str, Any]]] = {}
        for p in points:
            groups.setdefault(of(p["arch"]), []).append(p)
        order = sorted(groups, key=lambda v: (not v.isdigit(), int(v) if v.isdigit() else 0, v))
        out[dim] = [{"value": v, "archs": len(groups[v]), "test_bleu": _mean([p["test_bleu"] for p in groups[v]]),
                     "latency_ms": _mean([p["latency_ms"] for p in groups[v]])} for v in order]
    return out


def _protocol(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    recipe = rows[0]["recipe"]
    steps = sorted({r["steps_done"] for r in rows})
    averaged = rows[0]["averaged_snapshots"]
    return {"models": len(rows), "steps_done": steps, "epoch_updates": recipe["checkpoint_every"],
            "max_tokens": recipe["max_tokens"], "warmup_steps": recipe["warmup_steps"], "lr": recipe["lr"],
            "averaged_first": averaged[0], "averaged_last": averaged[-1], "averaged_count": len(averaged),
            "averaged_span": (averaged[-1] - averaged[0]) / averaged[-1],
            "paper_steps": PAPER_STEPS, "paper_epochs": PAPER_STEPS / recipe["checkpoint_every"],
            "device": sorted({r["device"] for r in rows}), "cpu": sorted({r["latency_cpu"] for r in rows}),
            "avx512_bf16": sorted({r["latency_avx512_bf16"] for r in rows}),
            "latency_rounds": sorted({r["latency_rounds"] for r in rows}),
            "seeds": {r["key"]: r["seed"] for r in rows},
            "train_seconds": [min(r["train_seconds"] for r in rows), max(r["train_seconds"] for r in rows)]}


def _model_row(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("key", "kind", "seed", "arch_id", "arch_summary", "params", "latency_ms", "latency_ratio", "test_bleu",
            "test_bleu_paper", "test_chrf", "valid_loss", "valid_bleu", "valid_chrf", "steps_done")
    return {k: r[k] for k in keys}


def _brief(p: dict[str, Any] | None) -> dict[str, Any] | None:
    keys = ("key", "label", "kind", "arch_id", "arch_summary", "seeds", "test_bleu", "test_bleu_paper", "latency_ms",
            "latency_ratio", "params")
    return None if p is None else {k: p[k] for k in keys}


def report(rows: Sequence[dict[str, Any]], ranking: dict[str, Any] | None) -> dict[str, Any]:
    """The ground truth's report from the per-model JSONs (:data:`ARCHS`) and the supernet's ranking
    (:data:`RANKING`, or None): the models by latency; the true front (test sacreBLEU up, ``latency_ms`` down; one
    point per arch at its seed mean) and the baselines against it; the best arch under each baseline's latency and
    half Tiny's, with its margin over that baseline (over Tiny for half Tiny's); the supernet's rank correlations and
    top-5 hits; test BLEU and latency by dimension; the protocol's figures. Deterministic in its inputs.

    Raises:
        ValueError: ``rows`` holds no Transformer-Tiny (``baseline_tiny_seed*``).
    """
    points = arch_points(rows)
    by_base = {p["baseline"]: p for p in points if p["baseline"]}
    if "tiny" not in by_base:
        raise ValueError(f"no Transformer-Tiny among the rows ({sorted(r['key'] for r in rows)})")
    front = pareto_front(points)
    on_front = {p["key"] for p in front}
    budgets = _budgets(points, by_base)
    baselines = [{**_brief(p), "test_bleu_seeds": p["test_bleu_seeds"], "on_front": p["key"] in on_front,
                  "dominated_by": [_point_name(q) for q in front if _dominates(q, p)]} for p in by_base.values()]
    return {"models": [_model_row(r) for r in sorted(rows, key=lambda r: (r["latency_ms"], r["key"]))],
            "front": [_brief(p) for p in front], "baselines": baselines, "budgets": budgets,
            "beats_tiny": _beats_tiny(points, by_base["tiny"]),
            "ranking": ranking_report(points, ranking, [b for b in budgets if b["budget"] != "half_tiny"])
            if ranking else None,
            "dimensions": dimension_groups(points), "points": [_brief(p) for p in points],
            "protocol": _protocol(rows)}


def _budgets(points: Sequence[dict[str, Any]], by_base: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Half Tiny's latency and each baseline's: the best other arch at or under it and its margin over the baseline
    (over Tiny for half Tiny's)."""
    budgets = [{"budget": "half_tiny", "label": "half Tiny", "latency_ms": by_base["tiny"]["latency_ms"] / 2,
                "against": "tiny"}]
    budgets += [{"budget": name, "label": BASELINE_LABELS[name], "latency_ms": by_base[name]["latency_ms"],
                 "against": name} for name in BASELINE_LABELS if name in by_base]
    for b in budgets:
        base = by_base[b["against"]]
        best = best_under(points, b["latency_ms"], exclude=base["arch_id"])
        b.update({"against_label": base["label"], "against_bleu": base["test_bleu"],
                  "candidates": sum(p["latency_ms"] <= b["latency_ms"] and p["arch_id"] != base["arch_id"]
                                    for p in points),
                  "best": _brief(best), "margin_bleu": best["test_bleu"] - base["test_bleu"] if best else None})
    return budgets


def _beats_tiny(points: Sequence[dict[str, Any]], tiny: dict[str, Any]) -> dict[str, Any]:
    """The archs above Tiny's test BLEU (seed mean) at or under its latency; the best one's margin against Tiny's
    seed spread (``|seed0 - seed1|``, the max minus the min over its seeds; None with one seed)."""
    seeds = tiny["test_bleu_seeds"]
    better = [p for p in points if p["latency_ms"] <= tiny["latency_ms"] and p["test_bleu"] > tiny["test_bleu"]
              and p["arch_id"] != tiny["arch_id"]]
    best = max(better, key=lambda p: (p["test_bleu"], -p["latency_ms"]), default=None)
    spread = max(seeds) - min(seeds) if len(seeds) > 1 else None
    margin = best["test_bleu"] - tiny["test_bleu"] if best else None
    return {"tiny_bleu": tiny["test_bleu"], "tiny_seed_bleu": seeds, "tiny_latency_ms": tiny["latency_ms"],
            "seed_spread_bleu": spread, "archs_better": sorted(p["key"] for p in better), "best": _brief(best),
            "margin_bleu": margin, "exceeds_seed_spread": None if best is None or spread is None else margin > spread}


def _f(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def _tau_cell(t: dict[str, Any]) -> str:
    if t["tau"] is None:
        return "-"
    return f"{t['tau']:.3f} [{_f(t['low'], '.3f')}, {_f(t['high'], '.3f')}]"


def markdown(rep: dict[str, Any]) -> str:
    """The report of :func:`report` as Markdown (deterministic in ``rep``): BLEU and chrF to 2 decimals, losses to
    3, milliseconds to 1, ratios and taus to 3."""
    lines = ["# Ground truth: search_spaces/quickstart_depth.yaml trained alone", ""]
    lines += _protocol_lines(rep["protocol"]) + [""]
    lines += _model_lines(rep["models"]) + [""]
    lines += _front_lines(rep) + [""]
    lines += _budget_lines(rep) + [""]
    lines += _ranking_lines(rep["ranking"]) + [""]
    lines += _dimension_lines(rep["dimensions"]) + [""]
    lines += _caveat_lines(rep["protocol"])
    return "\n".join(lines) + "\n"


def _protocol_lines(p: dict[str, Any]) -> list[str]:
    steps = "/".join(str(s) for s in p["steps_done"])
    return [f"{p['models']} models trained alone on one {', '.join(p['device'])} with Transformer-Tiny's recipe for "
            f"{steps} updates of {p['max_tokens']:,} tokens (not {p['paper_steps']:,}: see the caveats at the end). "
            "test2016 = Multi30k test_2016_flickr; sacreBLEU on raw text is the primary score. Latency: the YAML's "
            f"fixed workload on this CPU, one thread, {'/'.join(str(r) for r in p['latency_rounds'])} rounds "
            "interleaved with Transformer-Tiny; ratio = to that interleaved Tiny. A baseline with several seeds is "
            "one point at its seed mean in the front, the budgets and the rankings."]


def _model_lines(models: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["## Every model, by latency", "",
             f"| model | kind | seed | arch | params (M) | latency (ms) | ratio to Tiny | test2016 sacreBLEU | "
             f"{PAPER_BLEU_HEADER} | test2016 chrF | valid loss | valid BLEU | steps |",
             "| --- " * 13 + "|"]
    for r in models:
        lines.append(f"| {r['key']} | {r['kind']} | {r['seed']} | `{r['arch_summary']}` | {r['params'] / 1e6:.2f} | "
                     f"{r['latency_ms']:.1f} | {r['latency_ratio']:.3f} | {r['test_bleu']:.2f} | "
                     f"{r['test_bleu_paper']:.2f} | {r['test_chrf']:.2f} | {r['valid_loss']:.3f} | "
                     f"{r['valid_bleu']:.2f} | {r['steps_done']} |")
    return lines


def _point_name(p: dict[str, Any]) -> str:
    if p["kind"] != "baseline":
        return p["key"]
    return p["label"] + (f" (seeds {', '.join(str(s) for s in p['seeds'])})" if len(p["seeds"]) > 1 else "")


def _front_lines(rep: dict[str, Any]) -> list[str]:
    lines = ["## The true front", "",
             "Non-dominated archs (test2016 sacreBLEU up, latency down), by latency; plot: `front.png`.", "",
             "| arch | kind | summary | latency (ms) | ratio to Tiny | test2016 sacreBLEU | "
             f"{PAPER_BLEU_HEADER} |", "| --- " * 7 + "|"]
    for p in rep["front"]:
        lines.append(f"| {_point_name(p)} | {p['kind']} | `{p['arch_summary']}` | {p['latency_ms']:.1f} | "
                     f"{p['latency_ratio']:.3f} | {p['test_bleu']:.2f} | {p['test_bleu_paper']:.2f} |")
    lines += ["", "The baselines against it:", ""]
    for b in rep["baselines"]:
        seeds = (f" (seeds {', '.join(f'{s:.2f}' for s in b['test_bleu_seeds'])})" if len(b["seeds"]) > 1 else "")
        where = ("on the front" if b["on_front"] else
                 f"dominated by {', '.join(b['dominated_by'])}")
        lines.append(f"- {b['label']}: {b['test_bleu']:.2f}{seeds} at {b['latency_ms']:.1f} ms, {where}.")
    return lines


def _budget_lines(rep: dict[str, Any]) -> list[str]:
    lines = ["## The best arch at or under each budget", "",
             "Best by test2016 sacreBLEU among the other archs at or under the budget (baselines included, seed "
             "means); margin over the budget's baseline (over Tiny for half Tiny's).", "",
             "| budget | latency (ms) | archs | best | summary | its latency (ms) | test2016 sacreBLEU | baseline | "
             "margin (BLEU) |", "| --- " * 9 + "|"]
    for b in rep["budgets"]:
        best = b["best"]
        if best is None:
            lines.append(f"| {b['label']} | {b['latency_ms']:.1f} | 0 | none | - | - | - | {b['against_label']} "
                         f"{b['against_bleu']:.2f} | - |")
            continue
        lines.append(f"| {b['label']} | {b['latency_ms']:.1f} | {b['candidates']} | {_point_name(best)} | "
                     f"`{best['arch_summary']}` | {best['latency_ms']:.1f} | {best['test_bleu']:.2f} | "
                     f"{b['against_label']} {b['against_bleu']:.2f} | {b['margin_bleu']:+.2f} |")
    t = rep["beats_tiny"]
    seeds = " and ".join(f"{s:.2f}" for s in t["tiny_seed_bleu"])
    lines.append("")
    if t["best"] is None:
        lines.append(f"**No arch beats Tiny** ({t['tiny_bleu']:.2f}, seeds {seeds}) at or under its "
                     f"{t['tiny_latency_ms']:.1f} ms.")
        return lines
    b = t["best"]
    spread = t["seed_spread_bleu"]
    verdict = ("no seed spread to compare with (one seed)" if spread is None else
               f"{'more' if t['exceeds_seed_spread'] else 'no more'} than Tiny's seed spread "
               f"`|seed0 - seed1|` = {spread:.2f} BLEU")
    n, runs = len(t["archs_better"]), "one seed" if len(b["seeds"]) == 1 else f"{len(b['seeds'])} seeds"
    lines.append(f"**{n} arch{'s beat' if n > 1 else ' beats'} Tiny** ({t['tiny_bleu']:.2f}, seeds {seeds}) at or "
                 f"under its {t['tiny_latency_ms']:.1f} ms: {', '.join(t['archs_better'])}. The best, {b['key']} "
                 f"(`{b['arch_summary']}`, {b['latency_ms']:.1f} ms, ratio {b['latency_ratio']:.3f}), by "
                 f"{t['margin_bleu']:+.2f} BLEU: {verdict}. It ran {runs}, and "
                 f"{len(t['tiny_seed_bleu'])} seeds of Tiny are a thin estimate of the seed noise.")
    return lines


def _ranking_lines(r: dict[str, Any] | None) -> list[str]:
    lines = ["## The supernet's ranking", ""]
    if r is None:
        return lines + [f"`{RANKING.name}` is not there: not computed."]
    lines += [f"Metric: {r['metric']} (lower is better), over the archs in the space (one point per arch, seed "
              "means). Kendall tau (scipy, tau-b) of the inherited loss against the ground truth's valid loss and "
              f"against minus its test2016 sacreBLEU (positive = the same order), [bootstrap 95% interval: archs "
              f"resampled with replacement, {BOOTSTRAP_DRAWS} draws, numpy default_rng(0)]. Top-{TOP_K}: of the true "
              f"top {TOP_K} by test BLEU among the in-space archs at or under the budget, how many are in the "
              f"supernet's top {TOP_K} (lowest inherited loss) under the same budget (k = min({TOP_K}, archs)).", ""]
    budgets = r["snapshots"][0]["top_k"] if r["snapshots"] else []
    lines += ["| supernet step | archs | tau vs valid loss | tau vs -test BLEU | "
              + " | ".join(f"top-{TOP_K} at {b['label']} ({b['latency_ms']:.1f} ms)" for b in budgets) + " |",
              "| --- " * (4 + len(budgets)) + "|"]
    for s in r["snapshots"]:
        tops = " | ".join(f"{t['hits']} of {t['k']}" for t in s["top_k"])
        lines.append(f"| {s['step']} | {s['archs']} | {_tau_cell(s['valid_loss'])} | "
                     f"{_tau_cell(s['minus_test_bleu'])} | {tops} |")
    lines += ["", "The supernet's pick under each budget (the lowest inherited loss: what a search over these archs on it would return), its "
              "test2016 sacreBLEU and its rank by that among the in-space archs under the budget:", "",
              "| supernet step | " + " | ".join(f"pick at {b['label']}" for b in budgets) + " |",
              "| --- " * (1 + len(budgets)) + "|"]
    for s in r["snapshots"]:
        picks = " | ".join("-" if (p := t["pick"]) is None else
                           f"{p['label']} {p['test_bleu']:.2f} ({p['true_rank']} of {t['archs']})" for t in s["top_k"])
        lines.append(f"| {s['step']} | {picks} |")
    if any(s.get("level1") for s in r["snapshots"]):
        lines += ["", "Level 1's two scores (`search.evolution.score`) as a sweep of the YAML computes them, on the first "
                  "200 validation sentences, against minus the ground truth's test2016 sacreBLEU (tau, [95% interval]): "
                  "which one a search should rank by at each length of supernet training:", "",
                  "| supernet step | inherited valid loss, all sentences | valid_loss, 200 sentences | "
                  "greedy_bleu, 200 sentences |", "| --- | --- | --- | --- |"]
        for s in r["snapshots"]:
            l1 = s.get("level1", {})
            cells = " | ".join(_tau_cell(l1[k]) if k in l1 else "-" for k in ("valid_loss", "greedy_bleu"))
            lines.append(f"| {s['step']} | {_tau_cell(s['minus_test_bleu'])} | {cells} |")
    outside = sorted({k for s in r["snapshots"] for k in s["outside"]})
    if outside:
        lines += ["", f"Not ranked (outside the space or missing from the file): {', '.join(outside)}."]
    if r.get("notes"):
        lines += ["", f"Notes of the ranking file: {r['notes']}"]
    return lines


def _dimension_lines(dims: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = ["## Which dimensions matter", "",
             "Every arch once (seed means; the baselines included, Tiny-L's 6-layer decoder too). Decoder width: "
             "the layers' widths, `mixed` when they differ; encoder branches likewise.", "",
             "| dimension | value | archs | mean test2016 sacreBLEU | mean latency (ms) |", "| --- " * 5 + "|"]
    for dim, groups in dims.items():
        for g in groups:
            lines.append(f"| {dim} | {g['value']} | {g['archs']} | {g['test_bleu']:.2f} | {g['latency_ms']:.1f} |")
    return lines


def _caveat_lines(p: dict[str, Any]) -> list[str]:
    steps = p["steps_done"][-1]
    epochs = steps / p["epoch_updates"]
    bf16 = "with" if all(p["avx512_bf16"]) else "without"
    seeds = sorted(k for k, s in p["seeds"].items() if s != 0)
    return ["## Protocol and caveats", "",
            f"Each model ran {steps} updates of {p['max_tokens']:,} tokens ({epochs:.0f} epochs of Multi30k at "
            f"{p['epoch_updates']} updates an epoch), not the paper's {p['paper_steps']:,}; the inverse-square-root "
            f"warm-up (lr {p['lr']} from 1e-7) was scaled to a quarter of the run ({p['warmup_steps']} updates, as "
            f"2,000 of 8,000 is). The last {p['averaged_count']} snapshots, one per epoch, were averaged: updates "
            f"{p['averaged_first']}-{p['averaged_last']}, {100 * p['averaged_span']:.0f}% of the run, where the paper "
            f"averages the last 10 of about {p['paper_epochs']:.0f} epochs; weights that far from the end likely cost "
            "BLEU at this length, and that averaging should not be copied to short runs. The models are pre-norm "
            "with a SentencePiece vocabulary on raw text (departures from Wu et al.'s fairseq setup). Latency was "
            f"timed on this CPU ({', '.join(p['cpu'])}, {bf16} AVX512-BF16), one thread; milliseconds of archs "
            "timed minutes apart move with the machine's load, the interleaved ratios less. All "
            f"{p['models']} models trained at once as parallel processes on one {', '.join(p['device'])} "
            f"({p['train_seconds'][0]:.0f}-{p['train_seconds'][1]:.0f} s of training each); seed 0 for every model "
            f"but {', '.join(seeds) or 'none'} (seed 1). This is an early-training ground truth, not Tiny's operating "
            "point (Tiny reached about 36 test2016 sacreBLEU after 8,000 updates of 4,096 tokens in the proof of "
            "value, `docs/proof_of_value.md`): it says which "
            "archs learn fastest in 13 epochs, and the ranking may change with longer training. Deep encoders and "
            "deep stacks in general (Tiny-L too) may converge later, so their low scores here are not evidence that "
            "they end worse, and a front drawn from this run favours shallow encoders."]


def phase_report(out: Path = OUT, ranking_path: Path = RANKING) -> dict[str, Any]:
    """``results.json`` (:func:`report`), ``results.md`` (:func:`markdown`) and ``front.png`` (:func:`front_png`)
    under ``out`` from the JSONs of :data:`ARCHS` and, when there, ``ranking_path``."""
    ranking = json.loads(ranking_path.read_text(encoding="utf-8")) if ranking_path.is_file() else None
    rep = report(load_rows(), ranking)
    _write(out / "results.json", rep)
    (out / "results.md").write_text(markdown(rep), encoding="utf-8")
    (out / "front.png").write_bytes(front_png(rep))
    for name in ("results.md", "results.json", "front.png"):
        print(f"report: {_shown(out / name)}", file=sys.stderr, flush=True)
    if out == OUT:
        DOCS_PAGE.write_text(docs_page(DOC_HEAD.read_text(encoding="utf-8"), markdown(rep)), encoding="utf-8")
        shutil.copyfile(out / "front.png", DOCS_PAGE.with_name("ground_truth_front.png"))
        print(f"report: {_shown(DOCS_PAGE)}", file=sys.stderr, flush=True)
    return rep


DOC_HEAD = OUT / "doc_head.md"
"""The hand-written top of ``docs/ground_truth.md`` (what it is, the findings in words, how to reproduce)."""
DOCS_PAGE = ROOT / "docs" / "ground_truth.md"


def docs_page(head: str, results_md: str) -> str:
    """``docs/ground_truth.md``: ``head``, then ``results.md`` without its title, the plot before the budgets."""
    lines = results_md.split("\n")
    if not lines[0].startswith("# "):
        raise ValueError("results.md does not start with its title")
    body = "\n".join(lines[2:])
    marker = "\n## The best arch at or under each budget"
    image = ("\n![The true front: every arch by kind, the front as a staircase, the baselines labelled]"
             "(ground_truth_front.png)\n")
    return head + body.replace(marker, image + marker, 1)


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def front_png(rep: dict[str, Any]) -> bytes:
    """The plot of :func:`report`: every arch (seed means) by kind, the true front as a staircase (its archs
    labelled ``u12`` for ``uniform_12``, ``d05`` for ``deep_05``), the baselines labelled, Tiny's latency dotted
    (matplotlib's Agg canvas; PNG bytes)."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.2, 4.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    styles = {"uniform": ("tab:blue", "o"), "deep": ("tab:orange", "^"), "baseline": ("k", "s")}
    for kind, (color, marker) in styles.items():
        pts = [p for p in rep["points"] if p["kind"] == kind]
        ax.scatter([p["latency_ms"] for p in pts], [p["test_bleu"] for p in pts], color=color, marker=marker,
                   label=f"{kind} ({len(pts)})", zorder=3)
    front = rep["front"]
    ax.plot([p["latency_ms"] for p in front], [p["test_bleu"] for p in front], drawstyle="steps-post",
            color="tab:red", linewidth=1.2, label="true front", zorder=2)
    named = [p for p in front if p["kind"] != "baseline"]
    for i, p in enumerate(named):  # alternately above left and below right: front points crowd at one latency
        short = p["key"][0] + p["key"].rsplit("_", 1)[-1]
        ax.annotate(short, (p["latency_ms"], p["test_bleu"]), textcoords="offset points", fontsize=7,
                    color="tab:red", xytext=(-4, 5) if i % 2 else (5, -9), ha="right" if i % 2 else "left")
    for b in rep["baselines"]:
        ax.annotate(b["label"], (b["latency_ms"], b["test_bleu"]), textcoords="offset points", xytext=(-6, 4),
                    fontsize=8, ha="right")
    tiny = rep["beats_tiny"]["tiny_latency_ms"]
    ax.axvline(tiny, color="gray", linewidth=0.8, linestyle=":")
    ax.set_xlabel("latency (ms, fixed workload, 1 thread, this CPU)")
    ax.set_ylabel("test_2016_flickr sacreBLEU (En-De)")
    steps = "/".join(str(s) for s in rep["protocol"]["steps_done"])
    ax.set_title(f"quickstart_depth archs trained alone, {steps} updates", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phase", required=True, choices=("plan", "collect", "latency", "report"))
    ap.add_argument("--smoke", action="store_true", help="a plan of a few steps, for a dry run on the CPU")
    ap.add_argument("--results", type=Path, default=OUT / "gpu_run2" / "results.json.gz",
                    help="the GPU's results.json (collect)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds per arch (latency; default 15)")
    args = ap.parse_args(argv)
    if args.phase == "plan":
        phase_plan(args.smoke)
    elif args.phase == "collect":
        phase_collect(args.results.resolve())
    elif args.phase == "latency":
        phase_latency(args.rounds)
    else:
        phase_report()


if __name__ == "__main__":
    main()
