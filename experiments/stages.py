"""Scalable Transformers' three-stage training on Multi30k En->De (Table 1's direction, at CPU scale).

Run: ``python experiments/stages.py [--joint 300] [--rest 300] [--seq-sentences 12000]``

Three type-1 supernets (``search_spaces/scalable_type1.yaml``: C in {32, 64, 96, 128}, FFN 4C) with
the same total number of optimizer steps, ``joint + rest``:

- ``stage 1``: joint training throughout (``joint + rest`` joint steps);
- ``stage 1+2``: ``joint`` joint steps, then ``rest`` word-level self-distillation steps (eq. 5);
- ``stage 1+2+3``: ``joint`` joint steps, ``rest / 2`` word-level, then ``rest / 2`` sequence-level
  self-distillation steps (eq. 6) on the widest's beam-search translations (beam 4, length penalty
  0.6) of the first ``--seq-sentences`` training sources.

The first ``joint`` steps are the same in all three (same seed, same batches, exact resume), so they
are trained once and copied. Each run scores the reference sub-Transformers (narrowest C32, middle
C96, widest C128) on the validation set (beam 4) at the end of every stage. The table printed at
the end is what the README and the closing note report; the raw metrics go to ``<out>/results.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nas.builders import prepare_sweep_data  # noqa: E402
from nas.space import parse_spec  # noqa: E402
from trainers import train_supernet  # noqa: E402

REFS = ("narrowest", "middle", "widest")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--yaml", default="search_spaces/scalable_type1.yaml")
    ap.add_argument("--joint", type=int, default=300, help="joint steps shared by the three runs")
    ap.add_argument("--rest", type=int, default=300, help="steps after the shared joint ones (even)")
    ap.add_argument("--seq-sentences", type=int, default=12000, help="training sources translated for stage 3")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--valid-pairs", type=int, default=None, help="validation pairs scored (default: all 1014)")
    ap.add_argument("--out", default="experiments/out/stages")
    args = ap.parse_args()
    out = Path(args.out)
    raw = yaml.safe_load(Path(args.yaml).read_text())
    raw["train"] = {**raw["train"], "precision": args.precision, "checkpoint_every": 50, "log_every": 25,
                    "keep_last": 0}
    raw["train"].pop("steps", None)
    if args.valid_pairs:
        raw["data"] = {**raw["data"], "max_valid_pairs": args.valid_pairs}
    half = args.rest // 2
    seq = {"name": "seq_distill", "steps": args.rest - half, "max_sentences": args.seq_sentences}
    plans = {
        "stage 1": [{"name": "joint", "steps": args.joint + args.rest}],
        "stage 1+2": [{"name": "joint", "steps": args.joint}, {"name": "word_distill", "steps": args.rest}],
        "stage 1+2+3": [{"name": "joint", "steps": args.joint}, {"name": "word_distill", "steps": half}, seq],
    }
    spec_of = lambda stages: parse_spec({**raw, "train": {**raw["train"], "stages": stages}}, args.yaml)
    data = prepare_sweep_data(spec_of(plans["stage 1"]))
    shared = out / "joint"
    t0 = time.perf_counter()
    train_supernet(spec_of([{"name": "joint", "steps": args.joint}]), data, shared)
    timings = {"shared joint": time.perf_counter() - t0}
    results = {}
    for name, stages in plans.items():
        folder = out / name.replace(" ", "_").replace("+", "-")
        if not folder.exists():
            shutil.copytree(shared, folder)
            (folder / "metrics.json").unlink()  # the shared run's end: continue from its checkpoint
        t0 = time.perf_counter()
        results[name] = train_supernet(spec_of(stages), data, folder).metrics
        timings[name] = time.perf_counter() - t0
        print(f"{name}: done in {timings[name] / 60:.1f} min", file=sys.stderr, flush=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results, "seconds": timings},
                                                 indent=2))
    print(f"\nMulti30k En->De validation BLEU (chrF) after {args.joint + args.rest} steps, type-1 supernet "
          f"(C32 / C96 / C128; {args.precision}; stage 3 on {args.seq_sentences} distilled sources)")
    print("| training | " + " | ".join(REFS) + " |")
    print("| --- |" + " --- |" * len(REFS))
    for name, metrics in results.items():
        last = max(int(k[5]) for k in metrics if k.startswith("stage") and k.endswith("_bleu_widest"))
        cells = [f"{metrics[f'stage{last}_bleu_{r}']:.2f} ({metrics[f'stage{last}_chrf_{r}']:.2f})" for r in REFS]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nminutes: " + ", ".join(f"{k} {v / 60:.1f}" for k, v in timings.items()))


if __name__ == "__main__":
    main()
