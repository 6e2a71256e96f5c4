"""Validation BLEU/chrF of the three reference sub-Transformers (narrowest, middle, widest) at each kept snapshot of
a `nas train` run: what the end-of-stage evaluation (`train.stage_eval`) prints, at earlier steps of the same run.

Under the quickstart's inverse-square-root schedule the learning rate at step s does not depend on the run's total
steps, so the snapshot at step s of a longer run is the supernet an s-step run would have ended with (same seed,
same batches; the last checkpoint's end-of-stage line checks this script against the trainer).

    python experiments/quickstart_schedule/snapshot_bleu.py SPEC.yaml RUN_DIR/supernet --data nas_runs/data/<hash> \
        [--set KEY=VALUE ...] --out FILE.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec", type=Path)
    ap.add_argument("supernet", type=Path, help="the run's supernet folder (holds snapshots/)")
    ap.add_argument("--set", action="append", default=[], help="the run's overrides, KEY=VALUE")
    ap.add_argument("--data", type=Path, required=True, help="the prepared data folder (nas_runs/data/<hash>)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True, help="JSON lines, one per snapshot (appended, resumable)")
    args = ap.parse_args()

    import torch
    from safetensors.torch import load_file

    from nas.builders import build_space
    from nas.eval.validation import ValidationSet
    from nas.data.prepared import PreparedData
    from nas.search.trials import load_supernet
    from nas.space.loader import load_spec
    from trainers.loop import _reference_scores

    torch.set_num_threads(args.threads)
    spec = load_spec(args.spec, overrides=args.set)
    space = build_space(spec)
    model = load_supernet(str(args.supernet))
    valid = ValidationSet.load(PreparedData.open(args.data))  # read once, scored at every snapshot
    done = set()
    if args.out.is_file():
        done = {json.loads(line)["step"] for line in args.out.read_text().splitlines() if line.strip()}
    for path in sorted((args.supernet / "snapshots").glob("step_*.safetensors")):
        step = int(path.stem.split("_")[1])
        if step in done:
            continue
        model.load_state_dict(load_file(str(path)))
        start = time.perf_counter()
        scores = _reference_scores(model, valid, space, spec.train.eval_beam_size)
        row = {"step": step, **{k: round(v, 2) for k, v in scores.items()}, "seconds": round(time.perf_counter() - start, 1)}
        print(json.dumps(row), flush=True)
        with args.out.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
