"""Level 1 of the two-level search without Ray: candidates per minute, and the fixed-length latency of archs.

What one level-1 candidate costs on a device (CPU threads or a GPU), measured apart from Ray Tune's
overhead: Optuna's NSGA-II (in memory) asks for fixed-length genes, the candidate is scored with inherited
weights (:func:`nas.eval.validation.validation_scores`: teacher-forced validation loss, or greedy BLEU, on
the first ``--subset`` validation sentences) and the latency predictor, and told. Prints candidates per
minute for each score, and the fixed-length ``latency_ms`` (``search.latency_workload``) of the narrowest,
the middle and the widest arch on the device.

With ``--train STEPS`` it first trains the YAML's supernet on the device (the GPU check of the two-level
search trains the quickstart supernet there, then scores level 1 on it) and keeps it under ``--out``.

    python benchmarks/bench_level1.py search_spaces/quickstart.yaml --data nas_runs/data/<hash> \
        --supernet nas_runs/quickstart/supernet --device cpu --threads 2 --candidates 200
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", type=Path)
    parser.add_argument("--data", type=Path, required=True, help="a prepared data folder (nas_runs/data/<hash>)")
    parser.add_argument("--supernet", type=Path, help="a trained supernet folder (supernet.safetensors)")
    parser.add_argument("--train", type=int, default=0, help="train the supernet for this many steps first")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--candidates", type=int, default=200, help="level-1 candidates per score")
    parser.add_argument("--subset", type=int, default=None, help="default: search.evolution.subset_sentences")
    parser.add_argument("--samples", type=int, default=None, help="predictor archs (default: predictor_samples)")
    parser.add_argument("--out", type=Path, required=True, help="JSON results (and the trained supernet) go here")
    args = parser.parse_args()

    import optuna
    import torch

    from nas.builders import build_space
    from nas.data import PreparedData
    from nas.eval.latency import (LatencyPredictor, collect_fixed_samples, describe_device, fit_predictor_file,
                                  measure_fixed_latency)
    from nas.eval.validation import ValidationSet, validation_scores
    from nas.model.io import load_model
    from nas.model.supernet import extract
    from nas.search.evolution import gene_choices, suggest_genes
    from nas.space import load_spec
    from nas.space.space import SearchSpace

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    spec = load_spec(args.spec, check_files=False)
    se, ev = spec.search, spec.search.evolution
    data = PreparedData.open(args.data.resolve())
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"spec": str(args.spec), "device": args.device, "threads": args.threads}
    supernet_dir = args.supernet
    if args.train:
        from trainers import train_supernet

        spec = spec.model_copy(update={"train": spec.train.model_copy(update={"steps": args.train})})
        supernet_dir = args.out / "supernet"
        if supernet_dir.exists():
            shutil.rmtree(supernet_dir)
        metrics: list[dict] = []
        t0 = time.perf_counter()
        train_supernet(spec, data, supernet_dir, report=metrics.append, progress=False, device=args.device)
        result["train"] = {"steps": args.train, "wall_s": time.perf_counter() - t0,
                           "final": {k: v for k, v in (metrics[-1] if metrics else {}).items()
                                     if isinstance(v, (int, float))}}
        print(f"trained {args.train} steps in {result['train']['wall_s']:.1f} s: {result['train']['final']}", flush=True)
    model = load_model(supernet_dir, "supernet").to(args.device).eval()
    space = SearchSpace.from_spec(spec)
    workload = dict(src_tokens=se.latency_workload.src_tokens, tgt_tokens=se.latency_workload.tgt_tokens,
                    beam_size=se.latency_workload.beam or se.beam_size, batch_size=se.latency_workload.batch)
    result["device_name"] = describe_device(args.device)

    lat = {}
    for name, arch in {"narrowest": space.narrowest(), "middle": space.middle(), "widest": space.widest()}.items():
        sub = extract(model, arch).to(args.device).eval()
        lat[name] = [measure_fixed_latency(sub, arch, **workload, repeats=se.latency_repeats, threads=args.threads)
                     for _ in range(3)]
        print(f"fixed-length latency {name}: {', '.join(f'{v:.2f}' for v in lat[name])} ms", flush=True)
    result["latency_ms"] = lat
    result["workload"] = workload

    t0 = time.perf_counter()
    samples = collect_fixed_samples(model, spec, args.samples or ev.predictor_samples, space=build_space(spec),
                                    threads=args.threads)
    predictor_path = args.out / "predictor.safetensors"
    fit = fit_predictor_file(samples, spec, predictor_path)
    predictor = LatencyPredictor.load(predictor_path)
    result["predictor"] = {"samples": len(samples), "wall_s": time.perf_counter() - t0, **fit}
    print(f"predictor: {result['predictor']}", flush=True)

    vset = ValidationSet.load(data, args.subset or ev.subset_sentences)
    genes = gene_choices(space)
    result["level1"] = {}
    for score in ("valid_loss", "greedy_bleu"):
        study = optuna.create_study(directions=["minimize" if score == "valid_loss" else "maximize", "minimize"],
                                    sampler=optuna.samplers.NSGAIISampler(population_size=ev.population, seed=0))
        per = []
        t0 = time.perf_counter()
        for _ in range(args.candidates):
            c0 = time.perf_counter()
            trial = study.ask()
            arch = suggest_genes(space, trial, genes)
            if score == "valid_loss":
                value = validation_scores(model, arch, vset, beam_size=None, loss=True,
                                          max_tokens=spec.train.max_tokens)["valid_loss"]
            else:
                value = validation_scores(model, arch, vset, beam_size=1, loss=False)["bleu"]
            ms = predictor.predict(arch)
            study.tell(trial, [value, ms])
            per.append(time.perf_counter() - c0)
        wall = time.perf_counter() - t0
        result["level1"][score] = {"candidates": args.candidates, "wall_s": wall,
                                   "candidates_per_min": 60 * args.candidates / wall,
                                   "median_s": statistics.median(per)}
        print(f"level 1 ({score}, {len(vset)} sentences): {args.candidates} "
              f"candidates in {wall:.1f} s = {60 * args.candidates / wall:.0f} per minute", flush=True)
    (args.out / "bench_level1.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    random.seed(0)
    main()
