"""What a sweep is worth, measured: searched Pareto fronts against hand-designed Transformers (Multi30k En->De).

Run (resumable; each result is its own JSON file under ``--out``, a killed run goes on with the next missing one)::

    python experiments/search_value.py                       # every phase, then the report
    python experiments/search_value.py --phase baselines     # one phase: baselines, quickstart, unified, tau, report

Every model gets the quickstart's budget: ``train.steps`` (560) optimizer steps of ``train.max_tokens`` (4096)
tokens, the same schedule (peak 1.5e-3, 150 warm-up steps, inverse square root) and precision. Scores: validation
BLEU, chrF and loss (nats/token), ``latency_ms`` (batch 1, beam 4, one thread, median; the trials' own
:func:`nas.search.trials.score_arch`) and ``params_m``; then BLEU and chrF on ``test_2016_flickr``.

- ``baselines`` (a): four uniform Transformers a user would pick by hand inside the quickstart space (2 or 3
  layers, model width 64 or 128, FFN 4x, one branch), each trained alone.
- ``quickstart`` (b): ``nas sweep search_spaces/quickstart.yaml`` (supernet with the sandwich rule, 8 Optuna
  TPE trials under ``latency_ms <= 30``); its feasible Pareto front with inherited weights (test set added).
- ``unified`` (c): the same for ``search_spaces/unified.yaml`` with the quickstart's ``train`` budget and
  ``search`` section (so the same trials, metrics and budget); also the inherited scores of the ``tau`` archs.
- ``refront``: every trial's latency measured again with nothing else running, and the front taken from those
  (the sweep's own front, timed beside other work, is kept as ``front_sweep.json``).
- ``retrain``: up to 3 members of each front trained alone (the quickstart's first).
- ``tau``: 8 sub-Transformers of the unified space, inherited against standalone (560 steps): the retrained
  front members and the rest spread over the space as ``nas fidelity`` spreads them; Kendall tau and Spearman
  rho of validation loss (the primary score) and BLEU.
- ``latency``: every point's ``latency_ms`` measured again, one after another with nothing else running (the
  earlier phases measured beside other work on the 2 cores): ``latency_quiet.json``; the report uses it.
- ``report``: reads only the JSON files and writes ``results.json``, ``results.md`` (the README's table) and
  ``pareto.png``: hypervolume of each front for BLEU against latency from one reference point, (BLEU 0, the
  sweep's latency budget of 30 ms), and which baselines each front dominates.

Compute is reported as wall seconds on the machine that ran the phase (supernet plus search against the sum of
the baselines' training); times taken while another job ran are flagged in the note, not corrected.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASES = ("baselines", "quickstart", "unified", "refront", "retrain", "latency", "tau", "report")
BASELINES = {  # name: (layers per stack, model width, FFN width); one branch, the quickstart's vocabulary
    "base-2L-64": (2, 64, 256),
    "base-3L-64": (3, 64, 256),
    "base-2L-128": (2, 128, 512),
    "base-3L-128": (3, 128, 512),
}
BUDGET_MS = 30.0
"""The quickstart's latency budget (``latency_ms <= 30``): the hypervolume's reference latency."""
RETRAINED = 3
"""Front members retrained alone, per front (the issue's cap)."""
TAU_ARCHS = 8
"""Unified sub-Transformers whose inherited and standalone scores are rank-correlated."""
TEST = ("test_2016_flickr.en.gz", "test_2016_flickr.de.gz")


def _write(path: Path, obj: Any) -> None:
    from nas.atomic import atomic_write_text

    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _read(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


# --------------------------------------------------------------------------- specs


def _spec_yaml(space: str, work: Path, steps: int | None = None) -> Path:
    """``<work>/<space>/sweep.yaml``: the space's YAML with the quickstart's train budget and search section."""
    quick = yaml.safe_load((ROOT / "search_spaces" / "quickstart.yaml").read_text())
    # The budget these results were measured at: quickstart.yaml's until 2026-12-01 (it now trains 400 steps at
    # 3e-3 and scores level 1 on 100 sentences, experiments/quickstart_schedule/README.md).
    quick["train"].update(steps=560, lr=1.5e-3, warmup_steps=150)
    quick["search"]["evolution"]["subset_sentences"] = 200
    raw = yaml.safe_load((ROOT / "search_spaces" / f"{space}.yaml").read_text())
    budget = {k: quick["train"][k] for k in ("steps", "max_tokens", "lr", "warmup_steps", "sandwich_k")}
    raw["train"] = {**raw.get("train", {}), **budget, "checkpoint_every": 100}
    raw["search"] = quick["search"]
    for split in ("train", "valid"):  # the YAMLs name data relative to the repository root
        raw["data"][split] = {k: str((ROOT / v).resolve()) for k, v in raw["data"][split].items()}
    if steps is not None:  # a smoke run of the whole pipeline
        raw["train"].update(steps=steps, warmup_steps=min(steps, raw["train"]["warmup_steps"]))
        raw["search"] = {**raw["search"], "trials": 2, "valid_sentences": 40, "latency_sentences": 4,
                         "points_to_evaluate": ["narrowest"]}
    raw["name"] = f"value_{space}"
    raw["workdir"] = str((work / "runs").resolve())
    raw["tracking"] = {"experiment": f"search_value_{space}"}
    path = work / space / "sweep.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = f"# written by experiments/search_value.py from search_spaces/{space}.yaml\n" + yaml.safe_dump(raw)
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return path


MODELS = Path("models")
"""``<work>/models``: the weights of every model trained alone (set by :func:`main`)."""
STEPS: int | None = None
"""``--steps``: a smoke run's budget (None: the quickstart's)."""


def _load(space: str, work: Path):
    from nas.space import load_spec

    path = _spec_yaml(space, work, STEPS)
    return load_spec(path), path


# --------------------------------------------------------------------------- scoring


def _score(model, arch, spec, data) -> dict[str, float]:
    """Validation scores and latency as a trial measures them, plus test_2016_flickr BLEU and chrF."""
    from nas.eval.validation import validation_scores
    from nas.search.trials import score_arch

    scores = score_arch(model, arch, spec, data)
    test = validation_scores(model, arch, _test_set(data), beam_size=spec.search.beam_size, loss=False)
    return {**scores, "test_bleu": test["bleu"], "test_chrf": test["chrf"]}


@functools.lru_cache(maxsize=2)
def _test_set(data):
    """test_2016_flickr (its first 40 pairs in a smoke run) as a text-only ValidationSet, read once per corpus."""
    from nas.eval.validation import ValidationSet

    folder = ROOT.parent / "shared" / "data" / "multi30k"
    src, ref = (_lines(folder / name)[:40 if STEPS else None] for name in TEST)
    return ValidationSet.from_text(src, ref, data.tokenizer())


def _train_alone(arch, spec, data, path: Path, extra: dict[str, Any]) -> dict[str, Any]:
    """Train ``arch`` from scratch for ``train.steps`` steps, score it, write ``path`` (and its weights under
    ``<work>/models/``, for the ``latency`` phase); reuse a stored result."""
    from nas.builders import build_supernet
    from nas.model.io import load_model, save_model
    from nas.search.fidelity import standalone_model, train_standalone

    stored = _read(path)
    if stored is not None and stored.get("arch_id") == arch.arch_id:
        return stored
    name = f"{path.parent.name}_{path.stem}"
    stats = _read(MODELS / f"{name}.train.json")  # trained and saved before, scoring did not finish
    if stats is not None and stats.get("arch_id") == arch.arch_id and (MODELS / f"{name}.json").is_file():
        model = load_model(MODELS, name)
        stats = {k: v for k, v in stats.items() if k != "arch_id"}
        print(f"scoring {arch.summary()}, trained alone before ({MODELS / name})", file=sys.stderr, flush=True)
    else:
        supernet = build_supernet(spec, data.vocab_size)
        model = standalone_model(supernet, arch, seed=0)
        del supernet
        print(f"training {arch.summary()} alone for {spec.train.steps} steps", file=sys.stderr, flush=True)
        stats = train_standalone(model, arch, spec, data, spec.train.steps)
        save_model(model, MODELS, name)  # before scoring: a failed scoring does not cost the training
        _write(MODELS / f"{name}.train.json", {"arch_id": arch.arch_id, **stats})
    row = {**extra, "arch_id": arch.arch_id, "arch_summary": arch.summary(), "arch": arch.to_dict(),
           "steps": spec.train.steps, **stats, **_score(model, arch, spec, data)}
    _write(path, row)
    print(f"  {path.name}: valid BLEU {row['bleu']:.2f}, loss {row['valid_loss']:.3f}, {row['latency_ms']:.1f} ms, "
          f"{row['params_m']:.2f} M, {row['train_seconds']:.0f} s", file=sys.stderr, flush=True)
    return row


# --------------------------------------------------------------------------- phases


def phase_baselines(work: Path, out: Path) -> None:
    from nas.builders import prepare_sweep_data
    from nas.space.arch import Arch, StackArch

    spec, _ = _load("quickstart", work)
    data = prepare_sweep_data(spec)
    for name, (layers, width, ffn) in BASELINES.items():
        stack = StackArch(width=(width,) * layers, ffn_width=(ffn,) * layers)
        _train_alone(Arch(encoder=stack, decoder=stack), spec, data, out / "baselines" / f"{name}.json",
                     {"name": name})


def _front(spec, results: Path) -> list[dict[str, Any]]:
    """The feasible Pareto front (BLEU up, latency down) of the scored trials in ``results``."""
    from nas.tracking.pareto import pareto_mask

    trials = [t for t in (_read(p) for p in sorted(results.glob("*.json"))) if t is not None]
    feasible = [t for t in trials if t.get("feasible", 1.0) == 1.0]
    mask = pareto_mask([(t["bleu"], t["latency_ms"]) for t in feasible], [True, False])
    front = {t["arch_id"]: t for t, keep in zip(feasible, mask) if keep}
    return sorted(front.values(), key=lambda t: t["latency_ms"])


def phase_sweep(space: str, work: Path, out: Path) -> None:
    """Sweep, front with inherited weights (test set added), then up to :data:`RETRAINED` members retrained."""
    from nas.builders import prepare_sweep_data
    from nas.model.io import load_model
    from nas.search import run_sweep
    from nas.search.runner import read_sweep_record, results_dir
    from nas.space.arch import Arch

    spec, path = _load(space, work)
    folder = out / space
    sweep_file = folder / "sweep.json"
    sweep = _read(sweep_file)
    if sweep is None:
        t0 = time.perf_counter()
        result = run_sweep(spec, path, resume=read_sweep_record(spec.run_dir.resolve()) is not None)
        seconds = time.perf_counter() - t0
        supernet_s = float(result.supernet_metrics.get("train_seconds", float("nan")))
        sweep = {"space": space, "sweep_id": result.sweep_id, "seconds": seconds, "supernet_seconds": supernet_s,
                 "trials_completed": result.trials_completed, "trials_failed": result.trials_failed,
                 "supernet_metrics": result.supernet_metrics}
        _write(sweep_file, sweep)
    data = prepare_sweep_data(spec)
    trials = results_dir(spec, sweep["sweep_id"])
    front_file = folder / "front.json"
    front = _read(front_file)
    if front is None:
        supernet = load_model(spec.run_dir / "supernet", "supernet")
        front = []
        for t in _front(spec, trials):
            arch = Arch.from_json(t["arch"])
            print(f"{space}: scoring front member {arch.summary()} on the test set", file=sys.stderr, flush=True)
            front.append({**_score(supernet, arch, spec, data), "arch_id": t["arch_id"],
                          "arch_summary": t["arch_summary"], "arch": arch.to_dict(),
                          "trial": {k: t[k] for k in ("bleu", "chrf", "valid_loss", "latency_ms", "params_m")}})
        _write(front_file, front)
        _write(folder / "trials.json", [_read(p) for p in sorted(trials.glob("*.json"))])
    if space == "unified":  # while the supernet is here: the inherited scores of the tau phase's other archs
        _tau_inherited(spec, data, out, supernet=None, front=front)


def phase_retrain(space: str, work: Path, out: Path) -> None:
    """Up to :data:`RETRAINED` members of the space's front (``front.json``) trained alone."""
    from nas.builders import prepare_sweep_data
    from nas.space.arch import Arch

    spec, _ = _load(space, work)
    data = prepare_sweep_data(spec)
    for member in _pick(_read(out / space / "front.json") or [], RETRAINED):
        arch = Arch.from_dict(member["arch"])
        _train_alone(arch, spec, data, out / space / f"retrained_{arch.arch_id}.json", {"space": space})


def _pick(front: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """At most ``k`` front members spread along it: the fastest, the best BLEU, the ones between by latency."""
    if len(front) <= k:
        return list(front)
    idx = sorted({round(i * (len(front) - 1) / (k - 1)) for i in range(k)})
    return [front[i] for i in idx]


def _tau_archs(spec, supernet, front: list[dict[str, Any]]):
    """The archs of the tau phase besides the retrained front members: :data:`TAU_ARCHS` minus those, spread
    over the space by :func:`nas.search.fidelity.spread_archs` (the narrowest, the widest, even steps of
    parameter count between), front members skipped."""
    from nas.builders import build_space
    from nas.model.supernet import count_params, extract
    from nas.search.fidelity import spread_archs

    retrained = {m["arch_id"] for m in _pick(front, RETRAINED)}
    archs = spread_archs(build_space(spec), TAU_ARCHS - len(retrained),
                         lambda a: count_params(extract(supernet, a)), seed=0)
    return [a for a in archs if a.arch_id not in retrained]


def _tau_inherited(spec, data, out: Path, supernet, front: list[dict[str, Any]]) -> None:
    """``unified/tau/inherited_<arch_id>.json``: validation scores of the tau archs with inherited weights."""
    from nas.model.io import load_model
    from nas.model.supernet import count_params, extract
    from nas.eval.validation import ValidationSet
    from nas.search.fidelity import score_model

    supernet = supernet or load_model(spec.run_dir / "supernet", "supernet")
    folder = out / "unified" / "tau"
    vset = ValidationSet.load(data, spec.search.valid_sentences)
    for arch in _tau_archs(spec, supernet, front):
        path = folder / f"inherited_{arch.arch_id}.json"
        if _read(path) is None:
            _write(path, {"arch_id": arch.arch_id, "arch_summary": arch.summary(), "arch": arch.to_dict(),
                          "params_m": count_params(extract(supernet, arch)) / 1e6,
                          **score_model(supernet, arch, spec, data, vset)})


def phase_tau(work: Path, out: Path, train: bool = True, only: tuple[str, ...] = ()) -> None:
    """Kendall tau and Spearman rho between inherited and standalone scores of :data:`TAU_ARCHS` unified
    sub-Transformers: the retrained front members and the archs of :func:`_tau_archs`, each trained alone
    (smallest first, so a cut-short run has the most points). Needs no supernet: the inherited scores were
    stored by the ``unified`` phase. ``train=False`` (``--no-train``): only the archs already trained count.
    ``only`` (``--only ID ...``): train only these arch ids (so that two processes, one thread each, can train
    two archs at once on two cores); the others count if already trained."""
    from nas.builders import prepare_sweep_data
    from nas.search.fidelity import rank_correlation
    from nas.space.arch import Arch

    spec, _ = _load("unified", work)
    data = prepare_sweep_data(spec)
    front = {p["arch_id"]: p for p in _read(out / "unified" / "front.json") or []}
    rows = []
    for f in sorted((out / "unified").glob("retrained_*.json")):
        alone = _read(f)
        rows.append({"arch_id": alone["arch_id"], "arch_summary": alone["arch_summary"], "params_m": alone["params_m"],
                     "source": "front", "inherited": {k: front[alone["arch_id"]][k] for k in ("bleu", "valid_loss")},
                     "standalone": {k: alone[k] for k in ("bleu", "valid_loss")}})
    folder = out / "unified" / "tau"
    inherited_rows = [_read(f) for f in sorted(folder.glob("inherited_*.json"))]
    for inherited in sorted(inherited_rows, key=lambda r: r.get("params_m", 0.0)):
        arch = Arch.from_dict(inherited["arch"])
        target = folder / f"standalone_{arch.arch_id}.json"
        if (not train or (only and arch.arch_id not in only)) and _read(target) is None:
            continue
        alone = _train_alone(arch, spec, data, target, {"space": "unified"})
        rows.append({"arch_id": arch.arch_id, "arch_summary": arch.summary(), "params_m": alone["params_m"],
                     "source": "spread", "inherited": {k: inherited[k] for k in ("bleu", "valid_loss")},
                     "standalone": {k: alone[k] for k in ("bleu", "valid_loss")}})
    corr = {m: rank_correlation([r["inherited"][m] for r in rows], [r["standalone"][m] for r in rows])._asdict()
            for m in ("valid_loss", "bleu")}
    _write(out / "unified" / "tau.json", {**corr, "planned": TAU_ARCHS, "k": len(rows), "steps": spec.train.steps, "archs": rows})


def phase_refront(work: Path, out: Path) -> None:
    """Every trial of each sweep measured again with nothing else running, then the feasible Pareto front taken
    from those latencies (``front.json``; the sweep's own becomes ``front_sweep.json``): the trials timed
    themselves beside other work on the 2 cores, which moved some across the budget. New front members are
    scored on the test set with inherited weights."""
    from nas.builders import prepare_sweep_data
    from nas.eval.latency import measure_latency
    from nas.eval.scores import encode_sources
    from nas.model.io import load_model
    from nas.model.supernet import extract
    from nas.search.trials import feasibility
    from nas.space.arch import Arch
    from nas.tracking.pareto import pareto_mask

    path = out / "latency_quiet.json"
    for space in ("quickstart", "unified"):
        trials = _read(out / space / "trials.json")
        if not trials or (out / space / "front_sweep.json").is_file():
            continue
        spec, _ = _load(space, work)
        if not (spec.run_dir / "supernet" / "supernet.json").is_file():
            print(f"{space}: no supernet under {spec.run_dir}, its trials not timed again", file=sys.stderr,
                  flush=True)
            continue
        se = spec.search
        data = prepare_sweep_data(spec)
        supernet = load_model(spec.run_dir / "supernet", "supernet")
        ids = encode_sources(data.tokenizer(), data.valid_text()[0][: se.latency_sentences],
                             supernet.max_positions // 2)
        quiet = _read(path) or {}
        points = []
        for t in (t for t in trials if t is not None):
            key = f"{space}/trial/{t['arch_id']}"
            arch = Arch.from_json(t["arch"])
            if key not in quiet:
                quiet[key] = measure_latency(extract(supernet, arch).eval(), arch, ids, batch_size=1,
                                             beam_size=se.beam_size, repeats=se.latency_repeats,
                                             threads=max(1, int(se.cpu_per_trial)))
                _write(path, quiet)
                print(f"{key}: {quiet[key]:.1f} ms (in the sweep: {t['latency_ms']:.1f} ms)", file=sys.stderr,
                      flush=True)
            metrics = {**{k: t[k] for k in ("bleu", "chrf", "valid_loss", "params_m")}, "latency_ms": quiet[key]}
            points.append((t, arch, metrics, feasibility(metrics, spec).get("feasible", 1.0) == 1.0))
        feasible = [p for p in points if p[3]]
        mask = pareto_mask([(m["bleu"], m["latency_ms"]) for _, _, m, _ in feasible], [True, False])
        old = {p["arch_id"]: p for p in _read(out / space / "front.json") or []}
        front = []
        for (t, arch, metrics, _), keep in zip(feasible, mask):
            if not keep or t["arch_id"] in {f["arch_id"] for f in front}:
                continue
            row = old.get(t["arch_id"]) or {**_score(supernet, arch, spec, data), "arch_id": t["arch_id"],
                                            "arch_summary": t["arch_summary"], "arch": arch.to_dict(),
                                            "trial": {k: t[k] for k in ("bleu", "chrf", "valid_loss", "latency_ms",
                                                                        "params_m")}}
            quiet[f"{space}/front/{t['arch_id']}"] = metrics["latency_ms"]
            front.append({**row, "latency_ms": metrics["latency_ms"]})
        _write(path, quiet)
        _write(out / space / "front_sweep.json", list(old.values()))
        _write(out / space / "front.json", sorted(front, key=lambda r: r["latency_ms"]))
        print(f"{space}: {len(front)} on the front with quiet latencies (the sweep's had {len(old)})", file=sys.stderr,
              flush=True)


def phase_latency(work: Path, out: Path) -> None:
    """Measure every point's latency again, one at a time, as :func:`nas.search.trials.score_arch` does."""
    from nas.builders import prepare_sweep_data
    from nas.eval.latency import measure_latency
    from nas.eval.scores import encode_sources
    from nas.model.io import load_model
    from nas.model.supernet import extract
    from nas.space.arch import Arch

    path = out / "latency_quiet.json"
    quiet = _read(path) or {}
    for space in ("quickstart", "unified"):
        spec, _ = _load(space, work)
        se = spec.search
        data = prepare_sweep_data(spec)
        ids = None
        supernet = None
        files = [*(sorted((out / "baselines").glob("*.json")) if space == "quickstart" else []),
                 *sorted((out / space).glob("retrained_*.json"))]
        points = [(f"{f.parent.name}/{f.stem}", _read(f), f"{f.parent.name}_{f.stem}") for f in files]
        points += [(f"{space}/front/{p['arch_id']}", p, None) for p in (_read(out / space / "front.json") or [])]
        for key, row, model_name in points:
            if key in quiet or row is None:
                continue
            arch = Arch.from_dict(row["arch"])
            if model_name is None and not (spec.run_dir / "supernet" / "supernet.json").is_file():
                print(f"{key}: no supernet, latency not measured again", file=sys.stderr, flush=True)
                continue
            if model_name is None:
                supernet = supernet or load_model(spec.run_dir / "supernet", "supernet")
                model = extract(supernet, arch).eval()
            elif (MODELS / f"{model_name}.json").is_file():
                model = load_model(MODELS, model_name)
            else:
                print(f"{key}: no saved weights, latency not measured again", file=sys.stderr, flush=True)
                continue
            if ids is None:
                ids = encode_sources(data.tokenizer(), data.valid_text()[0][: se.latency_sentences],
                                     model.max_positions // 2)
            quiet[key] = measure_latency(model, arch, ids, batch_size=1, beam_size=se.beam_size,
                                         repeats=se.latency_repeats, threads=max(1, int(se.cpu_per_trial)))
            print(f"{key}: {quiet[key]:.1f} ms (during its phase: {row['latency_ms']:.1f} ms)", file=sys.stderr,
                  flush=True)
            _write(path, quiet)


# --------------------------------------------------------------------------- report


def hypervolume(points: list[tuple[float, float]], ref_latency: float, ref_bleu: float = 0.0) -> float:
    """Area (BLEU x ms) dominated by ``(bleu, latency_ms)`` points, BLEU maximised and latency minimised, inside
    the reference box ``bleu >= ref_bleu``, ``latency <= ref_latency``; points outside it add nothing."""
    inside = sorted((lat, b) for b, lat in points if lat <= ref_latency and b >= ref_bleu)
    area, best = 0.0, ref_bleu
    for lat, b in inside:  # by latency: each point adds the strip of BLEU it raises, up to the reference latency
        if b > best:
            area += (b - best) * (ref_latency - lat)
            best = b
    return area


def _dominated(p: dict[str, Any], front: list[dict[str, Any]], bleu: str) -> bool:
    """Some front member is at least as good as ``p`` in BLEU and latency (a tie counts)."""
    return any(f[bleu] >= p[bleu] and f["latency_ms"] <= p["latency_ms"] for f in front)


def phase_report(out: Path) -> dict[str, Any]:
    quiet = _read(out / "latency_quiet.json") or {}

    def rows(paths: list[Path]) -> list[dict[str, Any]]:
        """The stored points, ``latency_ms`` replaced by the quiet measurement (``latency_ms_phase``: the first)."""
        found = []
        for path in paths:
            for r in ([] if (stored := _read(path)) is None else stored if isinstance(stored, list) else [stored]):
                key = f"{path.parent.name}/front/{r['arch_id']}" if path.name == "front.json" else \
                    f"{path.parent.name}/{path.stem}"
                found.append({**r, "latency_ms_phase": r["latency_ms"], "latency_ms": quiet.get(key, r["latency_ms"]),
                              "latency_quiet": key in quiet})
        return found

    baselines = rows([out / "baselines" / f"{n}.json" for n in BASELINES])
    sets: dict[str, list[dict[str, Any]]] = {"baselines": baselines}
    compute = {"baselines_seconds": sum(r["train_seconds"] for r in baselines)}
    for space in ("quickstart", "unified"):
        sweep = _read(out / space / "sweep.json") or {}
        compute[f"{space}_sweep_seconds"] = sweep.get("seconds")
        compute[f"{space}_supernet_seconds"] = sweep.get("supernet_seconds")
        front = rows([out / space / "front.json"])
        if not front:
            continue
        sets[f"{space} inherited"] = front
        on_front = {r["arch_id"] for r in front}
        retrained = [r for r in rows(sorted((out / space).glob("retrained_*.json"))) if r["arch_id"] in on_front]
        if retrained:
            sets[f"{space} retrained"] = retrained
        compute[f"{space}_retrain_seconds"] = sum(r["train_seconds"] for r in retrained)
    table = {}
    for name, points in sets.items():
        table[name] = {
            "hypervolume_valid": hypervolume([(r["bleu"], r["latency_ms"]) for r in points], BUDGET_MS),
            "hypervolume_test": hypervolume([(r["test_bleu"], r["latency_ms"]) for r in points], BUDGET_MS),
            "dominates_baselines_valid": sum(_dominated(b, points, "bleu") for b in baselines)
            if name != "baselines" else None,
            "dominates_baselines_test": sum(_dominated(b, points, "test_bleu") for b in baselines)
            if name != "baselines" else None,
            "points": [{k: r.get(k) for k in ("name", "arch_summary", "params_m", "latency_ms", "latency_ms_phase",
                                              "latency_quiet", "bleu", "chrf", "valid_loss", "test_bleu", "test_chrf")}
                       for r in points],
        }
    tau = _read(out / "unified" / "tau.json")
    results = {"reference_point": {"bleu": 0.0, "latency_ms": BUDGET_MS}, "baselines": len(baselines),
               "fronts": table, "compute_seconds": compute, "tau_unified": tau,
               "trials": {space: _trial_summary(out, space, quiet) for space in ("quickstart", "unified")
                          if _read(out / space / "trials.json")}}
    _write(out / "results.json", results)
    (out / "results.md").write_text(_markdown(results))
    (out / "pareto.png").write_bytes(_plot(sets))
    print(_markdown(results))
    return results


def _trial_summary(out: Path, space: str, quiet: dict[str, float]) -> dict[str, Any]:
    """Every search trial of a space, feasible or not: counts and ranges (quiet latencies where measured)."""
    trials = [t for t in _read(out / space / "trials.json") or [] if t is not None]
    lat = [quiet.get(f"{space}/trial/{t['arch_id']}", t["latency_ms"]) for t in trials]

    def span(values: list[float]) -> list[float]:
        return [min(values), max(values)] if values else []

    return {"trials": len(trials), "within_budget": sum(v <= BUDGET_MS for v in lat),
            "latency_quiet": all(f"{space}/trial/{t['arch_id']}" in quiet for t in trials),
            "latency_ms": span(lat), "bleu": span([t["bleu"] for t in trials]),
            "valid_loss": span([t["valid_loss"] for t in trials]), "params_m": span([t["params_m"] for t in trials])}


def _markdown(results: dict[str, Any]) -> str:
    lines = ["| set | point | params (M) | latency (ms) | valid BLEU | valid loss | test BLEU | test chrF |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, entry in results["fronts"].items():
        for p in entry["points"]:
            label = p.get("name") or p["arch_summary"]
            star = "" if p.get("latency_quiet") else "*"
            lines.append(f"| {name} | `{label}` | {p['params_m']:.2f} | {p['latency_ms']:.1f}{star} | {p['bleu']:.2f} | "
                         f"{p['valid_loss']:.3f} | {p['test_bleu']:.2f} | {p['test_chrf']:.2f} |")
    if any(not p.get("latency_quiet") for e in results["fronts"].values() for p in e["points"]):
        lines += ["", "\\* latency measured while other work ran on the 2 cores (the others: one at a time, nothing "
                  "else running)."]
    for space, t in (results.get("trials") or {}).items():
        if t["trials"]:
            lines += ["", f"{space}: {t['trials']} search trials, {t['within_budget']} within {BUDGET_MS:.0f} ms "
                      f"({'quiet' if t['latency_quiet'] else 'sweep-time'} latencies {t['latency_ms'][0]:.1f}-"
                      f"{t['latency_ms'][1]:.1f} ms); validation BLEU {t['bleu'][0]:.2f}-{t['bleu'][1]:.2f}, loss "
                      f"{t['valid_loss'][0]:.3f}-{t['valid_loss'][1]:.3f}; {t['params_m'][0]:.2f}-"
                      f"{t['params_m'][1]:.2f} M parameters"]
    lines += ["", f"Hypervolume (BLEU x ms) from the reference point (BLEU 0, {BUDGET_MS:.0f} ms); baselines "
              f"dominated (of {results['baselines']}):", "",
              "| set | hypervolume, valid BLEU | hypervolume, test BLEU | dominates (valid) | dominates (test) |",
              "| --- | --- | --- | --- | --- |"]
    for name, e in results["fronts"].items():
        dom = lambda v: "-" if v is None else str(v)
        lines.append(f"| {name} | {e['hypervolume_valid']:.1f} | {e['hypervolume_test']:.1f} | "
                     f"{dom(e['dominates_baselines_valid'])} | {dom(e['dominates_baselines_test'])} |")
    c = results["compute_seconds"]
    lines += ["", "Compute (wall seconds): " + ", ".join(f"{k} {v:.0f}" for k, v in c.items() if v is not None)]
    tau = results.get("tau_unified")
    if tau:
        lines += ["", f"Unified space, {tau['k']} sub-Transformers, inherited vs standalone ({tau['steps']} steps): "
                  f"validation loss Kendall tau {tau['valid_loss']['kendall_tau']:.2f}, Spearman rho "
                  f"{tau['valid_loss']['spearman_rho']:.2f}; BLEU tau {tau['bleu']['kendall_tau']:.2f}, rho "
                  f"{tau['bleu']['spearman_rho']:.2f}"]
    return "\n".join(lines) + "\n"


def _plot(sets: dict[str, list[dict[str, Any]]]) -> bytes:
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.2, 4.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    styles = {"baselines": ("k", "s", ""), "quickstart inherited": ("tab:blue", "o", "--"),
              "quickstart retrained": ("tab:blue", "^", "-"), "unified inherited": ("tab:orange", "o", "--"),
              "unified retrained": ("tab:orange", "^", "-")}
    for name, rows in sets.items():
        color, marker, line = styles.get(name, ("tab:gray", "x", ""))
        pts = sorted((r["latency_ms"], r["bleu"]) for r in rows)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, linestyle=line or "none", color=color,
                label=name)
    ax.axvline(BUDGET_MS, color="gray", linewidth=0.8, linestyle=":")
    ax.set_xlabel("latency (ms per sentence, batch 1, beam 4, 1 thread)")
    ax.set_ylabel("validation BLEU (Multi30k En-De)")
    ax.set_title("Searched fronts against hand-designed Transformers (same training budget)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phase", nargs="*", choices=PHASES, default=list(PHASES))
    ap.add_argument("--out", default=str(ROOT / "experiments" / "search_value"), help="result JSON files")
    ap.add_argument("--work", default=str(ROOT / "experiments" / "out" / "search_value"),
                    help="supernets, sweeps and MLflow store (not committed)")
    ap.add_argument("--steps", type=int, default=None, help="smoke run: this many steps, 2 trials, 40 sentences")
    ap.add_argument("--spaces", nargs="*", choices=("quickstart", "unified"), default=["quickstart", "unified"],
                    help="the spaces the retrain phase trains fronts of, in this order")
    ap.add_argument("--only", nargs="*", default=[], metavar="ARCH_ID",
                    help="tau: train only these archs (the others count if already trained)")
    ap.add_argument("--no-train", action="store_true", help="tau: correlate only the archs already trained alone")
    args = ap.parse_args()
    out, work = Path(args.out), Path(args.work)
    global STEPS, MODELS
    STEPS, MODELS = args.steps, work / "models"
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{(work / 'mlflow.db').resolve()}")
    for phase in args.phase:
        t0 = time.perf_counter()
        if phase == "baselines":
            phase_baselines(work, out)
        elif phase in ("quickstart", "unified"):
            phase_sweep(phase, work, out)
        elif phase == "retrain":
            for space in args.spaces:
                phase_retrain(space, work, out)
        elif phase == "tau":
            phase_tau(work, out, train=not args.no_train, only=tuple(args.only))
        elif phase == "latency":
            phase_latency(work, out)
        elif phase == "refront":
            phase_refront(work, out)
        else:
            phase_report(out)
        print(f"phase {phase}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
