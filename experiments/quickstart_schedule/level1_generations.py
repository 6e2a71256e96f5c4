"""How many NSGA-II generations does the quickstart's level 1 need?

Level 1 (``search.method: evolution``) scores ``population x generations`` candidates by inherited-weight
validation loss on ``subset_sentences`` sentences and a predicted latency ratio, and hands level 2 the
``search.trials`` archs of its feasible Pareto front (:func:`nas.search.evolution.select_level2`). The later
generations cost time (17-21 s a generation on a 2-core AVX2 CPU, about 10 s on a bf16 one), so this script asks what
a level 1 cut after ``g`` generations would have handed level 2, from a finished quickstart sweep:

- level 1's first ``g`` generations are those of the sweep's own level-1 study (the same seed, and a generation is
  asked only when the previous one is told, :class:`nas.search.level1.Level1Search`, so a run with fewer generations
  asks the same first ones);
- for each cutoff ``g``: the distinct archs scored so far (level 1's cost), the hypervolume of the feasible front of
  (level-1 score, predicted ratio) against the point (worst score of generation 0, the latency budget), the 8 archs
  level 2 would get and how many of them the full run's 8 share;
- each of those archs scored as level 2 scores it (beam-``search.beam_size`` BLEU on the first
  ``search.valid_sentences`` validation sentences, inherited weights), once, and for each cutoff the best BLEU
  among its 8 under the budget by predicted ratio (the exported model's choice) and the hypervolume of their
  (BLEU, predicted ratio) front against (the lowest BLEU of any scored arch, the budget).

Level 2 measures latency; this uses level 1's prediction (0-8% off the measurement in the AVX2 runs) so that the
result does not depend on a quiet machine. Each arch's BLEU is appended to ``--out`` (JSON lines) as it comes, so a
rerun continues.

    python experiments/quickstart_schedule/level1_generations.py runs/quickstart/sweep.yaml \
        --sweep-dir runs/quickstart --data nas_runs/data/<hash> --out level1_generations.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

GENERATION = "NSGAIISampler:generation"


def hypervolume(points: list[tuple[float, float]], ref: tuple[float, float]) -> float:
    """2-D hypervolume of ``points`` (both coordinates minimised) dominated within ``ref``: the first coordinate
    negated for :func:`experiments.search_value.hypervolume` (BLEU maximised, latency minimised)."""
    from experiments.search_value import hypervolume as bleu_latency_hypervolume

    return bleu_latency_hypervolume([(-x, y) for x, y in points], ref_latency=ref[1], ref_bleu=-ref[0])


def _level1(sweep_dir: Path):
    import optuna
    from optuna.trial import TrialState

    from nas.search.level1 import level1_ref
    from nas.search.searcher import StudyRef

    journal = sweep_dir / "optuna.journal"
    if not journal.is_file():
        raise SystemExit(f"no optuna.journal in {sweep_dir}; pass the sweep's folder (workdir/name)")
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    name = next(s.study_name for s in optuna.get_all_study_summaries(storage) if not s.study_name.endswith("-level1"))
    study = level1_ref(StudyRef(study_name=name, journal=journal)).load()
    return [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE], journal


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", type=Path, help="the sweep's YAML (its saved copy, workdir/name/sweep.yaml)")
    ap.add_argument("--sweep-dir", type=Path, required=True, help="the finished sweep's folder (workdir/name)")
    ap.add_argument("--data", type=Path, required=True, help="the sweep's prepared data (nas_runs/data/<hash>)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cutoffs", type=int, nargs="+", default=[3, 4, 5, 6, 7, 8, 10])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import sacrebleu
    import torch

    from nas.data import PreparedData
    from nas.eval.validation import ValidationSet
    from nas.model.io import load_model
    from nas.search.evolution import ATTR_ARCH, ATTR_RATIO, feasible, level1_directions, select_level2
    from nas.space import load_spec
    from nas.space.arch import Arch

    torch.set_num_threads(args.threads)
    spec = load_spec(args.spec, check_files=False)
    budget = next(c.bound for c in spec.search.parsed_constraints() if c.metric == "latency_ratio")
    trials, journal = _level1(args.sweep_dir)
    k = spec.search.trials
    directions = level1_directions(spec)
    generations = max(t.system_attrs[GENERATION] for t in trials) + 1
    ref = (max(t.values[0] for t in trials if t.system_attrs[GENERATION] == 0), budget)
    cut = {}
    for g in sorted({min(c, generations) for c in args.cutoffs}):
        sub = [t for t in trials if t.system_attrs[GENERATION] < g]
        chosen = select_level2(sub, k, directions)
        front = [(t.values[0], t.values[1]) for t in sub if feasible(t)]
        cut[g] = {"candidates": len(sub), "distinct": len({t.user_attrs[ATTR_ARCH] for t in sub}),
                  "hv_level1": hypervolume(front, ref),
                  "chosen": [(t.user_attrs[ATTR_ARCH], float(t.user_attrs[ATTR_RATIO])) for t in chosen]}

    model = load_model(next(p.parent for p in args.sweep_dir.rglob("supernet.safetensors")), "supernet").eval()
    vset = ValidationSet.load(PreparedData.open(args.data.resolve()), spec.search.valid_sentences)
    done = {}
    if args.out.is_file():
        done = {row["arch"]: row for row in map(json.loads, args.out.read_text().splitlines())}
    todo = sorted({a for c in cut.values() for a, _ in c["chosen"]} - set(done))
    print(f"{len(trials)} level-1 candidates in {generations} generations ({journal}); {len(todo)} archs to score "
          f"on {len(vset)} validation sentences, beam {spec.search.beam_size}", flush=True)
    with args.out.open("a") as out:
        for i, summary in enumerate(todo):
            start = time.monotonic()
            hyps = vset.translate(model, Arch.parse(summary), beam_size=spec.search.beam_size)
            row = {"arch": summary, "bleu": sacrebleu.corpus_bleu(hyps, [vset.refs]).score,
                   "seconds": round(time.monotonic() - start, 1)}
            out.write(json.dumps(row) + "\n")
            out.flush()
            done[summary] = row
            print(f"{i + 1}/{len(todo)} {summary}: BLEU {row['bleu']:.2f} ({row['seconds']:.0f} s)", flush=True)

    low = min(r["bleu"] for r in done.values())
    final = {a for a, _ in cut[max(cut)]["chosen"]}
    print(f"\nlevel 1 cut after g generations (of {generations}); level 2's {k} archs scored by BLEU on "
          f"{len(vset)} sentences, feasible by predicted ratio <= {budget:g}")
    print(f"{'g':>3} {'candidates':>10} {'distinct':>8} {'HV level 1':>10} {'shared with full':>16} "
          f"{'best feasible BLEU':>18} {'HV level 2':>10}")
    for g, c in cut.items():
        ok = [(done[a]["bleu"], r) for a, r in c["chosen"] if r <= budget]
        best = max((b for b, _ in ok), default=float("nan"))
        hv2 = hypervolume([(-b, r) for b, r in ok], (-low, budget))
        shared = len({a for a, _ in c["chosen"]} & final)
        print(f"{g:>3} {c['candidates']:>10} {c['distinct']:>8} {c['hv_level1']:>10.4f} {shared:>13}/{k} "
              f"{best:>18.2f} {hv2:>10.3f}")


if __name__ == "__main__":
    main()
