"""The latency predictor's cross-validated error, the linear model (ridge, the default) against HAT's MLP, on stored
latency samples, side by side.

Each file is a JSON list of samples (:func:`nas.eval.latency.collect_samples`: ``arch``, ``latency_ratio``, ...;
older files with ``latency_ms`` only are turned into ratios to their median). The samples are cut into ``--folds``
folds (seeded); each model is fitted on the other folds (:meth:`nas.eval.latency.LatencyPredictor.fit`, no holdout)
and predicts the fold. Prints the mean absolute percentage error (MAPE) of the ratio and the mean signed error (bias)
per model and file.

    python benchmarks/bench_predictor.py experiments/latency_predictor/samples_2026-12-01.json \\
        experiments/two_level/predictor_samples.json experiments/quickstart_2026-11-23/latency_b1.samples.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = {"linear (ridge 3)": {"hidden_layers": 0, "ridge": 3.0}, "MLP 3x64": {"hidden_layers": 3, "hidden": 64}}
"""Model name -> :class:`~nas.eval.latency.LatencyPredictor` arguments."""


def as_ratio_samples(samples: list[dict]) -> list[dict]:
    """Samples with ``latency_ratio``, ``latency_reference_ms`` and ``workload`` (older ms-only ones: ratios to the
    median ms, the workload from their batch and beam size)."""
    if all("latency_ratio" in s for s in samples):
        return samples
    median = statistics.median(s["latency_ms"] for s in samples)
    return [{**s, "latency_ratio": s["latency_ms"] / median, "latency_reference_ms": median,
             "workload": s.get("workload") or {"src_tokens": 30, "tgt_tokens": 30, "beam": s["beam_size"],
                                               "batch": s["batch_size"]}} for s in samples]


def cross_validate(samples: list[dict], folds: int, seed: int, **kwargs) -> tuple[float, float]:
    """(MAPE %, mean signed error %) of the ratio over ``folds`` folds."""
    from nas.eval.latency import LatencyPredictor

    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    errors = []
    for f in range(folds):
        test = set(order[f::folds])
        train = [samples[i] for i in order if i not in test]
        predictor = LatencyPredictor(int(samples[0].get("model_dim", 128)), workload=train[0]["workload"], **kwargs)
        predictor.fit(train, holdout=0.0)
        for i in sorted(test):
            predicted = predictor.predict_ratio(samples[i]["arch"])
            errors.append((predicted - samples[i]["latency_ratio"]) / samples[i]["latency_ratio"])
    return 100 * statistics.fmean(abs(e) for e in errors), 100 * statistics.fmean(errors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("samples", type=Path, nargs="+", help="latency sample JSON files")
    ap.add_argument("--folds", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"{args.folds}-fold cross-validated error of the predicted latency_ratio (MAPE %, bias %)")
    for path in args.samples:
        samples = as_ratio_samples(json.loads(path.read_text()))
        cells = []
        for name, kwargs in MODELS.items():
            mape, bias = cross_validate(samples, args.folds, args.seed, **kwargs)
            cells.append(f"{name}: {mape:5.2f} ({bias:+.2f})")
        print(f"  {path} ({len(samples)} samples): " + "   ".join(cells))


if __name__ == "__main__":
    main()
