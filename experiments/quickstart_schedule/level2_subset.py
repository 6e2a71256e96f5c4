"""Can level 2 score its trials on the first N validation sentences instead of all 1,014?

Level 2 scores each of its ``search.trials`` archs by beam-4 BLEU on the validation set
(``search.valid_sentences``: all of them by default), then keeps the feasible Pareto front; the exported model is
scored again on test2016. Decoding is most of a level-2 trial. This script takes the archs level 2 chooses among,
the first ``--archs`` candidates of a finished sweep's level-1 study in level 2's own order
(:func:`nas.search.evolution.select_level2`: the feasible first Pareto front, then the next fronts), translates
the whole validation set with each arch's inherited weights (beam 4, as level 2) once, and scores the first N
translations for each N in ``SUBSETS`` and all of them. It prints

- Kendall tau (scipy) of BLEU on the first N against BLEU on all, with a 95% bootstrap interval over the archs;
- level 2's choice in miniature: over ``DRAWS`` random groups of 8 of these archs (seeded), how often the arch with
  the best BLEU on the first N is the one with the best BLEU on all, and the mean and worst BLEU (on all) lost by
  choosing on the first N.

Each arch's BLEU and chrF at every N are appended to ``--out`` (JSON lines) as they come, so a rerun continues.

    python experiments/quickstart_schedule/level2_subset.py search_spaces/quickstart.yaml \
        --sweep-dir nas_runs/quickstart --data nas_runs/data/<hash> --out level2_subset.jsonl --archs 32
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SUBSETS = (250, 500, 750)
BOOTSTRAP = 1000
DRAWS = 2000
GROUP = 8


def _candidates(spec, sweep_dir: Path, k: int):
    """The first ``k`` archs level 2 would take from the sweep's level-1 study, in its order."""
    from optuna.trial import TrialState

    from nas.search.evolution import ATTR_ARCH, level1_directions, select_level2
    from nas.search.level1 import level1_ref
    from nas.search.searcher import StudyRef
    from nas.space.arch import Arch

    journals = sorted(sweep_dir.glob("*.journal"))
    if not journals:
        raise SystemExit(f"no Optuna journal under {sweep_dir}; pass the sweep's folder (workdir/name)")
    journal = journals[0]
    import optuna

    names = [s.study_name for s in optuna.get_all_study_summaries(
        optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal))))]
    sweep_name = next(n for n in names if not n.endswith("-level1"))
    study = level1_ref(StudyRef(study_name=sweep_name, journal=journal)).load()
    trials = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    chosen = select_level2(trials, k, level1_directions(spec))
    return [Arch.parse(t.user_attrs[ATTR_ARCH]) for t in chosen], journal


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", type=Path)
    ap.add_argument("--sweep-dir", type=Path, required=True, help="the finished sweep's folder (workdir/name)")
    ap.add_argument("--data", type=Path, required=True, help="the sweep's prepared data (nas_runs/data/<hash>)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--archs", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import sacrebleu
    import torch

    from nas.data import PreparedData
    from nas.eval.validation import ValidationSet
    from nas.model.io import load_model
    from nas.space import load_spec

    torch.set_num_threads(args.threads)
    spec = load_spec(args.spec, check_files=False)
    archs, journal = _candidates(spec, args.sweep_dir, args.archs)
    supernet_dirs = [p.parent for p in args.sweep_dir.rglob("supernet.safetensors")]
    if not supernet_dirs:
        raise SystemExit(f"no supernet.safetensors under {args.sweep_dir}")
    model = load_model(supernet_dirs[0], "supernet").eval()
    data_root = args.data
    data = PreparedData.open(data_root.resolve())
    full = ValidationSet.load(data, None)
    print(f"{len(archs)} archs from {journal}; supernet {supernet_dirs[0]}; data {data_root}; "
          f"{len(full)} validation sentences", flush=True)
    done = {}
    if args.out.is_file():
        for line in args.out.read_text().splitlines():
            row = json.loads(line)
            done[row["arch_id"]] = row
    with args.out.open("a") as out:
        for i, arch in enumerate(archs):
            if arch.arch_id in done:
                continue
            start = time.monotonic()
            hyps = full.translate(model, arch, beam_size=spec.search.beam_size)
            row = {"arch_id": arch.arch_id, "arch": arch.summary(), "order": i}
            for n in (*SUBSETS, len(full)):
                key = "all" if n == len(full) else str(n)
                row[f"bleu_{key}"] = sacrebleu.corpus_bleu(hyps[:n], [full.refs[:n]]).score
                row[f"chrf_{key}"] = sacrebleu.corpus_chrf(hyps[:n], [full.refs[:n]]).score
            row["seconds"] = time.monotonic() - start
            out.write(json.dumps(row) + "\n")
            out.flush()
            done[arch.arch_id] = row
            print(f"{i + 1}/{len(archs)} {row['arch']}: BLEU {row['bleu_500']:.2f} (500) {row['bleu_all']:.2f} (all), "
                  f"{row['seconds']:.0f} s", flush=True)
    print()
    print(summarize([done[a.arch_id] for a in archs], args.seed, journal.name))


def summarize(rows: list[dict], seed: int, source: str) -> str:
    """The printed table of ``rows`` (one per arch, level 2's order): Kendall tau of each subset's BLEU against BLEU
    on all, with the percentile bootstrap interval of :func:`experiments.ground_truth.bootstrap_tau`, and the
    best-of-8 choice over ``DRAWS`` random groups (``random.Random(seed)``)."""
    from experiments.ground_truth import bootstrap_tau, kendall_tau

    full_bleu = [r["bleu_all"] for r in rows]
    rng = random.Random(seed)
    groups = [rng.sample(range(len(rows)), min(GROUP, len(rows))) for _ in range(DRAWS)]
    lines = [f"{len(rows)} archs level 2 would choose among (its order, {source}); BLEU spread on all "
             f"{min(full_bleu):.2f}-{max(full_bleu):.2f}",
             f"{'N':>6} {'tau vs BLEU on all':>24} {'same best of 8':>15} {'BLEU lost: mean':>16} {'worst':>6}"]
    for n in (*SUBSETS, "all"):
        sub = [r[f"bleu_{n}"] for r in rows]
        low, high = bootstrap_tau(sub, full_bleu, draws=BOOTSTRAP)
        same, lost = 0, []
        for g in groups:
            pick = max(g, key=lambda i: sub[i])
            best = max(g, key=lambda i: full_bleu[i])
            same += full_bleu[pick] == full_bleu[best]
            lost.append(full_bleu[best] - full_bleu[pick])
        tau = f"{kendall_tau(sub, full_bleu):.3f} [{low:.2f}, {high:.2f}]"
        lines.append(f"{str(n):>6} {tau:>24} {same / len(groups):>15.1%} {statistics.mean(lost):>16.2f} "
                     f"{max(lost):>6.2f}")
    return "\n".join(lines)

if __name__ == "__main__":
    main()
