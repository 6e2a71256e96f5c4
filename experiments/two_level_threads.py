"""Feasible sets of the quickstart's level-2 archs at 1 and at 2 threads (fixed workload, ratio to the narrowest).

Run after `bash scripts/quickstart.sh` in a clone at /work/fresh (paths below); writes experiments/two_level/threads_check.json.
"""
import json, sys, glob, statistics
sys.path.insert(0, "/work/fresh")
import torch
from nas.space import load_spec
from nas.space.space import SearchSpace
from nas.space.arch import Arch
from nas.model.io import load_model
from nas.model.supernet import extract
from nas.eval.latency import measure_fixed_latency, workload_of, resolve_reference
spec = load_spec("/work/fresh/search_spaces/quickstart.yaml", check_files=False)
se = spec.search; w = workload_of(se)
model = load_model("/work/fresh/nas_runs/quickstart/supernet", "supernet")
space = SearchSpace.from_spec(spec)
ref = resolve_reference(spec, space)
archs = []
for f in sorted(glob.glob("/work/fresh/nas_runs/quickstart/trials/*/*.json")):
    archs.append(Arch.from_json(json.load(open(f))["arch"]))
out = {}
for threads in (1, 2):
    def t(a):
        return statistics.median(measure_fixed_latency(extract(model, a).eval(), a, src_tokens=w["src_tokens"], tgt_tokens=w["tgt_tokens"],
                                    beam_size=w["beam"], batch_size=w["batch"], repeats=se.latency_repeats, threads=threads) for _ in range(3))
    r = t(ref)
    ratios = {a.summary(): t(a) / r for a in archs}
    out[threads] = {"reference_ms": r, "ratios": ratios, "feasible": sorted(k for k, v in ratios.items() if v <= 1.25)}
    print(threads, "thread(s): reference", round(r, 2), "ms; feasible", len(out[threads]["feasible"]), "of", len(archs), flush=True)
print("same feasible set:", out[1]["feasible"] == out[2]["feasible"])
for k in out[1]["ratios"]:
    print(f"{out[1]['ratios'][k]:.3f} {out[2]['ratios'][k]:.3f}  {k}")
json.dump(out, open("/work/main/experiments/two_level/threads_check.json", "w"), indent=1)
