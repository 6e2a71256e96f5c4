"""Does the supernet rank the middle of the space? Supernet recipes against archs trained alone (issue 27).

Each recipe variant trains one supernet at the quickstart's budget (``experiments/search_value.py``'s spec: 560
steps of 4096 tokens, peak lr 1.5e-3, 150 warm-up steps, ``sandwich_k: 1``) and scores a fixed set of archs with
inherited weights; Kendall tau between those scores and the archs' scores trained alone (560 steps, the same
recipe, ``supernet.dropout``) says how well the supernet ranks them. Resumable: every result is its own JSON file
under ``experiments/ranking/<space>/``; a rerun skips what exists.

    python experiments/ranking.py jobs                       # list the jobs (supernet variants, archs alone)
    python experiments/ranking.py run --jobs q_today u_today  # train + score these (one process each)
    python experiments/ranking.py run --all --workers 8       # every missing job, 8 processes (a GPU)
    python experiments/ranking.py report                      # tau table from the JSON files (CPU, seconds)

Archs (``archs`` in each space's folder, fixed once): the quickstart space's four hand-designed baselines and its
retrained front member of ``experiments/search_value/`` (trained alone there, on this CPU) and three more (the
widest and two drawn with seed 27), trained alone here; the unified space's eight of
``experiments/search_value/unified/tau/`` (trained alone there, relative positions in every encoder layer) and
four more drawn with seed 27, trained alone here the same way (``supernet.relative_layers: all`` for the whole
unified comparison). The "middle" of a set is all but its fewest-parameter and most-parameter arch.

Tau intervals: 90% percentile bootstrap over the archs (2000 resamples, seed 0; resamples with a tie-only side
skipped).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments import search_value  # noqa: E402  (its JSON helpers; it imports nothing heavy at the top)
OUT = ROOT / "experiments" / "ranking"
VALUE = ROOT / "experiments" / "search_value"
SEED = 27

BALANCED_DISTILL = {"inplace_distill": True, "balanced_sampling": True}
VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # name: (space, train overrides, supernet overrides)
    "q_today": ("quickstart", {}, {}),
    "q_distill": ("quickstart", {"inplace_distill": True}, {}),
    "q_distill_half": ("quickstart", {"inplace_distill": True, "distill_lambda": 0.5}, {}),
    "q_split": ("quickstart", {"stages": [{"name": "joint", "steps": 280}, {"name": "word_distill", "steps": 280}]}, {}),
    "q_drop01": ("quickstart", {"dropout_range": [0.0, 0.1]}, {}),
    "q_drop03": ("quickstart", {"dropout_range": [0.0, 0.3]}, {}),
    "q_balanced": ("quickstart", {"balanced_sampling": True}, {}),
    "q_all01": ("quickstart", {**BALANCED_DISTILL, "dropout_range": [0.0, 0.1]}, {}),
    "q_all03": ("quickstart", {**BALANCED_DISTILL, "dropout_range": [0.0, 0.3]}, {}),
    "q_distill_drop03": ("quickstart", {"inplace_distill": True, "dropout_range": [0.0, 0.3]}, {}),
    "u_today": ("unified", {}, {"relative_layers": "all"}),
    "u_split_layouts": ("unified", {}, {"relative_layers": "all", "share_layouts": False}),
    "u_all01_shared": ("unified", {**BALANCED_DISTILL, "dropout_range": [0.0, 0.1]}, {"relative_layers": "all"}),
    "u_all01_split": ("unified", {**BALANCED_DISTILL, "dropout_range": [0.0, 0.1]},
                      {"relative_layers": "all", "share_layouts": False}),
    "u_all03_split": ("unified", {**BALANCED_DISTILL, "dropout_range": [0.0, 0.3]},
                      {"relative_layers": "all", "share_layouts": False}),
    "u_distill_split": ("unified", {"inplace_distill": True}, {"relative_layers": "all", "share_layouts": False}),
    # second round, after the first showed in-place distillation with lambda 0 collapsing the widest
    "q_drop01_bal": ("quickstart", {"dropout_range": [0.0, 0.1], "balanced_sampling": True}, {}),
    "q_half_drop01": ("quickstart", {"inplace_distill": True, "distill_lambda": 0.5, "dropout_range": [0.0, 0.1]}, {}),
    "q_half_drop01_bal": ("quickstart", {"inplace_distill": True, "distill_lambda": 0.5, "dropout_range": [0.0, 0.1],
                                         "balanced_sampling": True}, {}),
    "u_drop01": ("unified", {"dropout_range": [0.0, 0.1]}, {"relative_layers": "all"}),
    "u_drop01_bal": ("unified", {"dropout_range": [0.0, 0.1], "balanced_sampling": True}, {"relative_layers": "all"}),
    "u_drop01_bal_split": ("unified", {"dropout_range": [0.0, 0.1], "balanced_sampling": True},
                           {"relative_layers": "all", "share_layouts": False}),
    "u_half_drop01_bal": ("unified", {"inplace_distill": True, "distill_lambda": 0.5, "dropout_range": [0.0, 0.1],
                                      "balanced_sampling": True}, {"relative_layers": "all"}),
}
"""Supernet variants: ``q_*`` the quickstart space (one layout, no units), ``u_*`` the unified space."""

STEPS: int | None = None
"""``--steps``: a smoke run's budget (None: the quickstart's 560)."""
VALID: int | None = None
"""``--valid``: validation sentences in a smoke run (None: the spec's)."""
DATA_ROOT: Path | None = None
"""``--data-root``: where the Multi30k files are (default: the YAMLs' ``../shared/data/multi30k``)."""


def _write(path: Path, obj: Any) -> None:
    """``search_value``'s atomic JSON write, its folder made first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    search_value._write(path, obj)


_read = search_value._read


def _spec(space: str, train: dict[str, Any] | None = None, supernet: dict[str, Any] | None = None):
    """search_value.py's spec of ``space`` (the quickstart's budget), with overrides; no file is written."""
    import yaml

    from nas.space import parse_spec

    quick = yaml.safe_load((ROOT / "search_spaces" / "quickstart.yaml").read_text())
    # The budget these results were measured at: quickstart.yaml's until 2026-12-01 (it now trains 400 steps at
    # 3e-3 and scores level 1 on 100 sentences, experiments/quickstart_schedule/README.md).
    quick["train"].update(steps=560, lr=1.5e-3, warmup_steps=150)
    quick["search"]["evolution"]["subset_sentences"] = 200
    raw = yaml.safe_load((ROOT / "search_spaces" / f"{space}.yaml").read_text())
    budget = {k: quick["train"][k] for k in ("steps", "max_tokens", "lr", "warmup_steps", "sandwich_k")}
    raw["train"] = {**raw.get("train", {}), **budget, "checkpoint_every": 100, **(train or {})}
    if "stages" in (train or {}):
        raw["train"].pop("steps")
    raw["supernet"] = {**raw["supernet"], **(supernet or {})}
    raw["search"] = quick["search"]
    for split in ("train", "valid"):
        raw["data"][split] = {k: str(((DATA_ROOT / Path(v).name) if DATA_ROOT else (ROOT / v)).resolve())
                              for k, v in raw["data"][split].items()}
    raw["data"]["cache_dir"] = str(ROOT / "nas_runs" / "data")
    if STEPS is not None:
        raw["train"]["steps"] = STEPS
        raw["train"]["warmup_steps"] = min(STEPS, raw["train"]["warmup_steps"])
        if "stages" in raw["train"]:
            raw["train"]["stages"] = [{**s, "steps": STEPS // 2} for s in raw["train"]["stages"]]
            raw["train"]["steps"] = STEPS // 2 * 2
        raw["train"]["stage_eval"] = False
    if VALID is not None:
        raw["search"] = {**raw["search"], "valid_sentences": VALID}
    raw["name"] = f"ranking_{space}"
    raw["workdir"] = str(ROOT / "nas_runs" / "ranking")
    return parse_spec(raw)


# --------------------------------------------------------------------------- the archs


def _archs(space: str) -> list[dict[str, Any]]:
    """``<space>/archs.json``: ``[{arch_id, arch, source, standalone?}]``, chosen once (then read back)."""
    path = OUT / space / "archs.json"
    stored = _read(path)
    if stored is not None:
        return stored
    from nas.builders import build_space

    spec = _spec(space)
    sp = build_space(spec)
    rows: list[dict[str, Any]] = []
    if space == "quickstart":
        for f in sorted((VALUE / "baselines").glob("*.json")) + [VALUE / "quickstart" / "retrained_45e5583c61b2.json"]:
            r = _read(f)
            rows.append({"arch_id": r["arch_id"], "arch": r["arch"], "source": f"search_value/{f.parent.name}/{f.name}",
                         "standalone": {k: r[k] for k in ("bleu", "valid_loss")}})
        extra = [sp.widest()]
    else:
        tau = _read(VALUE / "unified" / "tau.json")
        for a in tau["archs"]:
            r = _read(VALUE / "unified" / "tau" / f"standalone_{a['arch_id']}.json")
            rows.append({"arch_id": a["arch_id"], "arch": r["arch"], "source": "search_value/unified/tau",
                         "standalone": {k: r[k] for k in ("bleu", "valid_loss")},
                         "old_inherited": a["inherited"]})
        extra = []
    rng = random.Random(SEED)
    have = {r["arch_id"] for r in rows}
    want = 8 if space == "quickstart" else 12
    while len(rows) + len(extra) < want:
        arch = sp.sample(rng)
        if arch.arch_id not in have | {a.arch_id for a in extra}:
            extra.append(arch)
    rows += [{"arch_id": a.arch_id, "arch": a.to_dict(), "source": f"ranking (seed {SEED})"} for a in extra]
    _write(path, rows)
    return rows


def jobs() -> dict[str, tuple[str, ...]]:
    """Job name -> (kind, space, ...): every supernet variant and every arch without a standalone score."""
    out: dict[str, tuple[str, ...]] = {name: ("supernet", space) for name, (space, _, _) in VARIANTS.items()}
    for space in ("quickstart", "unified"):
        for row in _archs(space):
            if "standalone" not in row:
                out[f"alone_{row['arch_id']}"] = ("alone", space, row["arch_id"])
    return out


def _done(name: str) -> bool:
    kind = jobs()[name]
    if kind[0] == "supernet":
        return _read(OUT / kind[1] / "variants" / f"{name}.json") is not None
    return _read(OUT / kind[1] / "alone" / f"{kind[2]}.json") is not None


# --------------------------------------------------------------------------- running


def _data(spec):
    from nas.builders import prepare_sweep_data

    return prepare_sweep_data(spec, progress=False)


def _device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_job(name: str) -> str:
    """Train and score one job; writes its JSON; returns a line for the log."""
    import torch

    torch.set_num_threads(1)
    kind = jobs()[name]
    if _done(name):
        return f"{name}: done before"
    t0 = time.time()
    if kind[0] == "supernet":
        _, train, supernet = VARIANTS[name]
        spec = _spec(kind[1], train, supernet)
        line = _supernet_job(name, spec, kind[1])
    else:
        spec = _spec(kind[1], {}, {"relative_layers": "all"} if kind[1] == "unified" else {})
        line = _alone_job(spec, kind[1], kind[2])
    return f"{name}: {line} ({time.time() - t0:.0f} s)"


def _supernet_job(name: str, spec, space: str) -> str:
    import shutil

    from nas.eval.validation import ValidationSet
    from nas.model.supernet import count_params, extract
    from nas.search.fidelity import score_model
    from nas.space.arch import Arch
    from trainers import train_supernet

    data = _data(spec)
    work = ROOT / "nas_runs" / "ranking" / name
    if work.exists() and not (work / "metrics.json").is_file():
        shutil.rmtree(work)  # ours (nas_runs/ranking/<variant>): a killed run starts over, its results are per file
    result = train_supernet(spec, data, work, progress=False, device=_device())
    from nas.model.io import load_model

    model = load_model(work, "supernet").eval()
    archs = {row["arch_id"]: Arch.from_dict(row["arch"]) for row in _archs(space)}
    params = {k: count_params(extract(model, arch)) / 1e6 for k, arch in archs.items()}
    model.to(_device())
    vset = ValidationSet.load(data, spec.search.valid_sentences)
    scores = {k: {**score_model(model, arch, spec, data, vset), "params_m": params[k]} for k, arch in archs.items()}
    counts = _read(work / "sample_counts.json")
    _write(OUT / space / "variants" / f"{name}.json",
           {"variant": name, "train": VARIANTS[name][1], "supernet": VARIANTS[name][2], "steps": spec.train.steps,
            "device": torch_device_name(), "metrics": result.metrics, "inherited": scores, "sample_counts": counts})
    return f"widest BLEU {result.metrics.get('widest_bleu', float('nan')):.2f}"


def torch_device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def _alone_job(spec, space: str, arch_id: str) -> str:
    from nas.builders import build_supernet
    from nas.eval.validation import ValidationSet
    from nas.model.supernet import count_params
    from nas.search.fidelity import score_model, standalone_model, train_standalone
    from nas.space.arch import Arch

    row = next(r for r in _archs(space) if r["arch_id"] == arch_id)
    arch = Arch.from_dict(row["arch"])
    data = _data(spec)
    model = standalone_model(build_supernet(spec, data.vocab_size), arch, seed=0).to(_device())
    stats = train_standalone(model, arch, spec, data, spec.train.steps, device=_device())
    vset = ValidationSet.load(data, spec.search.valid_sentences)
    scores = score_model(model.eval(), arch, spec, data, vset)
    _write(OUT / space / "alone" / f"{arch_id}.json",
           {"arch_id": arch_id, "arch_summary": arch.summary(), "steps": spec.train.steps, "device": torch_device_name(),
            "params_m": count_params(model) / 1e6, **stats, **scores})
    return f"alone BLEU {scores['bleu']:.2f}"


# --------------------------------------------------------------------------- the report


def _tau(a: list[float], b: list[float]) -> float:
    from scipy.stats import kendalltau

    return float(kendalltau(a, b).statistic)


def _interval(a: list[float], b: list[float], resamples: int = 2000) -> list[float]:
    import math

    rng = random.Random(0)
    n, taus = len(a), []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        t = _tau([a[i] for i in idx], [b[i] for i in idx])
        if not math.isnan(t):
            taus.append(t)
    taus.sort()
    if not taus:
        return [math.nan, math.nan]
    return [taus[int(0.05 * len(taus))], taus[int(0.95 * len(taus)) - 1]]


def _correlate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Tau (and its interval) on all rows and on the middle (all but the fewest- and most-parameter arch)."""
    rows = sorted(rows, key=lambda r: r["params_m"])
    out: dict[str, Any] = {}
    for part, sel in (("all", rows), ("middle", rows[1:-1])):
        for metric in ("valid_loss", "bleu"):
            a = [r["inherited"][metric] for r in sel]
            b = [r["standalone"][metric] for r in sel]
            out[f"{part}_tau_{metric}"] = _tau(a, b)
            out[f"{part}_tau_{metric}_90"] = _interval(a, b)
    out["k"] = len(rows)
    return out


