"""Does level 1's score on fewer validation sentences rank sub-Transformers as it does on more?

Level 1 scores each candidate by its inherited-weight validation loss on the first ``search.evolution.
subset_sentences`` validation pairs; level 2 scores its trials by BLEU (beam 4) on the whole validation set. This
script draws ``--archs`` archs uniformly from the YAML's space (seed ``--seed``, the narrowest and widest added),
scores each with the trained supernet's inherited weights on the first 50, 100, 200 sentences and on all of them
(loss), and by beam-4 BLEU on all of them, and prints Kendall tau (scipy) of each subset's loss against the
full-set loss and against full-set BLEU (loss ascending, BLEU descending: a tau near 1 means the same order).
Each arch's figures are appended to ``--out`` (JSON lines) as they come, so a rerun continues.

    python experiments/quickstart_schedule/subset_agreement.py search_spaces/quickstart.yaml \
        --data nas_runs/data/<hash> --supernet DIR --out subset_agreement.jsonl --archs 40
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SUBSETS = (50, 100, 200)
BOOTSTRAP = 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", type=Path)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--supernet", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--archs", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    from scipy.stats import kendalltau

    from nas.builders import build_space
    from nas.data import PreparedData
    from nas.eval.validation import ValidationSet, validation_scores
    from nas.model.io import load_model
    from nas.space import load_spec

    torch.set_num_threads(args.threads)
    spec = load_spec(args.spec, check_files=False)
    space = build_space(spec)
    data = PreparedData.open(args.data.resolve())
    model = load_model(args.supernet, "supernet").eval()
    rng = random.Random(args.seed)
    archs = [space.narrowest(), space.widest()] + [space.sample(rng) for _ in range(args.archs)]
    seen, unique = set(), []
    for arch in archs:
        if arch.arch_id not in seen:
            seen.add(arch.arch_id)
            unique.append(arch)
    sets = {n: ValidationSet.load(data, n) for n in SUBSETS}
    full = ValidationSet.load(data, None)
    done = {}
    if args.out.is_file():
        for line in args.out.read_text().splitlines():
            row = json.loads(line)
            done[row["arch_id"]] = row
    with args.out.open("a") as out:
        for i, arch in enumerate(unique):
            if arch.arch_id in done:
                continue
            start = time.monotonic()
            row = {"arch_id": arch.arch_id, "arch": arch.summary()}
            for n, vset in sets.items():
                row[f"loss_{n}"] = validation_scores(model, arch, vset, beam_size=None, loss=True,
                                                     max_tokens=spec.train.max_tokens)["valid_loss"]
            scores = validation_scores(model, arch, full, beam_size=4, loss=True, max_tokens=spec.train.max_tokens)
            row.update(loss_full=scores["valid_loss"], bleu_full=scores["bleu"], seconds=time.monotonic() - start)
            out.write(json.dumps(row) + "\n")
            out.flush()
            done[arch.arch_id] = row
            print(f"{i + 1}/{len(unique)} {row['arch']}: loss {row['loss_100']:.3f} (100) {row['loss_full']:.3f} "
                  f"(all), BLEU {row['bleu_full']:.2f}, {row['seconds']:.0f} s", flush=True)
    rows = [done[a.arch_id] for a in unique]
    full_loss = [r["loss_full"] for r in rows]
    bleu = [-r["bleu_full"] for r in rows]  # lower is better, as the loss
    print(f"\n{len(rows)} archs (seed {args.seed}); Kendall tau of the loss on the first N validation sentences:")
    print(f"{'N':>6} {'vs loss on all':>22} {'vs BLEU on all':>22}   (95% bootstrap interval over archs, "
          f"{BOOTSTRAP} resamples)")
    boot = random.Random(args.seed)
    draws = [[boot.randrange(len(rows)) for _ in rows] for _ in range(BOOTSTRAP)]

    def tau(a: list[float], b: list[float]) -> str:
        taus = sorted(kendalltau([a[i] for i in d], [b[i] for i in d]).statistic for d in draws)
        low, high = taus[int(0.025 * BOOTSTRAP)], taus[int(0.975 * BOOTSTRAP) - 1]
        return f"{kendalltau(a, b).statistic:.3f} [{low:.2f}, {high:.2f}]"

    for n in (*SUBSETS, "full"):
        loss = [r[f"loss_{n}"] for r in rows]
        print(f"{str(n):>6} {tau(loss, full_loss):>22} {tau(loss, bleu):>22}")


if __name__ == "__main__":
    main()
