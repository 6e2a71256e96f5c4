"""Proof of value: HAT's whole pipeline against hand-designed Transformers at equal latency (Multi30k En->De).

The second protocol of ``experiments/search_value.py``, in a file of its own: that one gives every model the
same short budget and compares inherited fronts; this one follows HAT (Wang et al. 2020, sec. 4) to the end.
Train the supernet of ``search_spaces/quickstart_depth.yaml``, search it (``nas sweep``), then **retrain the
found sub-Transformers from scratch** with the recipe the hand-designed baselines get (the YAML's ``retrain:``
section, Transformer-Tiny's: Wu et al. ACL 2021) and compare at equal latency on ``test_2016_flickr``.

Run (resumable; every result is its own JSON file under ``--out``, a killed run goes on with the next missing one;
weights, the supernet, the sweep and the MLflow store ``<work>/mlflow.db`` live under ``--work``, not committed)::

    python experiments/proof_of_value.py                        # every phase in order, then the report
    python experiments/proof_of_value.py --phase baselines      # one phase (several: --phase latency retrain)
    python experiments/proof_of_value.py --smoke                # the whole pipeline, tiny, under <work>/smoke

Phases (the default runs them in this order, ``latency`` twice: before ``retrain`` for the budgets, after it for
the searched models):

- ``supernet``: ``nas train`` of the YAML (:func:`nas.api.train`) -> ``supernet.json`` (wall and training
  seconds, steps, estimated training FLOPs).
- ``search``: ``nas sweep`` (:func:`nas.api.sweep`; it reuses the trained supernet) -> ``search.json`` (every
  trial: arch, inherited validation BLEU/chrF, ``latency_ms`` as the sweep timed it; wall seconds).
- ``baselines``: Tiny-S (2+2 layers, width 128, FFN 256), Transformer-Tiny (4+4, 128, 256) and Tiny-L (6+6, 128,
  512), one branch, each through :func:`nas.retraining.retrain` (``--arch``): Tiny with seeds 0 and 1, the others
  seed 0 -> ``baselines/<name>_seed<s>.json`` (validation scores, test_2016_flickr BLEU/chrF added).
- ``latency``: every final model's ``latency_ms`` timed again one at a time on the YAML's fixed workload, one
  thread, nothing else running (each arch in 3 interleaved rounds, the median kept), and its ratio to
  Transformer-Tiny's -> ``latency_quiet.json``.
- ``retrain``: for each baseline's quiet ``latency_ms`` (and half of Tiny's) the best trial by BLEU with
  ``latency_ms`` within it (``nas retrain --best --where 'latency_ms<=X'``), retrained from scratch (seed 0; seeds 0
  and 1 at Tiny's latency) and, at Tiny's latency, also from its inherited weights (``retrain.init: inherited``)
  -> ``searched/<budget>_<init>_seed<s>.json`` (test scores, and the arch's inherited test scores).
- ``report``: reads only the JSON files; writes ``results.json``, ``results.md`` and ``pareto.png``.

The report checks the issue's three goals on test_2016_flickr BLEU with quiet latencies: (1) at Tiny's latency or
less, min over the searched model's seeds minus max over Tiny's seeds >= 1.0 BLEU; (2) at half Tiny's latency or
less, a searched model within 0.3 BLEU of Tiny (mean of its seeds); (3) every baseline (seed mean) dominated in
BLEU and latency by a searched model retrained from scratch (seed mean; a tie counts).

Compute: training seconds as the trainers report them (``train_seconds``) plus the sweep's wall seconds, and
analytic training FLOPs (:func:`training_flops`); supernet + search + retraining against the sum of the
baselines, in total and per final model. The search's FLOPs (inference only) are not counted, its seconds are.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.search_value import _lines, _read, _write, hypervolume  # noqa: E402 (the first protocol's readers and front measure)

PHASES = ("supernet", "search", "baselines", "latency", "retrain", "report", "gpu_plan", "gpu_report")
DEFAULT_ORDER = ("supernet", "search", "baselines", "latency", "retrain", "latency", "report")
YAML = ROOT / "search_spaces" / "quickstart_depth.yaml"
DATA = ROOT.parent / "shared" / "data" / "multi30k"
TEST = ("test_2016_flickr.en.gz", "test_2016_flickr.de.gz")

BASELINES: dict[str, tuple[str, int, int, int, tuple[int, ...]]] = {
    # key: (label, layers per stack, width (channels), FFN width (channels), seeds); one branch
    "tiny_s": ("Tiny-S", 2, 128, 256, (0,)),
    "tiny": ("Transformer-Tiny", 4, 128, 256, (0, 1)),
    "tiny_l": ("Tiny-L", 6, 128, 512, (0,)),
}
REFERENCE = "tiny"
"""The baseline ``latency_ratio`` divides by, and the one the goals compare with."""
BUDGETS: dict[str, tuple[tuple[str, int], ...]] = {
    # budget: the (init, seed) retrains of its best trial; "half_tiny" is half of Tiny's quiet latency
    "tiny": (("scratch", 0), ("scratch", 1), ("inherited", 0)),
    "half_tiny": (("scratch", 0),),
    "tiny_s": (("scratch", 0),),
    "tiny_l": (("scratch", 0),),
}
GOAL_GAP_BLEU = 1.0
"""Goal 1: searched (min over seeds) minus Tiny (max over seeds), test BLEU, at Tiny's latency or less."""
GOAL_HALF_WITHIN_BLEU = 0.3
"""Goal 2: a searched model at half Tiny's latency or less within this many BLEU of Tiny (seed mean)."""
HV_MARGIN = 1.1
"""Hypervolume reference latency: this times the slowest baseline's (so every baseline adds area), at BLEU 0."""
LATENCY_ROUNDS = 3
"""Interleaved rounds of the ``latency`` phase; each arch keeps its median round (robust to a burst of other work)."""
SMOKE_SET = (
    "train.steps=4", "train.warmup_steps=2", "train.checkpoint_every=2", "train.threads=1",
    "retrain.steps=4", "retrain.warmup_steps=2", "retrain.checkpoint_every=2", "retrain.average_last=2",
    "resources.cpu=1", "search.max_concurrent=1", "search.trials=2", "search.latency_repeats=3",
    "search.points_to_evaluate=[narrowest]",
    "search.evolution={population: 4, generations: 1, subset_sentences: 8, predictor_samples: 4, batch_size: 4}",
    "data.max_train_pairs=300", "data.max_valid_pairs=20", "data.tokenizer.vocab_size=400",
)
"""``--smoke``: the whole pipeline in a couple of minutes (results meaningless; under ``<work>/smoke``)."""
SMOKE_TEST_PAIRS = 40


# --------------------------------------------------------------------------- files