def _rows(space: str, inherited: dict[str, Any], only: set[str] | None = None) -> list[dict[str, Any]]:
    rows = []
    for row in _archs(space):
        if only is not None and row["arch_id"] not in only:
            continue
        alone = row.get("standalone") or _read(OUT / space / "alone" / f"{row['arch_id']}.json")
        if alone is None or row["arch_id"] not in inherited:
            continue
        mine = inherited[row["arch_id"]]
        rows.append({"arch_id": row["arch_id"], "params_m": mine["params_m"], "inherited": mine,
                     "standalone": {k: alone[k] for k in ("bleu", "valid_loss")}})
    return rows


def report() -> dict[str, Any]:
    """``ranking/results.json`` and ``results.md``: each variant's taus (all archs, the original 8 of the unified
    space, middles) and the widest's validation BLEU; also ``unified/tau.json``'s ``middle_tau_valid_loss``."""
    table: dict[str, Any] = {}
    for space in ("quickstart", "unified"):
        archs = _archs(space)
        original = {r["arch_id"] for r in archs if r["source"].startswith("search_value")}
        if space == "unified":  # the committed inherited scores of the old recipe (a CPU-trained supernet)
            old = {r["arch_id"]: {**r["old_inherited"], "params_m": 0.0} for r in archs if "old_inherited" in r}
            params = {}
            for f in sorted((OUT / space / "variants").glob("*.json")):
                params.update({k: v["params_m"] for k, v in _read(f)["inherited"].items()})
            for k in old:
                old[k]["params_m"] = params.get(k, 0.0)
            rows = _rows(space, old, original)
            if len(rows) >= 4 and all(r["params_m"] for r in rows):
                corr = _correlate(rows)
                table["u_committed"] = {"space": space, "original8": corr, "widest_bleu": None,
                                        "note": "experiments/search_value/unified/tau.json's inherited scores"}
                committed = _read(VALUE / "unified" / "tau.json")
                keys = {"middle_tau_valid_loss": corr["middle_tau_valid_loss"], "middle_tau_bleu": corr["middle_tau_bleu"]}
                if committed is not None and any(committed.get(k) != v for k, v in keys.items()):
                    _write(VALUE / "unified" / "tau.json", {**committed, **keys})
        for f in sorted((OUT / space / "variants").glob("*.json")):
            v = _read(f)
            rows = _rows(space, v["inherited"])
            if len(rows) < 4:
                continue
            entry = {"space": space, "train": v["train"], "supernet": v["supernet"], "device": v["device"],
                     "widest_bleu": v["metrics"].get("widest_bleu"), "widest_valid_loss": v["metrics"].get("widest_valid_loss"),
                     "sample_spread": v["metrics"].get("sample_spread"), **_correlate(rows)}
            if space == "unified":
                entry["original8"] = _correlate([r for r in rows if r["arch_id"] in original])
            table[v["variant"]] = entry
            _write(OUT / space / f"{v['variant']}.json", entry)
    _write(OUT / "results.json", table)
    (OUT / "results.md").write_text(_markdown(table))
    return table


