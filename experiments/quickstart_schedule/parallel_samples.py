"""Can level 1's predictor samples be timed in two processes at once without moving the ratios?

Level 1 times ``search.evolution.predictor_samples`` archs (30 in the quickstart) one after the other at one
thread, each interleaved with the reference (:func:`nas.eval.latency.measure_latency_ratio`), while the second core
idles. This script times the same archs (those of a finished sweep's ``latency_samples.json``) with the sweep's
supernet three ways, in this order:

- ``alone_1``: one process, every arch in turn (as level 1 does today);
- ``pair``: two processes at once, each timing half of the archs (every other one);
- ``alone_2``: one process again, which gives the run-to-run spread of the ratio to compare ``pair`` with.

It prints the wall time of each, and per arch the ratio of each way, then the median and largest ``|pair / alone_1 -
1|`` beside those of ``|alone_2 / alone_1 - 1|``, and the mean of ``pair / alone_1 - 1`` (a bias: contention
slowing the larger archs more). Results go to ``--out`` (JSON), one key per way as it finishes; a rerun skips
the ways already there.

    python experiments/quickstart_schedule/parallel_samples.py search_spaces/quickstart.yaml \
        --sweep-dir nas_runs/quickstart --out parallel_samples.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _time(spec_path: str, supernet_dir: str, arch_dicts: list[dict], queue) -> None:
    """One process: each arch of ``arch_dicts`` timed against the sweep's reference, as level 1's samples are."""
    import torch

    from nas.builders import build_space
    from nas.eval.latency import measure_latency_ratio, workload_of
    from nas.eval.latency.samples import resolve_reference
    from nas.model.io import load_model
    from nas.model.supernet import extract
    from nas.space import load_spec
    from nas.space.arch import Arch

    torch.set_num_threads(1)
    spec = load_spec(Path(spec_path), check_files=False)
    space = build_space(spec)
    supernet = load_model(Path(supernet_dir), "supernet").eval()
    reference = resolve_reference(spec, space)
    reference_model = extract(supernet, reference)
    out = {}
    for d in arch_dicts:
        arch = Arch.from_dict(d)
        measured = measure_latency_ratio(extract(supernet, arch), arch, reference_model, reference,
                                         workload=workload_of(spec.search), rounds=spec.search.latency_repeats,
                                         threads=int(spec.search.cpu_per_trial))
        out[arch.arch_id] = measured["latency_ratio"]
    queue.put(out)


def _run(spec: Path, supernet: Path, parts: list[list[dict]]) -> tuple[dict[str, float], float]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    start = time.monotonic()
    procs = [ctx.Process(target=_time, args=(str(spec), str(supernet), part, queue)) for part in parts]
    for p in procs:
        p.start()
    ratios = {}
    for _ in procs:
        ratios.update(queue.get(timeout=3600))
    for p in procs:
        p.join()
    return ratios, time.monotonic() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", type=Path)
    ap.add_argument("--sweep-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    (samples_file,) = args.sweep_dir.glob("level1/*/latency_samples.json")
    archs = [s["arch"] for s in json.loads(samples_file.read_text())]
    supernet = args.sweep_dir / "supernet"
    result = json.loads(args.out.read_text()) if args.out.is_file() else {}
    plan = {"alone_1": [archs], "pair": [archs[0::2], archs[1::2]], "alone_2": [archs]}
    for name, parts in plan.items():
        if name in result:
            continue
        ratios, wall = _run(args.spec, supernet, parts)
        result[name] = {"wall_s": wall, "ratios": ratios}
        args.out.write_text(json.dumps(result, indent=1))
        print(f"{name}: {len(ratios)} archs in {wall:.1f} s ({len(parts)} process(es))", flush=True)
    base = result["alone_1"]["ratios"]
    ids = list(base)
    for other in ("pair", "alone_2"):
        devs = [result[other]["ratios"][i] / base[i] - 1 for i in ids]
        print(f"{other:>8} vs alone_1: |dev| median {statistics.median(abs(d) for d in devs):.1%}, "
              f"max {max(abs(d) for d in devs):.1%}, mean dev {statistics.mean(devs):+.1%}; wall "
              f"{result[other]['wall_s']:.1f} s against {result['alone_1']['wall_s']:.1f} s")


if __name__ == "__main__":
    main()