def _rel(path: Path) -> str:
    """``path`` relative to the repository when inside it (so the committed JSON names no machine's folders)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path.resolve())


def _abs(path: str) -> Path:
    return Path(path) if Path(path).is_absolute() else ROOT / path


# --------------------------------------------------------------------------- the spec


def _spec_yaml(work: Path, smoke: bool) -> Path:
    """``<work>/sweep.yaml``: the YAML with its data named absolutely, the data cache, run folder and nothing else
    moved under ``work`` (and ``--smoke``'s settings applied): what every phase loads."""
    import yaml

    from nas.space.loader import apply_overrides

    raw = yaml.safe_load(YAML.read_text(encoding="utf-8"))
    for split in ("train", "valid"):  # the YAML names data relative to the repository root
        raw["data"][split] = {k: str((ROOT / v).resolve()) for k, v in raw["data"][split].items()}
    raw["data"]["cache_dir"] = str((work / "data").resolve())
    raw["workdir"] = str((work / "runs").resolve())
    if smoke:
        raw = apply_overrides(raw, SMOKE_SET, str(YAML))
    path = work / "sweep.yaml"
    text = f"# nas sweep {_rel(path)}\n# written by experiments/proof_of_value.py from {_rel(YAML)}\n" \
           + yaml.safe_dump(raw, sort_keys=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")
    return path


@functools.lru_cache(maxsize=1)
def _context(work: Path, smoke: bool):
    """(spec, YAML path, prepared data) of this run, loaded once."""
    from nas.builders import prepare_sweep_data
    from nas.space import load_spec

    path = _spec_yaml(work, smoke)
    spec = load_spec(path)
    return spec, path, prepare_sweep_data(spec, progress=False)


def _with_recipe(spec, **update):
    """``spec`` with ``retrain.<key>`` set (``seed``, ``init``): the one recipe, one key changed."""
    return spec.model_copy(update={"retrain": spec.retrain.model_copy(update=update)})


# --------------------------------------------------------------------------- FLOPs


@functools.lru_cache(maxsize=1)
def _lengths(data) -> dict[str, float]:
    """Mean source and target positions of a training pair (EOS, resp. BOS, counted) and of a padded row
    (``max`` of the two: batches are cut so that ``rows * padded_len <= max_tokens``, over length buckets)."""
    import numpy as np

    corpus = data.corpus("train")
    src = corpus.src_lengths.astype(np.float64) + 1  # [n]
    tgt = corpus.tgt_lengths.astype(np.float64) + 1  # [n]
    return {"src_len": float(src.mean()), "tgt_len": float(tgt.mean()),
            "padded_len": float(np.maximum(src, tgt).mean())}


def step_flops(archs: Iterable[Any], *, model_dim: int, vocab_size: int, max_tokens: int, accumulate: int,
               lengths: dict[str, float]) -> float:
    """Training FLOPs of one optimizer step that runs each of ``archs`` forward and backward on every batch.

    Per arch: 3x :func:`benchmarks.bench_gpu.forward_flops` (backward = 2x forward: Kaplan et al. 2020, sec. 2.1;
    PaLM appendix B) of ``max_tokens / padded_len`` rows of the mean source and target lengths, times
    ``accumulate`` batches. An estimate: padding and the last partial batch are not modelled; dropout,
    drop-branch and label smoothing change no FLOPs that are counted.
    """
    from benchmarks.bench_gpu import forward_flops

    rows = max_tokens / lengths["padded_len"]
    src, tgt = max(1, round(lengths["src_len"])), max(1, round(lengths["tgt_len"]))
    per_row = sum(forward_flops(a, model_dim=model_dim, vocab_size=vocab_size, batch=1, src_len=src, tgt_len=tgt)
                  for a in archs)
    return 3.0 * per_row * rows * accumulate


def _supernet_step_flops(spec, data) -> tuple[float, dict[str, float]]:
    """FLOPs of one sandwich step (Yu & Huang 2019): the widest, the narrowest and ``train.sandwich_k`` random
    sub-Transformers, the random ones as the mean of 256 seeded draws of the space."""
    import random

    from nas.builders import build_space

    space = build_space(spec)
    kw = dict(model_dim=spec.supernet.model_dim, vocab_size=data.vocab_size, max_tokens=spec.train.max_tokens,
              accumulate=spec.train.accumulate, lengths=_lengths(data))
    rng = random.Random(0)
    drawn = statistics.fmean(step_flops([space.sample(rng)], **kw) for _ in range(256))
    ends = {"widest": step_flops([space.widest()], **kw), "narrowest": step_flops([space.narrowest()], **kw),
            "random_mean": drawn}
    return ends["widest"] + ends["narrowest"] + spec.train.sandwich_k * drawn, ends


def _retrain_flops(spec, data, arch, steps: int) -> float:
    r = spec.retrain.resolved(spec)
    return steps * step_flops([arch], model_dim=spec.supernet.model_dim, vocab_size=data.vocab_size,
                              max_tokens=r["max_tokens"], accumulate=r["accumulate"], lengths=_lengths(data))


# --------------------------------------------------------------------------- scoring


@functools.lru_cache(maxsize=1)
def _test_set(data, smoke: bool):
    """test_2016_flickr (its first :data:`SMOKE_TEST_PAIRS` pairs with ``--smoke``) as a text-only set."""
    from nas.eval.validation import ValidationSet

    src, ref = (_lines(DATA / name)[:SMOKE_TEST_PAIRS if smoke else None] for name in TEST)
    return ValidationSet.from_text(src, ref, data.tokenizer())


def _test_scores(model, arch, spec, data, smoke: bool) -> dict[str, float]:
    """sacrebleu BLEU and chrF on test_2016_flickr (raw references, beam ``search.beam_size``)."""
    from nas.eval.validation import validation_scores

    s = validation_scores(model, arch, _test_set(data, smoke), beam_size=spec.search.beam_size, loss=False)
    return {"test_bleu": float(s["bleu"]), "test_chrf": float(s["chrf"])}


def _retrain_row(spec, data, result, smoke: bool, seconds: float, extra: dict[str, Any]) -> dict[str, Any]:
    """One final model: the retrain's metrics, test scores, FLOPs, and where its weights are."""
    from nas.model.io import load_model

    model = load_model(result.out_dir, "model")
    m = result.metrics
    return {**extra, **m, **_test_scores(model, None, spec, data, smoke),
            "arch": result.arch.to_dict(), "arch_id": result.arch.arch_id, "arch_summary": result.arch.summary(),
            "run_id": result.run_id, "source_run_id": result.source_run_id, "recipe": result.recipe,
            "out_dir": _rel(result.out_dir), "wall_seconds": seconds,
            "train_flops": _retrain_flops(spec, data, result.arch, int(m.get("steps", result.recipe["steps"])))}


# --------------------------------------------------------------------------- phases


def phase_supernet(work: Path, out: Path, smoke: bool) -> None:
    import nas

    path = out / "supernet.json"
    if _read(path) is not None:
        return
    spec, _, data = _context(work, smoke)
    t0 = time.perf_counter()
    result = nas.train(spec, progress=False)
    seconds = time.perf_counter() - t0
    per_step, ends = _supernet_step_flops(spec, data)
    _write(path, {"yaml": _rel(YAML), "smoke": smoke, "steps": result.steps, "wall_seconds": seconds,
                  "train_seconds": float(result.metrics.get("train_seconds", seconds)),
                  "train_flops": per_step * result.steps, "step_flops": ends, "lengths": _lengths(data),
                  "metrics": result.metrics})
    print(f"supernet: {result.steps} steps, {seconds:.0f} s", file=sys.stderr, flush=True)


def phase_search(work: Path, out: Path, smoke: bool) -> None:
    import nas
    from nas.search.runner import read_sweep_record, results_dir
    from nas.space.arch import Arch

    path = out / "search.json"
    if _read(path) is not None:
        return
    spec, yaml_path, _ = _context(work, smoke)
    t0 = time.perf_counter()
    result = nas.sweep(yaml_path, resume=read_sweep_record(spec.run_dir.resolve()) is not None)
    seconds = time.perf_counter() - t0
    trials = []
    for f in sorted(results_dir(spec, result.sweep_id).glob("*.json")):
        t = _read(f)
        if t is None:
            continue
        arch = Arch.from_json(t["arch"])
        trials.append({"number": int(f.stem), "arch": arch.to_dict(), "arch_id": arch.arch_id,
                       "arch_summary": arch.summary(),
                       **{k: t.get(k) for k in ("bleu", "chrf", "valid_loss", "latency_ms", "params_m")}})
    _write(path, {"sweep_id": result.sweep_id, "wall_seconds": seconds, "trials_completed": result.trials_completed,
                  "trials_failed": result.trials_failed, "method": spec.search.method, "trials": trials})
    print(f"search: {len(trials)} trials, {seconds:.0f} s", file=sys.stderr, flush=True)


def baseline_arch(key: str):
    """The hand-designed Transformer ``key`` of :data:`BASELINES` (uniform layers, one branch)."""
    from nas.space.arch import Arch, StackArch

    _, layers, width, ffn, _ = BASELINES[key]
    stack = StackArch(width=(width,) * layers, ffn_width=(ffn,) * layers, branches=(1,) * layers)
    return Arch(encoder=stack, decoder=stack)


def phase_baselines(work: Path, out: Path, smoke: bool) -> None:
    from nas.retraining import retrain

    spec, _, data = _context(work, smoke)
    for key, (label, *_, seeds) in BASELINES.items():
        for seed in seeds:
            path = out / "baselines" / f"{key}_seed{seed}.json"
            if _read(path) is not None:
                continue
            arch = baseline_arch(key)
            print(f"baseline {label} seed {seed}: {arch.summary()}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            result = retrain(_with_recipe(spec, seed=seed), arch=arch, progress=False,
                             out_dir=work / "models" / "baselines" / f"{key}_seed{seed}")
            row = _retrain_row(spec, data, result, smoke, time.perf_counter() - t0,
                               {"name": key, "label": label, "seed": seed, "init": "scratch"})
            _write(path, row)
            print(f"  test BLEU {row['test_bleu']:.2f}, {row['latency_ms']:.1f} ms", file=sys.stderr, flush=True)


def _final_models(out: Path) -> list[tuple[str, dict[str, Any]]]:
    """(key, row) of every final model's JSON file: ``baselines/<name>_seed<s>``, ``searched/<budget>_...``."""
    found = []
    for folder in ("baselines", "searched"):
        for f in sorted((out / folder).glob("*.json")):
            row = _read(f)
            if row is not None and row.get("found", True):
                found.append((f"{folder}/{f.stem}", row))
    return found


def phase_latency(work: Path, out: Path, smoke: bool) -> None:
    """Time every final model's arch, one at a time (the node's measurement lock held), one thread, in
    :data:`LATENCY_ROUNDS` interleaved rounds, and keep each arch's median round: ``latency_ms`` is a function of
    the arch and the device, never of the weights (:func:`nas.eval.latency.measure_fixed_latency`), so the seeds
    of a model, and a folder serving two budgets, share one value. Whenever a model of a new arch appears, every
    arch is timed again, so that the final file was measured in one session."""
    from nas.model.io import load_model
    from nas.space.predictor_file import workload_of

    spec, _, _ = _context(work, smoke)
    workload, repeats = workload_of(spec.search), spec.search.latency_repeats
    path = out / "latency_quiet.json"
    models = _final_models(out)
    folders = {row["arch_id"]: row["out_dir"] for _, row in models}  # arch -> one folder of it
    stored = _read(path) or {}
    if set(stored.get("by_arch", {})) == set(folders) and stored.get("repeats") == repeats:
        return
    loaded = {a: load_model(_abs(folder), "model").eval() for a, folder in sorted(folders.items())}
    rounds = _timed_rounds(loaded, workload, repeats, "latency")
    by_arch = {a: {"latency_ms": statistics.median(v), "rounds_ms": v} for a, v in rounds.items()}
    quiet = {key: by_arch[row["arch_id"]]["latency_ms"] for key, row in models}
    for key, row in models:
        print(f"{key}: {quiet[key]:.1f} ms quiet ({row['latency_ms']:.1f} ms when retrained)", file=sys.stderr,
              flush=True)
    ref = reference_ms(quiet)
    _write(path, {"latency_ms": quiet, "by_arch": by_arch, "reference": REFERENCE, "reference_ms": ref,
                  "latency_ratio": {k: v / ref for k, v in quiet.items()} if ref else {}, "threads": 1,
                  "workload": workload, "repeats": repeats, "rounds": LATENCY_ROUNDS})


def _timed_rounds(models: dict[str, Any], workload: dict[str, int], repeats: int, what: str) -> dict[str, list[float]]:
    """Each model's fixed-workload ``latency_ms`` (one thread, the node's measurement lock held) in
    :data:`LATENCY_ROUNDS` interleaved rounds: arch id -> one value per round."""
    from nas.eval.latency import measure_fixed_latency
    from nas.eval.measure_lock import MeasureLock

    lock = MeasureLock()
    rounds: dict[str, list[float]] = {a: [] for a in models}
    for i in range(LATENCY_ROUNDS):
        for arch_id, model in models.items():
            rounds[arch_id].append(measure_fixed_latency(
                model, None, src_tokens=workload["src_tokens"], tgt_tokens=workload["tgt_tokens"],
                beam_size=workload["beam"], batch_size=workload["batch"], repeats=repeats, threads=1, lock=lock))
        print(f"{what} round {i + 1}/{LATENCY_ROUNDS}: {len(models)} archs", file=sys.stderr, flush=True)
    return rounds


def reference_ms(quiet: dict[str, float], name: str = REFERENCE) -> float | None:
    """Mean quiet ``latency_ms`` over the seeds of baseline ``name`` (None: not timed)."""
    values = [v for k, v in quiet.items() if k.startswith(f"baselines/{name}_seed")]
    return statistics.fmean(values) if values else None


def budgets_ms(quiet: dict[str, float]) -> dict[str, float]:
    """Each budget of :data:`BUDGETS` in ms: a baseline's quiet latency (seed mean), ``half_tiny`` half of Tiny's."""
    found = {k: reference_ms(quiet, k) for k in BASELINES}
    if found.get(REFERENCE) is not None:
        found["half_tiny"] = found[REFERENCE] / 2
    return {b: found[b] for b in BUDGETS if found.get(b) is not None}


def phase_retrain(work: Path, out: Path, smoke: bool) -> None:
    """The best trial under each budget, retrained (see the module docstring)."""
    from nas import tracking
    from nas.errors import NasError
    from nas.retraining import retrain

    if _read(out / "search.json") is None:
        print("retrain: no search.json (run --phase search first); skipped", file=sys.stderr, flush=True)
        return
    quiet = (_read(out / "latency_quiet.json") or {}).get("latency_ms", {})
    budgets = budgets_ms(quiet)
    if not budgets:
        print("retrain: no quiet baseline latencies (run --phase baselines latency first); skipped",
              file=sys.stderr, flush=True)
        return
    spec, _, data = _context(work, smoke)
    inherited: dict[str, dict[str, float]] = {}
    for budget, runs in BUDGETS.items():
        if budget not in budgets:
            continue
        ms = budgets[budget]
        try:
            best = tracking.best_trial(spec.experiment, metric="bleu", where=[f"latency_ms<={ms!r}"])
        except NasError as e:  # NotFoundError: no trial this fast
            for init, seed in runs:
                _write(out / "searched" / f"{budget}_{init}_seed{seed}.json",
                       {"budget": budget, "budget_ms": ms, "init": init, "seed": seed, "found": False,
                        "reason": str(e)})
            print(f"retrain {budget} (<= {ms:.1f} ms): {e}", file=sys.stderr, flush=True)
            continue
        trial = {"run_id": best.run_id, "arch_summary": best.arch, "arch_id": best.arch_id,
                 **{k: getattr(best, k) for k in ("bleu", "chrf", "valid_loss", "latency_ms", "params_m")}}
        for init, seed in runs:
            path = out / "searched" / f"{budget}_{init}_seed{seed}.json"
            if _read(path) is not None:
                continue
            print(f"retrain {budget} (<= {ms:.1f} ms) {init} seed {seed}: {best.arch}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            result = retrain(_with_recipe(spec, seed=seed, init=init), best=True, where=[f"latency_ms<={ms!r}"],
                             progress=False, out_dir=work / "models" / "searched" / f"{best.arch_id}-{init}-seed{seed}")
            seconds = time.perf_counter() - t0
            if result.source_run_id != best.run_id:  # the same query twice: the same trial
                raise RuntimeError(f"retrain --best chose trial {result.source_run_id}, not {best.run_id}")
            if result.arch.arch_id not in inherited:
                inherited[result.arch.arch_id] = _inherited_test(spec, data, result.arch, smoke)
            row = _retrain_row(spec, data, result, smoke, seconds,
                               {"budget": budget, "budget_ms": ms, "init": init, "seed": seed, "found": True,
                                "trial": trial, **inherited[result.arch.arch_id]})
            _write(path, row)
            print(f"  test BLEU {row['test_bleu']:.2f} (inherited {row['inherited_test_bleu']:.2f})",
                  file=sys.stderr, flush=True)


def _inherited_test(spec, data, arch, smoke: bool) -> dict[str, float]:
    """Test scores of ``arch`` with the supernet's weights (no retraining): the search's own view of it."""
    from nas.model.io import load_model

    supernet = load_model(spec.run_dir / "supernet", "supernet")
    s = _test_scores(supernet, arch, spec, data, smoke)
    return {"inherited_test_bleu": s["test_bleu"], "inherited_test_chrf": s["test_chrf"]}


# --------------------------------------------------------------------------- report (pure: JSON in, text out)


def dominates(a: dict[str, Any], b: dict[str, Any], bleu: str = "test_bleu") -> bool:
    """``a`` is at least as good as ``b`` in BLEU and in ``latency_ms`` (a tie counts)."""
    return a[bleu] >= b[bleu] and a["latency_ms"] <= b["latency_ms"]


def load_rows(out: Path) -> list[dict[str, Any]]:
    """Every final model, ``latency_ms`` replaced by its quiet measurement where there is one (``latency_quiet``
    says which; ``latency_ms_retrain`` keeps the retrain's own), with ``kind``: ``baseline``, ``searched`` (from
    scratch) or ``searched_inherited`` (retrained from the supernet's weights)."""
    quiet = (_read(out / "latency_quiet.json") or {}).get("latency_ms", {})
    rows = []
    for key, row in _final_models(out):
        kind = "baseline" if key.startswith("baselines/") else \
            "searched" if row.get("init") == "scratch" else "searched_inherited"
        rows.append({**row, "key": key, "kind": kind, "latency_ms_retrain": row["latency_ms"],
                     "latency_ms": quiet.get(key, row["latency_ms"]), "latency_quiet": key in quiet})
    return sorted(rows, key=_order)


def _order(row: dict[str, Any]) -> tuple:
    """Baselines in :data:`BASELINES` order, then the searched models in :data:`BUDGETS` order; by init, seed."""
    if row["kind"] == "baseline":
        return 0, list(BASELINES).index(row["name"]) if row["name"] in BASELINES else len(BASELINES), "", row["seed"]
    budget = row.get("budget")
    return 1, list(BUDGETS).index(budget) if budget in BUDGETS else len(BUDGETS), row["init"] != "scratch", row["seed"]


def _mean_by(rows: list[dict[str, Any]], field: str) -> list[dict[str, Any]]:
    """One point per value of ``field`` (a model over its seeds): mean test/valid BLEU and latency, the seeds."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r[field], []).append(r)
    return [{"model": name, "label": g[0].get("label") or g[0]["arch_summary"], "arch_summary": g[0]["arch_summary"],
             "seeds": sorted({r["seed"] for r in g}), "test_bleu": statistics.fmean(r["test_bleu"] for r in g),
             "bleu": statistics.fmean(r["bleu"] for r in g), "latency_ms": statistics.fmean(r["latency_ms"] for r in g)}
            for name, g in groups.items()]


def check_goals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's three goals on test BLEU and quiet latency (see the module docstring); each has ``met``
    (None: the models it needs are missing) and the numbers it was decided on."""
    tiny = [r for r in rows if r["kind"] == "baseline" and r["name"] == REFERENCE]
    tiny_ms = statistics.fmean(r["latency_ms"] for r in tiny) if tiny else None
    searched = [r for r in rows if r["kind"] == "searched"]
    goals: dict[str, Any] = {"tiny_latency_ms": tiny_ms}
    # (1) at Tiny's latency or less: min(searched seeds) - max(Tiny seeds) >= 1.0
    at_tiny = [r for r in searched if r.get("budget") == REFERENCE]
    want = set(BASELINES[REFERENCE][4])
    g1: dict[str, Any] = {"threshold_bleu": GOAL_GAP_BLEU, "searched_seeds": sorted(r["seed"] for r in at_tiny),
                          "tiny_seeds": sorted(r["seed"] for r in tiny)}
    if tiny and at_tiny:
        g1.update(searched_min_bleu=min(r["test_bleu"] for r in at_tiny),
                  tiny_max_bleu=max(r["test_bleu"] for r in tiny),
                  searched_max_latency_ms=max(r["latency_ms"] for r in at_tiny))
        g1["gap_bleu"] = g1["searched_min_bleu"] - g1["tiny_max_bleu"]
        g1["within_latency"] = g1["searched_max_latency_ms"] <= tiny_ms
        complete = set(g1["searched_seeds"]) >= want and set(g1["tiny_seeds"]) >= want
        g1["met"] = (g1["gap_bleu"] >= GOAL_GAP_BLEU and g1["within_latency"]) if complete else None
    else:
        g1["met"] = None
    goals["1_gap_at_tiny_latency"] = g1
    # (2) at half Tiny's latency or less: a searched model (seed mean) within 0.3 BLEU of Tiny (seed mean)
    g2: dict[str, Any] = {"threshold_bleu": GOAL_HALF_WITHIN_BLEU, "met": None}
    if tiny:
        half = tiny_ms / 2
        tiny_bleu = statistics.fmean(r["test_bleu"] for r in tiny)
        fast = [m for m in _mean_by(searched, "arch_id") if m["latency_ms"] <= half]
        g2.update(half_latency_ms=half, tiny_mean_bleu=tiny_bleu, candidates=len(fast))
        if fast:
            best = max(fast, key=lambda m: (m["test_bleu"], -m["latency_ms"]))
            g2.update(best=best["arch_summary"], best_bleu=best["test_bleu"], best_latency_ms=best["latency_ms"],
                      shortfall_bleu=tiny_bleu - best["test_bleu"])
            g2["met"] = g2["shortfall_bleu"] <= GOAL_HALF_WITHIN_BLEU
        elif searched:
            g2["met"] = False
    goals["2_half_latency_within"] = g2
    # (3) every baseline (seed mean) dominated by a searched model (seed mean)
    points = _mean_by(searched, "arch_id")
    per = {}
    for b in _mean_by([r for r in rows if r["kind"] == "baseline"], "name"):
        by = [m["arch_summary"] for m in points if dominates(m, b)]
        per[b["model"]] = {"label": b["label"], "test_bleu": b["test_bleu"], "latency_ms": b["latency_ms"],
                           "dominated_by": by}
    goals["3_baselines_dominated"] = {"baselines": per, "dominated": sum(bool(v["dominated_by"]) for v in per.values()),
                                      "met": all(v["dominated_by"] for v in per.values()) if per and points else None}
    return goals


def compute_accounting(out: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds and training FLOPs: the HAT pipeline (supernet + search + every distinct retraining of a searched
    model) against the baselines' training, in total and per final model. A folder serving two budgets counts once;
    the search counts seconds only (its FLOPs, inference, are not estimated)."""
    supernet = _read(out / "supernet.json") or {}
    search = _read(out / "search.json") or {}

    def distinct(kinds: tuple[str, ...]) -> list[dict[str, Any]]:
        seen: dict[str, dict[str, Any]] = {}
        for r in rows:
            if r["kind"] in kinds:
                seen.setdefault(r["out_dir"], r)
        return [seen[k] for k in sorted(seen)]

    retrains, baselines = distinct(("searched", "searched_inherited")), distinct(("baseline",))
    one_off_s = supernet.get("train_seconds", 0.0) + search.get("wall_seconds", 0.0)
    one_off_flops = supernet.get("train_flops", 0.0)
    hat = {"supernet_seconds": supernet.get("train_seconds"), "supernet_flops": supernet.get("train_flops"),
           "search_seconds": search.get("wall_seconds"), "one_off_seconds": one_off_s, "one_off_flops": one_off_flops,
           "retrain_models": len(retrains), "retrain_seconds": sum(r["train_seconds"] for r in retrains),
           "retrain_flops": sum(r["train_flops"] for r in retrains)}
    hat["total_seconds"] = one_off_s + hat["retrain_seconds"]
    hat["total_flops"] = one_off_flops + hat["retrain_flops"]
    n = len(retrains)
    hat["per_model_seconds"] = hat["total_seconds"] / n if n else None
    hat["per_model_flops"] = hat["total_flops"] / n if n else None
    base = {"models": len(baselines), "total_seconds": sum(r["train_seconds"] for r in baselines),
            "total_flops": sum(r["train_flops"] for r in baselines)}
    m = len(baselines)
    base["per_model_seconds"] = base["total_seconds"] / m if m else None
    base["per_model_flops"] = base["total_flops"] / m if m else None
    ratio = {k: hat[k] / base[k] if base.get(k) else None
             for k in ("total_seconds", "total_flops", "per_model_seconds", "per_model_flops")}
    return {"hat": hat, "baselines": base, "ratio_hat_to_baselines": ratio}


def phase_report(out: Path) -> dict[str, Any]:
    """``results.json``, ``results.md``, ``pareto.png`` from the JSON files alone (the same files give the same
    bytes of the first two)."""
    rows = load_rows(out)
    goals = check_goals(rows)
    tiny_ms = goals["tiny_latency_ms"]
    for r in rows:
        r["latency_ratio_tiny"] = r["latency_ms"] / tiny_ms if tiny_ms else None
    base = [r for r in rows if r["kind"] == "baseline"]
    ref_latency = HV_MARGIN * max((r["latency_ms"] for r in base), default=0.0)
    sets = _sets(rows)
    hv = {name: hypervolume([(p["test_bleu"], p["latency_ms"]) for p in pts], ref_latency)
          for name, pts in sets.items()}
    missing = [{k: r[k] for k in ("budget", "budget_ms", "init", "seed", "reason")}
               for r in (_read(f) for f in sorted((out / "searched").glob("*.json"))) if r and not r.get("found", True)]
    search = _read(out / "search.json") or {}
    results = {"models": [_table_row(r) for r in rows], "goals": goals, "compute": compute_accounting(out, rows),
               "hypervolume": {"reference": {"test_bleu": 0.0, "latency_ms": ref_latency}, "test_bleu": hv},
               "not_found": missing, "search": {k: search.get(k) for k in ("sweep_id", "method", "trials_completed",
                                                                         "trials_failed", "wall_seconds")},
               "smoke": bool((_read(out / "supernet.json") or {}).get("smoke"))}
    ran = _read(out / "results_gpu.json") if out.name == "gpu" else None
    if ran is not None:
        done = [m for m in ran["models"] if not m.get("failed")]
        results["gpu"] = {"steps": max((m["steps"] for m in done), default=0),
                          "device": done[0]["device"] if done else "-", "failed": len(ran["models"]) - len(done)}
    _write(out / "results.json", results)
    (out / "results.md").write_text(markdown(results), encoding="utf-8")
    if rows:
        (out / "pareto.png").write_bytes(_plot(sets, tiny_ms))
    return results


def _table_row(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("key", "kind", "label", "budget", "init", "seed", "arch_summary", "params_m", "latency_ms",
            "latency_ms_retrain", "latency_quiet", "latency_ratio_tiny", "bleu", "chrf", "valid_loss", "test_bleu",
            "test_chrf", "test_bleu_lc", "steps_done", "inherited_test_bleu", "train_flops", "train_seconds", "wall_seconds", "out_dir")
    return {k: r.get(k) for k in keys}


def _sets(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The point sets of the plot and the hypervolumes: models as seed means; the searched archs' inherited scores."""
    searched = [r for r in rows if r["kind"] == "searched"]
    inherited = {}
    for r in rows:
        if r["kind"] != "baseline" and r.get("inherited_test_bleu") is not None:
            inherited.setdefault(r["arch_id"], {"model": r["arch_id"], "arch_summary": r["arch_summary"],
                                                "test_bleu": r["inherited_test_bleu"], "latency_ms": r["latency_ms"]})
    sets = {"baselines": _mean_by([r for r in rows if r["kind"] == "baseline"], "name"),
            "searched, retrained from scratch": _mean_by(searched, "arch_id"),
            "searched, retrained from inherited": _mean_by([r for r in rows if r["kind"] == "searched_inherited"],
                                                           "arch_id"),
            "searched, inherited (no retraining)": [inherited[k] for k in sorted(inherited)]}
    return {k: v for k, v in sets.items() if v}


def _f(v: Any, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def markdown(results: dict[str, Any]) -> str:
    """The report as Markdown (deterministic in ``results``)."""
    lines = ["# Proof of value: HAT's pipeline on search_spaces/quickstart_depth.yaml", ""]
    if results.get("smoke"):
        lines += ["**Smoke run: a few steps on 300 pairs; the numbers mean nothing.**", ""]
    if results.get("gpu"):
        g = results["gpu"]
        lines += [f"**GPU protocol** (`experiments/proof_of_value_gpu.py`): the archs found on the CPU, every final "
                  f"model trained for up to {g['steps']} updates on one {g['device']}, all at once as parallel "
                  f"processes; steps each model reached in the table. Latencies are the CPU's (one thread, quiet). "
                  f"Seconds mix devices (supernet and search on the 2-core CPU, retraining on the GPU): compare "
                  f"FLOPs. test2016 lc = sacrebleu lowercased BLEU (13a), the nearest to Wu et al.'s tokenized "
                  f"lowercased 41.02 for Transformer-Tiny.", ""]
    lines += ["test2016 = Multi30k test_2016_flickr (sacrebleu on raw text); valid = the validation set. Latency: the "
              "YAML's fixed workload, one thread, timed quietly one model at a time (`*`: not timed quietly, the "
              "retrain's own). Ratio: to Transformer-Tiny (seed mean).", "",
              "| model | budget | init | seed | arch | params (M) | latency (ms) | ratio | test2016 BLEU "
              "| test2016 chrF | valid BLEU | valid chrF | train TFLOP | train s |" + (
                  " steps | test2016 lc | inherited test2016 |" if results.get("gpu") else ""),
              "| --- " * (17 if results.get("gpu") else 14) + "|"]
    for r in results["models"]:
        label = r["label"] if r["kind"] == "baseline" else "searched"
        star = "" if r["latency_quiet"] else "*"
        lines.append(f"| {label} | {r['budget'] or '-'} | {r['init']} | {r['seed']} | `{r['arch_summary']}` | "
                     f"{_f(r['params_m'])} | {_f(r['latency_ms'], '.1f')}{star} | {_f(r['latency_ratio_tiny'])} | "
                     f"{_f(r['test_bleu'])} | {_f(r['test_chrf'])} | {_f(r['bleu'])} | {_f(r['chrf'])} | "
                     f"{_f(r['train_flops'] and r['train_flops'] / 1e12, '.1f')} | {_f(r['train_seconds'], '.0f')} |"
                     + (f" {r['steps_done']} | {_f(r['test_bleu_lc'])} | {_f(r['inherited_test_bleu'])} |"
                        if results.get("gpu") else ""))
    for m in results.get("not_found", []):
        lines.append(f"\nNo trial within the {m['budget']} budget ({m['budget_ms']:.1f} ms) for {m['init']} seed "
                     f"{m['seed']}: {m['reason']}")
    lines += ["", "## Goals", ""] + _goal_lines(results["goals"])
    lines += ["", "## Compute", ""] + _compute_lines(results["compute"])
    hv = results["hypervolume"]
    lines += ["", f"## Hypervolume (test2016 BLEU x ms, from BLEU 0 and {hv['reference']['latency_ms']:.1f} ms)", "",
              "| set | hypervolume |", "| --- | --- |"]
    lines += [f"| {name} | {v:.1f} |" for name, v in hv["test_bleu"].items()]
    s = results.get("search") or {}
    if s.get("sweep_id"):
        lines += ["", f"Search: sweep {s['sweep_id']} ({s['method']}), {s['trials_completed']} trials completed, "
                  f"{s['trials_failed']} failed, {_f(s['wall_seconds'], '.0f')} s wall."]
    return "\n".join(lines) + "\n"


def _verdict(met: bool | None) -> str:
    return "not decided (models missing)" if met is None else "**met**" if met else "**missed**"


def _goal_lines(g: dict[str, Any]) -> list[str]:
    g1, g2, g3 = g["1_gap_at_tiny_latency"], g["2_half_latency_within"], g["3_baselines_dominated"]
    lines = [f"1. At Tiny's latency or less ({_f(g['tiny_latency_ms'], '.1f')} ms), min over the searched model's "
             f"seeds {g1['searched_seeds']} minus max over Tiny's seeds {g1['tiny_seeds']} >= "
             f"{g1['threshold_bleu']:.1f} BLEU: {_verdict(g1['met'])}"]
    if "gap_bleu" in g1:
        lines[-1] += (f": {g1['searched_min_bleu']:.2f} - {g1['tiny_max_bleu']:.2f} = {g1['gap_bleu']:+.2f} BLEU; "
                      f"searched latency up to {g1['searched_max_latency_ms']:.1f} ms"
                      f"{'' if g1['within_latency'] else ' (over Tiny latency)'}.")
    lines.append(f"2. At half Tiny's latency or less ({_f(g2.get('half_latency_ms'), '.1f')} ms), a searched model "
                 f"within {g2['threshold_bleu']:.1f} BLEU of Tiny ({_f(g2.get('tiny_mean_bleu'))}): "
                 f"{_verdict(g2['met'])}")
    if "best_bleu" in g2:
        lines[-1] += (f": `{g2['best']}` {g2['best_bleu']:.2f} BLEU at {g2['best_latency_ms']:.1f} ms, "
                      f"Tiny minus it {g2['shortfall_bleu']:+.2f} BLEU.")
    elif g2.get("candidates") == 0:
        lines[-1] += ": no searched model that fast."
    lines.append(f"3. Every baseline dominated by a searched model (test2016 BLEU up, latency down, seed means): "
                 f"{_verdict(g3['met'])}: {g3['dominated']} of {len(g3['baselines'])}.")
    for b in g3["baselines"].values():
        by = ", ".join(f"`{a}`" for a in b["dominated_by"]) or "none"
        lines.append(f"   - {b['label']} ({b['test_bleu']:.2f} BLEU, {b['latency_ms']:.1f} ms): dominated by {by}")
    return lines


def _compute_lines(c: dict[str, Any]) -> list[str]:
    h, b, r = c["hat"], c["baselines"], c["ratio_hat_to_baselines"]

    def tf(v: float | None) -> str:
        return _f(v and v / 1e12, ".1f")

    return ["Training seconds as the trainers report them, the search in wall seconds; training FLOPs analytic "
            "(3x forward, benchmarks/bench_gpu.py `forward_flops`), the search's not counted.", "",
            "| item | seconds | train TFLOP |", "| --- | --- | --- |",
            f"| supernet | {_f(h['supernet_seconds'], '.0f')} | {tf(h['supernet_flops'])} |",
            f"| search | {_f(h['search_seconds'], '.0f')} | - |",
            f"| retraining, {h['retrain_models']} searched models | {h['retrain_seconds']:.0f} | "
            f"{tf(h['retrain_flops'])} |",
            f"| **HAT pipeline, total** | {h['total_seconds']:.0f} | {tf(h['total_flops'])} |",
            f"| HAT pipeline, per final model | {_f(h['per_model_seconds'], '.0f')} | {tf(h['per_model_flops'])} |",
            f"| **baselines, total** ({b['models']} models) | {b['total_seconds']:.0f} | {tf(b['total_flops'])} |",
            f"| baselines, per model | {_f(b['per_model_seconds'], '.0f')} | {tf(b['per_model_flops'])} |",
            f"| ratio HAT / baselines, total | {_f(r['total_seconds'])} | {_f(r['total_flops'])} |",
            f"| ratio HAT / baselines, per model | {_f(r['per_model_seconds'])} | {_f(r['per_model_flops'])} |"]


def _plot(sets: dict[str, list[dict[str, Any]]], tiny_ms: float | None) -> bytes:
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.2, 4.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    styles = {"baselines": ("k", "s", "none"), "searched, retrained from scratch": ("tab:blue", "^", "-"),
              "searched, retrained from inherited": ("tab:green", "v", "none"),
              "searched, inherited (no retraining)": ("tab:blue", "o", "--")}
    for name, pts in sets.items():
        color, marker, line = styles[name]
        xy = sorted((p["latency_ms"], p["test_bleu"]) for p in pts)
        ax.plot([p[0] for p in xy], [p[1] for p in xy], marker=marker, linestyle=line, color=color, label=name,
                fillstyle="none" if "no retraining" in name else "full")
    for p in sets.get("baselines", []):
        ax.annotate(p["label"], (p["latency_ms"], p["test_bleu"]), textcoords="offset points", xytext=(4, -10),
                    fontsize=8)
    if tiny_ms:
        for x, text in ((tiny_ms, "Tiny"), (tiny_ms / 2, "Tiny / 2")):
            ax.axvline(x, color="gray", linewidth=0.8, linestyle=":")
            ax.text(x, ax.get_ylim()[0], f" {text}", fontsize=7, color="gray", va="bottom")
    ax.set_xlabel("latency (ms, fixed workload, 1 thread, timed quietly)")
    ax.set_ylabel("test_2016_flickr BLEU (En-De)")
    ax.set_title("Searched and retrained vs hand-designed, same recipe", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


# --------------------------------------------------------------------------- the GPU protocol


GPU_STEPS = 8000
"""Transformer-Tiny's full budget (Wu et al., ACL 2021): updates of ``retrain.max_tokens`` tokens on the GPU."""
GPU_CHECKPOINT_EVERY = 200
GPU_AVERAGE_LAST = 5
"""The newest 5 of the snapshots every 200 steps are averaged: the last 1,000 updates, about the last 5 epochs of
Multi30k at 4,096 tokens a batch (fairseq's epoch checkpoints, averaged as Wu et al. do)."""
CARRY = ROOT / ".povgpu"
"""What travels to the GPU machine (ignored by git): plan, YAML, data, the data cache and the supernet."""


def _fresh_model(spec, data, arch):
    from nas.model.supernet import SuperTransformer
    from nas.retraining import _arch_config

    return SuperTransformer.from_config(_arch_config(spec, data.vocab_size, arch)).eval()


def phase_gpu_plan(work: Path, out: Path, smoke: bool) -> None:
    """Time every baseline arch and every trial's arch quietly (fresh weights: ``latency_ms`` is a function of the
    arch and the device alone), pick the best trial by inherited validation BLEU under each budget of
    :data:`BUDGETS`, and write ``gpu/plan.json`` (committed) and :data:`CARRY` (what the GPU machine needs) for
    ``experiments/proof_of_value_gpu.py``. ``gpu/latency_archs.json`` keeps the timings (3 interleaved rounds, the
    median; one thread; nothing else running)."""
    import shutil

    import yaml

    from nas.space.arch import Arch
    from nas.space.predictor_file import workload_of

    search = _read(out / "search.json")
    (out / "gpu").mkdir(parents=True, exist_ok=True)
    if search is None:
        print("gpu_plan: no search.json (run --phase supernet search first); skipped", file=sys.stderr, flush=True)
        return
    spec, yaml_path, data = _context(work, smoke)
    gpu = out / "gpu"
    archs = {baseline_arch(k).arch_id: baseline_arch(k) for k in BASELINES}
    trials = [t for t in search["trials"] if t.get("bleu") is not None]
    for t in trials:
        archs.setdefault(t["arch_id"], Arch.from_dict(t["arch"]))
    workload, repeats = workload_of(spec.search), spec.search.latency_repeats
    timed = _read(gpu / "latency_archs.json") or {}
    if set(timed.get("by_arch", {})) != set(archs) or timed.get("repeats") != repeats:
        models = {a: _fresh_model(spec, data, arch) for a, arch in sorted(archs.items())}
        rounds = _timed_rounds(models, workload, repeats, "gpu_plan latency")
        timed = {"by_arch": {a: {"latency_ms": statistics.median(v), "rounds_ms": v, "summary": archs[a].summary()}
                             for a, v in rounds.items()},
                 "threads": 1, "workload": workload, "repeats": repeats, "rounds": LATENCY_ROUNDS,
                 "weights": "fresh (latency does not depend on them)"}
        _write(gpu / "latency_archs.json", timed)
    ms = {a: v["latency_ms"] for a, v in timed["by_arch"].items()}
    budgets = {k: ms[baseline_arch(k).arch_id] for k in BASELINES}
    budgets["half_tiny"] = budgets[REFERENCE] / 2
    models: list[dict[str, Any]] = []
    for key, (label, *_, seeds) in BASELINES.items():
        arch = baseline_arch(key)
        models += [{"key": f"baselines/{key}_seed{s}", "kind": "baseline", "name": key, "label": label, "seed": s,
                    "init": "scratch", "arch": arch.to_dict(), "arch_id": arch.arch_id,
                    "arch_summary": arch.summary(), "latency_ms": ms[arch.arch_id]} for s in seeds]
    picks, trained = {}, {}
    for budget, runs in BUDGETS.items():
        within = [t for t in trials if ms[t["arch_id"]] <= budgets[budget]]
        if not within:
            picks[budget] = {"budget_ms": budgets[budget], "found": False}
            continue
        best = max(within, key=lambda t: (t["bleu"], -ms[t["arch_id"]]))
        picks[budget] = {"budget_ms": budgets[budget], "found": True, "trial": best["number"],
                         "arch_summary": best["arch_summary"], "arch_id": best["arch_id"], "bleu": best["bleu"],
                         "latency_ms": ms[best["arch_id"]]}
        for init, seed in runs:
            same = trained.get((best["arch_id"], init, seed))
            if same is not None:  # another budget chose the same trial: trained once, reported for both
                same["budgets"].append(budget)
                continue
            entry = {"key": f"searched/{budget}_{init}_seed{seed}", "kind": "searched", "budget": budget,
                     "budgets": [budget], "budget_ms": budgets[budget], "init": init, "seed": seed,
                     "arch": archs[best["arch_id"]].to_dict(), "arch_id": best["arch_id"],
                     "arch_summary": best["arch_summary"], "latency_ms": ms[best["arch_id"]],
                     "trial": {k: best.get(k) for k in ("number", "bleu", "chrf", "latency_ms", "params_m")}}
            trained[(best["arch_id"], init, seed)] = entry
            models.append(entry)
    # what travels: the data (relative paths), its cache, the YAML, the supernet
    if CARRY.exists():
        shutil.rmtree(CARRY)  # ours: written only by this phase (ignored by git)
    (CARRY / "data").mkdir(parents=True)
    for name in ("train.en.gz", "train.de.gz", "val.en.gz", "val.de.gz", *TEST):
        shutil.copyfile(DATA / name, CARRY / "data" / name)
    raw = yaml.safe_load(Path(yaml_path).read_text(encoding="utf-8"))
    for split, (src, tgt) in {"train": ("train.en.gz", "train.de.gz"), "valid": ("val.en.gz", "val.de.gz")}.items():
        raw["data"][split] = {"src": f".povgpu/data/{src}", "tgt": f".povgpu/data/{tgt}"}
    raw["data"]["cache_dir"] = ".povgpu/cache"
    raw["workdir"] = ".povgpu/runs"
    (CARRY / "sweep.yaml").write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    shutil.copytree(Path(spec.data.cache_dir), CARRY / "cache")
    (CARRY / "supernet").mkdir()
    for name in ("supernet.safetensors", "supernet.json"):  # the weights only: no optimizer, no snapshots
        shutil.copyfile(spec.run_dir / "supernet" / name, CARRY / "supernet" / name)
    plan = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "yaml": ".povgpu/sweep.yaml",
            "supernet_dir": ".povgpu/supernet", "test": [f".povgpu/data/{n}" for n in TEST],
            "steps": 4 if smoke else GPU_STEPS, "checkpoint_every": 2 if smoke else GPU_CHECKPOINT_EVERY,
            "average_last": GPU_AVERAGE_LAST, "budgets_ms": budgets, "picks": picks, "models": models}
    (CARRY / "plan.json").write_text(json.dumps(plan, indent=2), encoding="utf-8")
    _write(gpu / "plan.json", plan)
    for budget, p in picks.items():
        print(f"gpu_plan {budget} (<= {p['budget_ms']:.1f} ms): "
              f"{p.get('arch_summary', 'none')} {_f(p.get('latency_ms'), '.1f')} ms", file=sys.stderr, flush=True)


def phase_gpu_report(work: Path, out: Path, smoke: bool) -> None:
    """``gpu/results_gpu.json`` (the GPU run's ``<out>/results.json``, copied) -> one JSON per final model in the CPU protocol's
    layout under ``gpu/``, then :func:`phase_report` of ``gpu/`` (latencies: ``gpu/latency_archs.json``)."""
    gpu = out / "gpu"
    plan, ran = _read(gpu / "plan.json"), _read(gpu / "results_gpu.json")
    if plan is None or ran is None:
        print("gpu_report: gpu/plan.json or gpu/results_gpu.json missing; skipped", file=sys.stderr, flush=True)
        return
    spec, _, data = _context(work, smoke)
    from nas.space.arch import Arch

    quiet = {}
    for folder in ("baselines", "searched"):
        (gpu / folder).mkdir(parents=True, exist_ok=True)
    for row in ran["models"]:
        if row.get("failed"):
            continue
        arch = Arch.from_dict(row["arch"])
        common = {**row, "out_dir": f"gpu:{row['key']}", "latency_ms": row["latency_ms"],
                  "train_flops": _retrain_flops(spec, data, arch, int(row["steps_done"]))}
        if row["kind"] == "baseline":
            _write(gpu / f"{row['key']}.json", common)
            quiet[row["key"]] = row["latency_ms"]
            continue
        for budget in row["budgets"]:  # one training, reported under each budget that chose it
            key = f"searched/{budget}_{row['init']}_seed{row['seed']}"
            _write(gpu / f"{key}.json", {**common, "budget": budget, "budget_ms": plan["budgets_ms"][budget],
                                         "found": True})
            quiet[key] = row["latency_ms"]
    for budget, p in plan["picks"].items():
        if not p["found"]:
            for init, seed in BUDGETS[budget]:
                _write(gpu / "searched" / f"{budget}_{init}_seed{seed}.json",
                       {"budget": budget, "budget_ms": p["budget_ms"], "init": init, "seed": seed, "found": False,
                        "reason": "no trial of the search within this latency"})
    ref = reference_ms(quiet)
    _write(gpu / "latency_quiet.json", {"latency_ms": quiet, "reference": REFERENCE, "reference_ms": ref,
                                        "source": "gpu/latency_archs.json (CPU, one thread, fresh weights)"})
    for name in ("supernet.json", "search.json"):
        if (out / name).is_file():
            (gpu / name).write_bytes((out / name).read_bytes())
    phase_report(gpu)


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phase", nargs="*", choices=PHASES, default=list(DEFAULT_ORDER), help="phases, in this order")
    ap.add_argument("--out", default=None, help="result JSON files (default experiments/proof_of_value; "
                                                "--smoke: <work>/smoke/results)")
    ap.add_argument("--work", default=str(ROOT / "experiments" / "out" / "proof_of_value"),
                    help="supernet, sweep, weights and the MLflow store (not committed)")
    ap.add_argument("--smoke", action="store_true", help="the whole pipeline, tiny (see SMOKE_SET), under <work>/smoke")
    args = ap.parse_args(argv)
    work = Path(args.work).resolve() / ("smoke" if args.smoke else "")
    out = Path(args.out) if args.out else (work / "results" if args.smoke else ROOT / "experiments" / "proof_of_value")
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{(work / 'mlflow.db').resolve()}")
    run = {"supernet": phase_supernet, "search": phase_search, "baselines": phase_baselines,
           "latency": phase_latency, "retrain": phase_retrain, "gpu_plan": phase_gpu_plan,
           "gpu_report": phase_gpu_report}
    for phase in args.phase:
        t0 = time.perf_counter()
        if phase == "report":
            phase_report(out)
            print((out / "results.md").read_text(encoding="utf-8"))
        else:
            run[phase](work, out, args.smoke)
        print(f"phase {phase}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
