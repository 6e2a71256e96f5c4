"""The latency predictor's error on unseen archs against the number of samples it is fitted on (issue 40 part 3:
fewer predictor samples for the quickstart). For each stored sample file and each training size n, 40 seeded random
splits: a ridge predictor (the default, ``LatencyPredictor(hidden_layers=0, ridge=3)``) fitted on n samples, its
mean absolute percentage error of the ratio on the rest. CPU only, a few seconds; nothing is timed.

    .venv/bin/python experiments/quickstart_schedule/predictor_samples_curve.py \
        experiments/quickstart_schedule/latency_samples_avx2_real.json \
        experiments/latency_predictor/samples_2026-12-01.json experiments/two_level/predictor_samples.json
"""
import json, random, statistics, sys
from pathlib import Path
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks")); sys.path.insert(0, str(ROOT))
from bench_predictor import as_ratio_samples
from nas.eval.latency import LatencyPredictor
for path in sys.argv[1:]:
    samples = as_ratio_samples(json.load(open(path)))
    row = []
    for n in (12, 16, 20, 24, 28, 32):
        errs = []
        for seed in range(40):
            order = list(range(len(samples))); random.Random(seed).shuffle(order)
            train = [samples[i] for i in order[:n]]; test = [samples[i] for i in order[n:]]
            p = LatencyPredictor(int(samples[0].get("model_dim", 128)), workload=train[0]["workload"], hidden_layers=0, ridge=3.0)
            p.fit(train, holdout=0.0)
            errs += [abs(p.predict_ratio(s["arch"]) - s["latency_ratio"]) / s["latency_ratio"] for s in test]
        row.append(f"{n}: {100*statistics.fmean(errs):.2f}")
    print(path.split("/")[-1], len(samples), "  ".join(row))
