"""Supernet step time of a training recipe against today's, side by side in one process (issue 27's 1.1x goal).

Builds the YAML's supernet once per recipe (same seed, same initial weights), then times optimizer steps of the
joint stage (forward and backward of the sandwich, clipping, Adam; the YAML's precision, bf16 on a CPU that has it) on the same real batches, the recipes in
interleaved rounds so that a machine's drift hits both alike. Prints each recipe's median step time and its
ratio to the first recipe (``today``).

    python benchmarks/bench_recipe_step.py search_spaces/quickstart.yaml --data nas_runs/data/<hash> --threads 2
    python benchmarks/bench_recipe_step.py search_spaces/unified.yaml --data nas_runs/data/<hash> \
        --recipe chosen='{"inplace_distill": true, "balanced_sampling": true, "dropout_range": [0, 0.1]}' \
        --supernet-set '{"share_layouts": false}'
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHOSEN = {"inplace_distill": True, "balanced_sampling": True, "dropout_range": [0.0, 0.1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", type=Path)
    ap.add_argument("--data", type=Path, required=True, help="a prepared data folder (nas_runs/data/<hash>)")
    ap.add_argument("--recipe", action="append", default=[],
                    help="NAME=JSON train overrides (default: chosen=the chosen recipe)")
    ap.add_argument("--supernet-set", default="{}", help="JSON supernet overrides of the compared recipes")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per recipe per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    import yaml

    from nas.builders import build_supernet
    from nas.precision import autocast_for, resolve_precision
    from nas.data import PreparedData, TokenBatcher
    from nas.space import parse_spec
    from nas.space.space import SearchSpace
    from nas.data import Tokenizer
    from trainers.engine import optimizer_step
    from trainers.optim import make_optimizer, make_scheduler
    from trainers.stages import SandwichArchs, StageContext, StepInfo, build_stage

    torch.set_num_threads(args.threads)
    raw = yaml.safe_load(args.spec.read_text())
    recipes = {"today": ({}, {})}
    for item in args.recipe or [f"chosen={json.dumps(CHOSEN)}"]:
        name, _, text = item.partition("=")
        recipes[name] = (json.loads(text), json.loads(args.supernet_set))
    root = args.data
    data = PreparedData(root, root / "spm.model", root / "train.arrow", root / "valid.parquet",
                        Tokenizer(root / "spm.model").vocab_size)
    batches = list(TokenBatcher(data.corpus("train"), raw["train"].get("max_tokens", 4096), shuffle=True,
                                seed=0).batches(0))[: args.steps]
    built = {}
    for name, (train, supernet) in recipes.items():
        spec = parse_spec({**raw, "train": {**raw["train"], **train},
                           "supernet": {**raw["supernet"], **supernet}})
        torch.manual_seed(0)
        model = build_supernet(spec, data.vocab_size).train()
        space = SearchSpace.from_spec(spec)
        optimizer = make_optimizer(model, spec.train.lr, 0.0)
        scheduler = make_scheduler(optimizer, spec.train.warmup_steps, [10 ** 6])
        precision = resolve_precision(spec.train.precision, "cpu")
        stage = build_stage("joint", StageContext(spec, SandwichArchs(space, random.Random(0), spec.train.sandwich_k,
                                                                      balanced=spec.train.balanced_sampling),
                                                  autocast_for(precision, "cpu")))
        built[name] = (model, optimizer, scheduler, stage)
    times: dict[str, list[float]] = {name: [] for name in recipes}
    step = 0
    for r in range(args.rounds + 1):  # round 0 warms up, untimed
        for name, (model, optimizer, scheduler, stage) in built.items():
            t0 = time.perf_counter()
            for i, batch in enumerate(batches):
                optimizer.zero_grad(set_to_none=True)
                stage.step(model, [batch], StepInfo(step + i, batch.ntokens))
                optimizer_step(model, optimizer, scheduler, 1.0, "bench")
            if r:
                times[name].append((time.perf_counter() - t0) / len(batches))
        step += len(batches)
    base = statistics.median(times["today"])
    print(f"{args.spec.name}, {args.threads} threads, {len(batches)} steps x {args.rounds} rounds, {precision}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:>10}: {1000 * med:8.1f} ms/step  ({med / base:.3f}x today)  {json.dumps(recipes[name][0])}")


if __name__ == "__main__":
    main()