def _markdown(table: dict[str, Any]) -> str:
    f = lambda x: "-" if x is None else f"{x:.2f}"
    iv = lambda x: f"[{x[0]:.2f}, {x[1]:.2f}]"
    lines = ["| variant | archs | tau loss, all | tau loss, middle | tau BLEU, all | tau BLEU, middle | widest BLEU |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, e in table.items():
        for label, c in (("", e), (" (original 8)", e.get("original8"))):
            if c is None or "all_tau_valid_loss" not in c:
                continue
            lines.append(f"| {name}{label} | {c['k']} | {f(c['all_tau_valid_loss'])} {iv(c['all_tau_valid_loss_90'])} | "
                         f"{f(c['middle_tau_valid_loss'])} {iv(c['middle_tau_valid_loss_90'])} | "
                         f"{f(c['all_tau_bleu'])} {iv(c['all_tau_bleu_90'])} | "
                         f"{f(c['middle_tau_bleu'])} {iv(c['middle_tau_bleu_90'])} | {f(e.get('widest_bleu'))} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    global STEPS, VALID, DATA_ROOT, OUT
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["jobs", "run", "report", "prepare"])
    ap.add_argument("--jobs", nargs="*", default=[])
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--deadline", type=float, default=None, help="run: start no job after this many seconds")
    ap.add_argument("--steps", type=int, default=None, help="smoke run: this many steps")
    ap.add_argument("--valid", type=int, default=None, help="smoke run: this many validation sentences")
    ap.add_argument("--data-root", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None, help="results folder (default experiments/ranking)")
    args = ap.parse_args()
    STEPS, VALID, DATA_ROOT = args.steps, args.valid, args.data_root
    if args.out is not None:
        OUT = args.out.resolve()
    os.environ["NAS_RANKING_ARGS"] = json.dumps([STEPS, VALID, str(DATA_ROOT) if DATA_ROOT else None, str(OUT)])
    if args.command == "jobs":
        for name, kind in jobs().items():
            print(name, *kind, "done" if _done(name) else "")
    elif args.command == "prepare":
        for space in ("quickstart", "unified"):
            _archs(space)
            print(_data(_spec(space)).root)
    elif args.command == "report":
        print((OUT / "results.md").read_text() if report() else "no results")
    else:
        names = [n for n in (list(jobs()) if args.all else args.jobs) if not _done(n)]
        names.sort(key=lambda n: (not n.startswith("u_"), not n.startswith("alone")))  # longest first
        start = time.time()
        spawn = multiprocessing.get_context("spawn")  # no CUDA state crosses a fork
        with ProcessPoolExecutor(args.workers, mp_context=spawn, initializer=_init,
                                 initargs=(os.environ["NAS_RANKING_ARGS"],)) as pool:
            futures = {pool.submit(_guarded, n, start, args.deadline): n for n in names}
            for fut in as_completed(futures):
                print(fut.result(), flush=True)


def _init(args: str) -> None:
    global STEPS, VALID, DATA_ROOT, OUT
    steps, valid, root, out = json.loads(args)
    STEPS, VALID, DATA_ROOT, OUT = steps, valid, Path(root) if root else None, Path(out)


def _guarded(name: str, start: float, deadline: float | None) -> str:
    if deadline is not None and time.time() - start > deadline:
        return f"{name}: skipped (deadline)"
    try:
        return run_job(name)
    except Exception as e:  # noqa: BLE001 - one job's failure is reported, the others go on
        import traceback

        return f"{name}: FAILED {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"


if __name__ == "__main__":
    main()
