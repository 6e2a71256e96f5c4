"""Proof of value on one GPU: every final model of ``experiments/proof_of_value.py`` at Transformer-Tiny's full
budget, 8,000 updates of 4,096 tokens (Wu et al., ACL 2021), as parallel processes on the one GPU.

The archs are the ones found on the CPU: ``python experiments/proof_of_value.py --phase gpu_plan`` times the
baselines and every trial of the CPU search quietly, picks the best trial (inherited validation BLEU) under each
budget, and writes ``plan.json`` with the YAML, the data and the supernet into a folder that travels to the GPU
machine (``.povgpu/``, ignored by git). On that machine, from the repository root::

    python experiments/proof_of_value_gpu.py --plan .povgpu/plan.json --out "$OUT" --train-deadline-s 400

Each final model trains in its own process with the YAML's ``retrain:`` recipe (dropout 0.3, label smoothing 0.1,
the same learning-rate schedule and batches; from scratch, or from its inherited weights for ``init: inherited``),
``retrain.steps`` raised to the plan's ``steps`` and checkpoints every ``checkpoint_every`` steps, the newest
``average_last`` averaged (fairseq's ``average_checkpoints``). A model still training ``--train-deadline-s``
seconds after the start stops at its last hundredth step and says so (``steps_done`` < ``steps``): the device time
of a session is capped, and a shorter run is reported as such, never as the full budget.

Every model is scored on the validation set and on ``test_2016_flickr`` with beam ``search.beam_size``: sacrebleu
BLEU and chrF on raw text, and lowercased BLEU (sacrebleu ``lowercase=True``, 13a tokenization), the nearest
sacrebleu gives to the tokenized lowercased BLEU that Wu et al. report (41.02 for Transformer-Tiny; theirs is
multi-bleu on Moses-tokenized text, so the two differ by tokenization). Searched models add the test scores of
their inherited weights (the supernet's crop, no retraining). ``--out`` gets ``results.json`` (rewritten as each
model finishes, so a kill keeps what finished) and ``workers.log``; ``proof_of_value.py --phase gpu_report`` turns
them into the report. Latency is not measured here: ``latency_ms`` is a function of the arch and the device, and
the plan's are the CPU's quiet ones.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

POLL_S = 5.0


class _Deadline(Exception):
    """Raised from the training hook when ``--train-deadline-s`` has passed (carries the step reached)."""

    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.step = step


def _spec(plan: dict[str, Any], entry: dict[str, Any]):
    """The plan's YAML with this model's recipe: the plan's steps and checkpoints, the entry's seed and init."""
    from nas.space import load_spec

    base = ROOT / plan["yaml"]
    spec = load_spec(base)
    retrain = spec.retrain.model_copy(update={"steps": plan["steps"], "checkpoint_every": plan["checkpoint_every"],
                                              "average_last": plan["average_last"], "seed": entry["seed"],
                                              "init": entry["init"]})
    return spec.model_copy(update={"retrain": retrain})


def _lines(path: Path) -> list[str]:
    import gzip

    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def _scores(model, arch, vset, beam: int) -> dict[str, float]:
    import sacrebleu
    import torch

    from nas.eval.scores import corpus_scores

    with torch.no_grad():
        hyps = vset.translate(model, arch, beam)
    s = corpus_scores(hyps, list(vset.refs))
    lc = sacrebleu.corpus_bleu(hyps, [list(vset.refs)], lowercase=True).score
    return {"bleu": float(s.bleu), "chrf": float(s.chrf), "bleu_lc": float(lc)}


def run_worker(plan_path: Path, key: str, tmp: Path, deadline_at: float, device: str) -> dict[str, Any]:
    """Train, average and score one final model of the plan; returns (and writes ``<tmp>/<key>.json``) its row."""
    import torch

    from nas.builders import prepare_sweep_data
    from nas.eval.validation import ValidationSet
    from nas.model.io import load_model
    from nas.model.supernet import SuperTransformer, count_params, extract
    from nas.retraining import _arch_config
    from nas.space.arch import Arch
    from trainers import train_standalone
    from trainers.average import SNAPSHOTS, average_snapshots, latest_snapshots

    plan = json.loads(plan_path.read_text(encoding="utf-8"))
    entry = next(e for e in plan["models"] if e["key"] == key)
    spec = _spec(plan, entry)
    torch.set_num_threads(1)
    data = prepare_sweep_data(spec, progress=False)
    recipe = spec.retrain.resolved(spec)
    arch = Arch.from_dict(entry["arch"])
    torch.manual_seed(recipe["seed"])
    supernet_dir = ROOT / plan["supernet_dir"]
    if recipe["init"] == "inherited":
        model = extract(load_model(supernet_dir, "supernet"), arch)
    else:
        model = SuperTransformer.from_config(_arch_config(spec, data.vocab_size, arch))
    model.dropout_rate = recipe["dropout"]
    steps, every = recipe["steps"], recipe["checkpoint_every"]
    folder = tmp / key.replace("/", "__")
    t0 = time.perf_counter()

    def on_eval(step: int) -> None:
        if step % 1000 == 0:
            print(f"{key}: step {step}/{steps}, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        if time.time() > deadline_at and step < steps:
            raise _Deadline(step)

    try:
        stats = train_standalone(model, arch, spec.retrain.training_spec(spec), data, steps, device=device,
                                 lr=recipe["lr"], warmup_steps=recipe["warmup_steps"], eval_every=100,
                                 on_eval=on_eval, checkpoint_dir=folder, checkpoint_every=every,
                                 keep_last=recipe["average_last"])
        steps_done = steps
    except _Deadline as stop:
        stats, steps_done = {}, stop.step
    train_seconds = time.perf_counter() - t0
    snaps = sorted((folder / SNAPSHOTS).glob("step_*"))
    averaged = min(recipe["average_last"], len(snaps))
    if averaged > 1:
        model.load_state_dict(average_snapshots(latest_snapshots(folder / SNAPSHOTS, averaged)))
    model.to(device).eval()
    beam = spec.search.beam_size
    valid = _scores(model, None, ValidationSet.load(data), beam)
    test_set = ValidationSet.from_text(_lines(ROOT / plan["test"][0]), _lines(ROOT / plan["test"][1]),
                                       data.tokenizer())
    test = _scores(model, None, test_set, beam)
    row = {**{k: v for k, v in entry.items() if k != "arch"}, "arch": arch.to_dict(),
           "steps": steps, "steps_done": steps_done, "averaged_snapshots": averaged,
           "train_seconds": train_seconds, "train_loss": stats.get("train_loss"),
           "params_m": count_params(model) / 1e6, "recipe": recipe, "device": torch.cuda.get_device_name()
           if device == "cuda" else device, **valid, **{f"test_{k}": v for k, v in test.items()}}
    if entry["kind"] != "baseline":
        supernet = load_model(supernet_dir, "supernet").to(device).eval()
        inh = _scores(supernet, arch, test_set, beam)
        row.update({f"inherited_test_{k}": v for k, v in inh.items()})
    row["wall_seconds"] = time.perf_counter() - t0
    (tmp / f"{folder.name}.json").write_text(json.dumps(row, indent=2), encoding="utf-8")
    return row


def run_all(plan_path: Path, out: Path, train_deadline_s: float, device: str, only: list[str] | None) -> None:
    """Prepare the data once, start one worker process per model, gather their rows into ``<out>/results.json``."""
    import tempfile

    from nas.builders import prepare_sweep_data

    start = time.time()
    plan = json.loads(plan_path.read_text(encoding="utf-8"))
    models = [e for e in plan["models"] if not only or e["key"] in only]
    out.mkdir(parents=True, exist_ok=True)
    prepare_sweep_data(_spec(plan, models[0]), progress=False)  # once, before the workers read the cache
    tmp = Path(tempfile.mkdtemp(prefix="povgpu-"))
    log = open(out / "workers.log", "a", encoding="utf-8")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    procs = {e["key"]: subprocess.Popen([sys.executable, __file__, "--plan", str(plan_path), "--worker", e["key"],
                                         "--tmp", str(tmp), "--deadline-at", str(start + train_deadline_s),
                                         "--device", device], stdout=log, stderr=subprocess.STDOUT, env=env)
             for e in models}
    print(f"{len(procs)} workers started, {time.time() - start:.0f} s after the start", file=sys.stderr, flush=True)
    rows: dict[str, dict[str, Any]] = {}
    while procs:
        time.sleep(POLL_S)
        for key, p in list(procs.items()):
            if p.poll() is None:
                continue
            del procs[key]
            f = tmp / (key.replace("/", "__") + ".json")
            if p.returncode == 0 and f.is_file():
                rows[key] = json.loads(f.read_text(encoding="utf-8"))
                r = rows[key]
                print(f"{key}: {r['steps_done']}/{r['steps']} steps, test BLEU {r['test_bleu']:.2f} "
                      f"(lc {r['test_bleu_lc']:.2f}), {time.time() - start:.0f} s", file=sys.stderr, flush=True)
            else:
                rows[key] = {"key": key, "failed": True, "returncode": p.returncode}
                print(f"{key}: FAILED (exit {p.returncode}); see workers.log", file=sys.stderr, flush=True)
            tmp_out = out / "results.json.tmp"
            tmp_out.write_text(json.dumps({"plan": plan.get("created"), "train_deadline_s": train_deadline_s,
                                           "models": [rows[k] for k in sorted(rows)]}, indent=2), encoding="utf-8")
            os.replace(tmp_out, out / "results.json")
    log.close()
    print(f"all done, {time.time() - start:.0f} s", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", required=True, help="plan.json written by proof_of_value.py --phase gpu_plan")
    ap.add_argument("--out", default=None, help="folder of results.json and workers.log")
    ap.add_argument("--train-deadline-s", type=float, default=400.0,
                    help="seconds after the start at which a model still training stops (default 400)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", nargs="*", default=None, help="these model keys only")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline-at", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        run_worker(Path(args.plan), args.worker, Path(args.tmp), args.deadline_at, args.device)
    else:
        run_all(Path(args.plan), Path(args.out), args.train_deadline_s, args.device, args.only)


if __name__ == "__main__":
    main()
