"""Ground truth on one GPU: every arch of ``plan.json`` trained alone with Transformer-Tiny's recipe, all at once as
parallel processes, stopped at one common step count; beside them, optionally, the ``quickstart_depth`` supernet
trained on, its weights kept at fixed steps (the ranking curve of "The search finds what the space holds").

``python experiments/ground_truth.py --phase plan`` writes the plan (the archs, the recipe, the step target) and the
folder that travels (``.gtgpu/``, ignored by git: the YAML, the data and its cache). On the GPU machine, from the
repository root::

    python experiments/ground_truth_gpu.py --plan .gtgpu/plan.json --out "$OUT" --train-s 330 --score-s 120

**One step count for all.** The recipe's inverse-square-root schedule does not depend on the run's length, so a
run can be cut anywhere. Every arch trains towards the plan's ``steps``; every ``checkpoint_every`` steps (about one
epoch of 8,192-token batches) a weights-only snapshot is kept. From 90 s on, the driver projects each worker's finish
from its rate so far and, when the slowest would miss ``--train-s``, lowers the common target to the step all of them
reach (a multiple of ``checkpoint_every``; it is never raised). A worker stops at its first snapshot step past the
target and averages the ``average_last`` newest snapshots at or below it (fairseq ``average_checkpoints``: the last
epochs), so every arch is scored after the same number of updates. One still short of the target at ``--train-s``
stops at its newest snapshot and says so (``steps_done`` below ``steps_target``).

**Scores** (all on the GPU, beam ``recipe.beam_size`` with ``recipe.length_penalty``): test2016 sacreBLEU and chrF on
raw text and the hypotheses themselves (the paper-comparable BLEU, lowercased and Moses-tokenized, is computed from
them on the CPU: sacremoses is not on that machine), the validation loss, then validation BLEU and chrF while
``--score-s`` lasts. ``--out`` gets ``results.json`` (rewritten as each model finishes, so a kill keeps what finished)
and ``workers.log``, and with a supernet in the plan ``supernet_stepNNNNNN.safetensors`` (fp16 weights, the files
that come back from the device are at most 16 MB) at the plan's ``supernet.keep_steps``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

POLL_S = 5.0
PROBE_S = 90.0
"""Seconds after the workers start before the driver first projects their finish."""
SCORE_SENTENCES = 250
"""Sentences per beam-search batch when scoring (the library's default is 64): on a GPU shared by 30+ processes
every decoding step waits for the device, so 4 batches of the test set take 4 times fewer steps (1,000 sentences in
one batch ran 33 processes out of the GPU's memory)."""


class _Stop(Exception):
    """Raised from a training hook to stop a worker (the target was passed or the time is up)."""


def _spec(plan: dict[str, Any], seed: int):
    """The plan's YAML with the plan's recipe in ``retrain:`` and this model's seed."""
    from nas.space import load_spec

    spec = load_spec(ROOT / plan["yaml"])
    retrain = spec.retrain.model_copy(update={**plan["recipe"], "seed": seed, "init": "scratch"})
    return spec.model_copy(update={"retrain": retrain})


def _lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def _target(tmp: Path, planned: int) -> int:
    f = tmp / "target_steps"
    return int(f.read_text()) if f.is_file() else planned


def _snapshot_steps(folder: Path) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in folder.glob("step_*.safetensors"))


def run_worker(plan_path: Path, key: str, tmp: Path, train_end: float, score_end: float, device: str) -> None:
    """Train one arch of the plan until the common target (or ``train_end``), average, score; writes
    ``<tmp>/<key>.json``."""
    import sacrebleu
    import torch

    from nas.builders import prepare_sweep_data
    from nas.eval.validation import ValidationSet, validation_scores
    from nas.model.supernet import SuperTransformer, count_params
    from nas.retraining import _arch_config
    from nas.space.arch import Arch
    from trainers import train_standalone
    from trainers.average import SNAPSHOTS, average_snapshots

    plan = json.loads(plan_path.read_text(encoding="utf-8"))
    entry = next(e for e in plan["models"] if e["key"] == key)
    spec = _spec(plan, entry["seed"])
    torch.set_num_threads(1)
    data = prepare_sweep_data(spec, progress=False)
    recipe = spec.retrain.resolved(spec)
    arch = Arch.from_dict(entry["arch"])
    torch.manual_seed(recipe["seed"])
    model = SuperTransformer.from_config(_arch_config(spec, data.vocab_size, arch))
    model.dropout_rate = recipe["dropout"]
    planned, every = recipe["steps"], recipe["checkpoint_every"]
    folder = tmp / key
    progress = tmp / f"{key}.progress"
    t0 = time.perf_counter()

    def on_eval(step: int) -> None:
        progress.write_text(json.dumps({"step": step, "seconds": time.perf_counter() - t0}), encoding="utf-8")
        if step > _target(tmp, planned) or (time.time() > train_end and step < planned):
            raise _Stop()

    try:
        stats = train_standalone(model, arch, spec.retrain.training_spec(spec), data, planned, device=device,
                                 lr=recipe["lr"], warmup_steps=recipe["warmup_steps"], eval_every=every,
                                 on_eval=on_eval, checkpoint_dir=folder, checkpoint_every=every,
                                 keep_last=plan["keep_snapshots"])
    except _Stop:
        stats = {}
    (tmp / f"{key}.trained").touch()
    train_seconds = time.perf_counter() - t0
    target = _target(tmp, planned)
    snaps = [s for s in _snapshot_steps(folder / SNAPSHOTS) if s <= target]
    steps_done = snaps[-1] if snaps else 0
    use = snaps[-recipe["average_last"]:]
    model.load_state_dict(average_snapshots([folder / SNAPSHOTS / f"step_{s:08d}.safetensors" for s in use]))
    model.to(device).eval()
    ValidationSet.source_batches.__defaults__ = (SCORE_SENTENCES,)  # the batch only: beam search is per sentence
    beam, lenpen = recipe["beam_size"], recipe["length_penalty"]
    test_set = ValidationSet.from_text(_lines(ROOT / plan["test"][0]), _lines(ROOT / plan["test"][1]),
                                       data.tokenizer())
    with torch.no_grad():
        hyps = test_set.translate(model, None, beam, len_penalty=lenpen)
    refs = list(test_set.refs)
    row: dict[str, Any] = {
        **{k: v for k, v in entry.items() if k != "arch"}, "arch": arch.to_dict(),
        "steps_planned": planned, "steps_target": target, "steps_done": steps_done,
        "averaged_snapshots": use, "train_seconds": train_seconds, "train_loss": stats.get("train_loss"),
        "params": count_params(model), "recipe": recipe,
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "test_bleu": sacrebleu.corpus_bleu(hyps, [refs]).score, "test_chrf": sacrebleu.corpus_chrf(hyps, [refs]).score,
        "test_hypotheses": hyps}
    vset = ValidationSet.load(data)
    row.update(validation_scores(model, None, vset, beam_size=None, loss=True, max_tokens=recipe["max_tokens"]))
    if time.time() < score_end:
        with torch.no_grad():
            vh = vset.translate(model, None, beam, len_penalty=lenpen)
        row.update({"valid_bleu": sacrebleu.corpus_bleu(vh, [list(vset.refs)]).score,
                    "valid_chrf": sacrebleu.corpus_chrf(vh, [list(vset.refs)]).score})
    row["wall_seconds"] = time.perf_counter() - t0
    (tmp / f"{key}.json").write_text(json.dumps(row), encoding="utf-8")


def run_supernet(plan_path: Path, tmp: Path, out: Path, train_end: float, device: str) -> None:
    """Train the plan's supernet (its YAML, ``train.steps`` raised to ``supernet.steps``) until ``train_end``;
    copy the snapshots at ``supernet.keep_steps`` (and the newest) to ``out`` as fp16 safetensors."""
    import torch
    from safetensors.torch import load_file, save_file

    from nas.builders import prepare_sweep_data
    from nas.space import load_spec
    from trainers import train_supernet
    from trainers.average import SNAPSHOTS

    plan = json.loads(plan_path.read_text(encoding="utf-8"))
    sup = plan["supernet"]
    spec = load_spec(ROOT / sup["yaml"])
    train = spec.train.model_copy(update={"steps": sup["steps"], "checkpoint_every": sup["checkpoint_every"],
                                          "keep_last": sup["steps"] // sup["checkpoint_every"] + 1})
    spec = spec.model_copy(update={"train": train})
    torch.set_num_threads(1)
    data = prepare_sweep_data(spec, progress=False)
    folder = tmp / "supernet"
    t0 = time.perf_counter()

    def report(metrics: dict[str, float]) -> None:
        if time.time() > train_end:
            raise _Stop()

    try:
        train_supernet(spec, data, folder, report=report, progress=False, device=device)
    except _Stop:
        pass
    steps = _snapshot_steps(folder / SNAPSHOTS)
    keep = sorted({s for s in steps if s in set(sup["keep_steps"])} | set(steps[-1:]))
    for s in keep:
        src = folder / SNAPSHOTS / f"step_{s:08d}.safetensors"
        from safetensors import safe_open

        with safe_open(str(src), "pt") as f:
            meta = f.metadata()
        weights = {k: v.half() if v.is_floating_point() else v for k, v in load_file(str(src)).items()}
        save_file(weights, str(out / f"supernet_step{s:06d}.safetensors"), metadata=meta)
    print(f"supernet: snapshots {steps[:3]}..{steps[-1:]} kept {keep}, {time.perf_counter() - t0:.0f} s",
          file=sys.stderr, flush=True)


def _project(tmp: Path, keys: list[str], started: float, train_end: float, every: int) -> int | None:
    """The common step every unfinished worker reaches by ``train_end`` at its rate so far (a multiple of
    ``every``), or None when a worker has not reported yet."""
    reach = []
    for key in keys:
        f = tmp / f"{key}.progress"
        if not f.is_file():
            return None
        p = json.loads(f.read_text(encoding="utf-8"))
        rate = p["step"] / max(p["seconds"], 1e-6)
        reach.append(p["step"] + rate * max(train_end - time.time(), 0.0))
    return int(min(reach) // every * every)


def run_all(plan_path: Path, out: Path, train_s: float, score_s: float, device: str, only: list[str] | None,
            supernet: bool, lower: bool = True) -> None:
    """Prepare the data once, start one worker per model (and the supernet's), lower the common target when the
    slowest would miss ``train_s``, gather the rows into ``<out>/results.json``."""
    from nas.builders import prepare_sweep_data

    start = time.time()
    plan = json.loads(plan_path.read_text(encoding="utf-8"))
    models = [e for e in plan["models"] if not only or e["key"] in only]
    out.mkdir(parents=True, exist_ok=True)
    prepare_sweep_data(_spec(plan, 0), progress=False)  # once, before the workers read the cache
    tmp = Path(tempfile.mkdtemp(prefix="gtgpu-"))
    train_end, score_end = start + train_s, start + train_s + score_s
    log = open(out / "workers.log", "a", encoding="utf-8")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    common = ["--plan", str(plan_path), "--tmp", str(tmp), "--train-end", str(train_end), "--score-end",
              str(score_end), "--device", device, "--out", str(out)]
    procs = {e["key"]: subprocess.Popen([sys.executable, __file__, "--worker", e["key"], *common], stdout=log,
                                        stderr=subprocess.STDOUT, env=env) for e in models}
    sup = subprocess.Popen([sys.executable, __file__, "--worker", "supernet", *common], stdout=log,
                           stderr=subprocess.STDOUT, env=env) if supernet and plan.get("supernet") else None
    every, planned = plan["recipe"]["checkpoint_every"], plan["recipe"]["steps"]
    target = planned
    print(f"{len(procs)} workers started{' and the supernet' if sup else ''}, target {planned} steps, "
          f"{time.time() - start:.0f} s after the start", file=sys.stderr, flush=True)
    rows: dict[str, dict[str, Any]] = {}

    def write() -> None:
        tmp_out = out / "results.json.tmp"
        tmp_out.write_text(json.dumps({"plan": plan.get("created"), "train_s": train_s, "score_s": score_s,
                                       "steps_planned": planned, "steps_target": target,
                                       "models": [rows[k] for k in sorted(rows)]}), encoding="utf-8")
        os.replace(tmp_out, out / "results.json")

    next_check = start + min(PROBE_S, train_s / 3)
    while procs:
        time.sleep(POLL_S)
        if lower and time.time() >= next_check and time.time() < train_end:
            next_check += 30.0
            training = [k for k in procs if not (tmp / f"{k}.trained").exists()]
            reach = _project(tmp, training, start, train_end, every) if training else None
            if reach is not None and every <= reach < target:
                target = reach
                (tmp / "target_steps.tmp").write_text(str(target))
                os.replace(tmp / "target_steps.tmp", tmp / "target_steps")
                print(f"target lowered to {target} steps ({time.time() - start:.0f} s)", file=sys.stderr, flush=True)
        for key, p in list(procs.items()):
            if p.poll() is None:
                continue
            del procs[key]
            f = tmp / f"{key}.json"
            if p.returncode == 0 and f.is_file():
                rows[key] = json.loads(f.read_text(encoding="utf-8"))
                r = rows[key]
                print(f"{key}: {r['steps_done']}/{r['steps_target']} steps, test BLEU {r['test_bleu']:.2f}, "
                      f"valid loss {r['valid_loss']:.3f}, {time.time() - start:.0f} s", file=sys.stderr, flush=True)
            else:
                rows[key] = {"key": key, "failed": True, "returncode": p.returncode}
                print(f"{key}: FAILED (exit {p.returncode}); see workers.log", file=sys.stderr, flush=True)
            write()
    if sup is not None:
        sup.wait()
        print(f"supernet: exit {sup.returncode}", file=sys.stderr, flush=True)
    write()
    log.close()
    print(f"all done, {time.time() - start:.0f} s", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", required=True, help="plan.json written by ground_truth.py --phase plan")
    ap.add_argument("--out", default=None, help="folder of results.json, workers.log and the supernet's snapshots")
    ap.add_argument("--train-s", type=float, default=330.0, help="seconds of training after the start (default 330)")
    ap.add_argument("--score-s", type=float, default=120.0,
                    help="seconds after training during which validation BLEU is still computed (default 120)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", nargs="*", default=None, help="these model keys only")
    ap.add_argument("--no-supernet", action="store_true", help="do not train the plan's supernet")
    ap.add_argument("--fixed-target", action="store_true",
                    help="never lower the common target (a worker short of it at --train-s stops and says so)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--train-end", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--score-end", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker == "supernet":
        run_supernet(Path(args.plan), Path(args.tmp), Path(args.out), args.train_end, args.device)
    elif args.worker:
        try:
            run_worker(Path(args.plan), args.worker, Path(args.tmp), args.train_end, args.score_end, args.device)
        finally:
            (Path(args.tmp) / f"{args.worker}.trained").touch()
    else:
        run_all(Path(args.plan), Path(args.out), args.train_s, args.score_s, args.device, args.only,
                not args.no_supernet, not args.fixed_target)


if __name__ == "__main__":
    main()
