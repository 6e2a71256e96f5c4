"""Both latency engines on the level-2 archs of a finished sweep (issue 41): does the engine a user deploys with
change which archs meet the budget, or the order of the front?

For each trial of the sweep (its arch, BLEU and the ``latency_ratio`` it logged), the arch cropped from the sweep's
supernet is timed against the sweep's reference arch (``search.latency_reference``) with
:func:`nas.eval.latency.measure_latency_ratio` twice: on PyTorch (our beam search, the default engine) and on the
exported ONNX translator (``search.latency_engine: onnxruntime``), same workload (``search.latency_workload``), same
rounds, one thread; the engine that goes first alternates from arch to arch. One JSON per arch is written as it
finishes (a rerun skips those), then ``results.md`` / ``results.json``: each arch's ratios, whether it meets the
sweep's ``search.constraints`` on each engine, the feasible Pareto front (BLEU up, ratio down) on each, and Kendall
tau between the two engines' ratios.

    python experiments/latency_engines.py search_spaces/quickstart.yaml --out experiments/latency_engines/quickstart

Run it alone on the machine: both engines are timed in this process, one after the other.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _trials(spec, sweep_id: str | None) -> list[dict]:
    """The FINISHED trial runs of the sweep (the newest sweep of the experiment unless ``sweep_id``)."""
    from nas import tracking
    from nas.search.runner import read_sweep_record

    if sweep_id is None:
        record = read_sweep_record(spec.run_dir)
        if record is None:
            raise SystemExit(f"no sweep under {spec.run_dir}: run `nas sweep` first or pass --sweep-id")
        sweep_id = record.sweep_id
    runs = [r for r in tracking.find_runs(spec.experiment, role="trial", sweep_id=sweep_id)
            if r.info.status == "FINISHED" and "latency_ratio" in r.data.metrics]
    if not runs:
        raise SystemExit(f"sweep {sweep_id} of experiment {spec.experiment!r} has no finished trial with a ratio")
    return [{"run_id": r.info.run_id, "arch": r.data.tags["nas.arch_summary"], "bleu": r.data.metrics["bleu"],
             "trial_ratio": r.data.metrics["latency_ratio"], "metrics": dict(r.data.metrics)} for r in runs]


def _front(rows: list[dict], key: str) -> list[str]:
    """Archs of the feasible Pareto front (BLEU up, ``key`` down), by ratio."""
    feasible = [r for r in rows if r[f"feasible_{key}"]]
    front = [r for r in feasible if not any(
        o["bleu"] >= r["bleu"] and o[key] <= r[key] and (o["bleu"] > r["bleu"] or o[key] < r[key]) for o in feasible)]
    return [r["arch"] for r in sorted(front, key=lambda r: r[key])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sweep-id", default=None)
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default: search.latency_repeats)")
    args = parser.parse_args(argv)

    import torch
    from scipy.stats import kendalltau

    from nas.builders import build_space, prepare_sweep_data
    from nas.eval.latency import measure_latency_ratio, resolve_reference
    from nas.export.latency_engine import onnx_runner
    from nas.model.io import load_model
    from nas.model.supernet import extract
    from nas.search.trials import feasibility
    from nas.space import load_spec
    from nas.space.arch import Arch
    from nas.space.predictor_file import workload_of

    spec = load_spec(args.spec)
    trials = _trials(spec, args.sweep_id)
    data = prepare_sweep_data(spec, progress=False)
    supernet = load_model(spec.run_dir / "supernet", "supernet").eval()
    reference = resolve_reference(spec, build_space(spec))
    reference_model = extract(supernet, reference).eval()
    workload, rounds = workload_of(spec.search), args.rounds or spec.search.latency_repeats
    runner = onnx_runner(data.spm_model, threads=1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "archs").mkdir(exist_ok=True)
    torch.set_num_threads(1)
    rows = []
    try:
        for i, trial in enumerate(trials):
            arch = Arch.parse(trial["arch"])
            path = args.out / "archs" / f"{arch.arch_id}.json"
            if path.is_file():
                rows.append(json.loads(path.read_text()))
                continue
            sub = extract(supernet, arch).eval()
            measured = {}
            for engine in (("torch", "onnxruntime") if i % 2 == 0 else ("onnxruntime", "torch")):
                t0 = time.perf_counter()
                m = measure_latency_ratio(sub, arch, reference_model, reference, workload=workload, rounds=rounds,
                                          threads=1, runner=runner if engine == "onnxruntime" else None)
                measured[engine] = {**m, "seconds": round(time.perf_counter() - t0, 1)}
            row = {**trial, "arch_id": arch.arch_id, "torch": measured["torch"], "onnxruntime": measured["onnxruntime"],
                   "ratio_torch": measured["torch"]["latency_ratio"],
                   "ratio_onnxruntime": measured["onnxruntime"]["latency_ratio"]}
            path.write_text(json.dumps(row, indent=1) + "\n")
            print(f"{trial['arch']}: torch {row['ratio_torch']:.3f}x, onnxruntime {row['ratio_onnxruntime']:.3f}x "
                  f"(trial {trial['trial_ratio']:.3f}x)", flush=True)
            rows.append(row)
    finally:
        runner.close()
    for row in rows:
        for engine in ("torch", "onnxruntime"):
            row[f"feasible_ratio_{engine}"] = feasibility(  # the trial's other metrics (params_m, ...) as logged
                {**row["metrics"], "latency_ratio": row[f"ratio_{engine}"],
                 "latency_ms": row[engine]["latency_ms"]}, spec).get("feasible", 1.0) == 1.0
    rows.sort(key=lambda r: -r["bleu"])
    tau = kendalltau([r["ratio_torch"] for r in rows], [r["ratio_onnxruntime"] for r in rows])
    fronts = {e: _front(rows, f"ratio_{e}") for e in ("torch", "onnxruntime")}
    cpu = subprocess.run("lscpu | grep 'Model name' | cut -d: -f2", shell=True, capture_output=True,
                         text=True).stdout.strip()
    bf16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else False
    summary = {"spec": str(args.spec), "experiment": spec.experiment, "workload": workload, "rounds": rounds,
               "reference": reference.summary(), "constraints": list(spec.search.constraints),
               "cpu": cpu, "avx512_bf16": bf16, "python": platform.python_version(), "torch": torch.__version__,
               "kendall_tau": tau.statistic, "tau_p": tau.pvalue, "fronts": fronts,
               "feasible": {e: [r["arch"] for r in rows if r[f"feasible_ratio_{e}"]] for e in ("torch", "onnxruntime")},
               "rows": rows}
    (args.out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [f"# Latency engines on the trials of `{args.spec}`", "",
             f"CPU: {cpu} ({'with' if bf16 else 'without'} avx512_bf16), 1 thread, {rounds} interleaved rounds per arch "
             f"and engine; workload {workload}; reference `{reference.summary()}`; constraints "
             f"{', '.join(spec.search.constraints) or 'none'}.", "",
             "| arch | BLEU | ratio (trial) | ratio torch | ratio onnxruntime | feasible torch | feasible onnxruntime |",
             "| --- | ---: | ---: | ---: | ---: | :---: | :---: |"]
    for r in rows:
        lines.append(f"| `{r['arch']}` | {r['bleu']:.2f} | {r['trial_ratio']:.3f} | {r['ratio_torch']:.3f} | "
                     f"{r['ratio_onnxruntime']:.3f} | {'yes' if r['feasible_ratio_torch'] else 'no'} | "
                     f"{'yes' if r['feasible_ratio_onnxruntime'] else 'no'} |")
    same_set = set(summary["feasible"]["torch"]) == set(summary["feasible"]["onnxruntime"])
    lines += ["", f"Kendall tau between the engines' ratios: {tau.statistic:.3f} (p {tau.pvalue:.3f}).",
              f"Feasible set {'unchanged' if same_set else 'changed'} by the engine; front (by ratio): "
              f"torch {fronts['torch']}, onnxruntime {fronts['onnxruntime']} "
              f"({'same' if fronts['torch'] == fronts['onnxruntime'] else 'different'} order)."]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
