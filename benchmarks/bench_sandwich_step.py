"""One sandwich step of a YAML's supernet on this machine: its profile, and variants timed against today's side by
side in one process (issue 40: the quickstart in 25 minutes on a CPU without bf16).

A step is what the supernet loop does per optimizer step: zero the gradients, the joint stage's forward and
backward of the widest, the narrowest and ``train.sandwich_k`` random sub-Transformers on one batch, clipping,
Adam, the schedule (:func:`trainers.engine.optimizer_step`), in the YAML's precision on the CPU. Every variant
gets the same seed (same initial weights, same drawn archs) and the same real batches; the variants run in
interleaved rounds so that a shared machine's drift hits them alike. Prints the median ms per step of each
variant and its ratio to ``today`` (the variants' order rotates from round to round: with ``today`` always first,
a copy of ``today`` run second read 0.80x of it on a 2-core Xeon in ``unified.yaml``), the largest parameter
difference from ``today`` after the timed steps (a variant must train the same model within float tolerance), and
with ``--profile`` the ``torch.profiler`` table of ``--profile`` steps of ``today`` (top rows by self CPU time).

    python benchmarks/bench_sandwich_step.py search_spaces/quickstart.yaml --data nas_runs/data/<hash> --threads 2
    python benchmarks/bench_sandwich_step.py search_spaces/quickstart.yaml --data nas_runs/data/<hash> --profile 3

Variants (``--variant``, repeatable; default all): ``fused_adam``, Adam as one fused kernel over every parameter
(``torch.optim.Adam(fused=True)``, on the CPU since PyTorch 2.4) instead of PyTorch's per-parameter loop, which
is what ``make_optimizer`` gives a CPU run today; ``unfused_loss``, the step before the loss was fused with the
tied output layer: ``F.linear`` to the ``[b, t, V]`` logits, ``log_softmax`` and the smoothed loss through autograd
(:func:`nas.model.losses.label_smoothed_nll`) in place of :func:`nas.model.losses.linear_label_smoothed_nll`;
``torch_dropout``, ``F.dropout`` (``bernoulli_``) in place of :func:`nas.model.ops.dropout`'s 16-bit masks;
``before``, both (the step as it was before either); ``aten_pathnorm``, Multi-Path's PathNorm and weighted sum
by ATen's kernels instead of the fused CPU kernel of :mod:`nas.model.fused` (issue 41; a YAML with paths). The
dropout variants draw other masks, so their weights differ from ``today``'s by more than float tolerance.

``--allocators``: today's step in fresh processes, one per allocator setting and round, in interleaved rounds
(an allocator is chosen at a process's start): ``glibc`` (the default), ``glibc_tuned`` (the environment
of :data:`GLIBC_TUNED`: no ``mmap`` per large tensor, no trimming, so a step's 100 MB logits reuse pages
instead of faulting fresh ones in) and ``jemalloc`` (``LD_PRELOAD``, when installed, never returning memory).
Prints each one's ms per step, its minor page faults and kernel seconds per step, its ratio to ``glibc``, and
whether its weights after the steps equal ``glibc``'s exactly (sum of absolute values).

    python benchmarks/bench_sandwich_step.py search_spaces/quickstart.yaml --data nas_runs/data/<hash> --allocators
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {"fused_adam": {"fused": True}, "unfused_loss": {}, "torch_dropout": {}, "before": {}, "aten_pathnorm": {}}
"""Variant name -> ``make_optimizer`` keyword arguments."""
PATCHED = {"unfused_loss": ("loss",), "torch_dropout": ("dropout",), "before": ("loss", "dropout"),
           "aten_pathnorm": ("pathnorm",)}
"""Variant name -> what its steps run as before (see above): ``loss`` unfused, ``dropout`` PyTorch's, ``pathnorm``
ATen's kernels (:mod:`nas.model.fused` off)."""


def unfused_loss(hidden, weight, target, epsilon, pad_id=0, **_):
    """What the joint stage computed before :func:`nas.model.losses.linear_label_smoothed_nll`: the logits, then the
    smoothed loss through autograd."""
    import torch.nn.functional as F

    from nas.model.losses import label_smoothed_nll

    return label_smoothed_nll(F.linear(hidden, weight), target, epsilon, pad_id)


def torch_dropout(x, p):
    """What :func:`nas.model.ops.dropout` was: ``F.dropout`` (``bernoulli_``)."""
    import torch.nn.functional as F

    return F.dropout(x, p, True) if p > 0.0 else x


def patches(what: tuple[str, ...]) -> list[tuple[object, str, object]]:
    """(module, name, replacement) of each thing a variant runs as before."""
    import nas.model.ffn
    import nas.model.fused
    import nas.model.layers
    import nas.model.supernet
    import trainers.stages.sandwich

    out = []
    if "loss" in what:
        out.append((trainers.stages.sandwich, "linear_label_smoothed_nll", unfused_loss))
    if "dropout" in what:
        out += [(module, "drop", torch_dropout) for module in (nas.model.ffn, nas.model.layers, nas.model.supernet)]
    if "pathnorm" in what:
        out.append((nas.model.fused, "available", lambda *_: False))
    return out


GLIBC_TUNED = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "1000000000000"}
"""What ``scripts/quickstart.sh`` exports: glibc's aliases of ``glibc.malloc.mmap_max`` and
``glibc.malloc.trim_threshold`` (``GLIBC_TUNABLES`` reaches Ray's workers cut at its first ``:``)."""
JEMALLOC = Path("/lib/x86_64-linux-gnu/libjemalloc.so.2")


def allocators() -> dict[str, dict[str, str]]:
    """Allocator name -> the environment variables a process starts with."""
    out = {"glibc": {}, "glibc_tuned": dict(GLIBC_TUNED)}
    if JEMALLOC.is_file():
        out["jemalloc"] = {"LD_PRELOAD": str(JEMALLOC), "MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"}
    return out


def compare_allocators(args: argparse.Namespace) -> None:
    """Run ``--child`` processes per allocator in interleaved rounds and print the ratios."""
    import json
    import os
    import subprocess

    envs = allocators()
    rows: dict[str, list[dict]] = {name: [] for name in envs}
    for _ in range(args.rounds):
        for name, env in envs.items():
            cmd = [sys.executable, __file__, str(args.spec), "--data", str(args.data), "--steps", str(args.steps),
                   "--threads", str(args.threads), "--child"]
            out = subprocess.run(cmd, env={**os.environ, **env}, check=True, capture_output=True, text=True).stdout
            rows[name].append(json.loads(out.strip().splitlines()[-1]))
    base = statistics.median(r["s"] for r in rows["glibc"])
    print(f"{args.spec.name}: today's step, {args.threads} threads, {args.steps} steps x {args.rounds} processes each")
    for name, rs in rows.items():
        med = statistics.median(r["s"] for r in rs)
        faults, kernel = (statistics.median(r[key] for r in rs) for key in ("minflt", "stime"))
        rounds = ", ".join(f"{1000 * r['s']:.0f}" for r in rs)
        same = all(r["params"] == rows["glibc"][0]["params"] for r in rs)  # the allocator changes no number
        print(f"  {name:>12}: {1000 * med:9.1f} ms/step  {med / base:.3f}x glibc  ({faults:,.0f} minor faults, "
              f"{kernel:.2f} kernel s per step; rounds {rounds} ms; weights {'equal' if same else 'DIFFER'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", type=Path)
    ap.add_argument("--data", type=Path, required=True, help="a prepared data folder (nas_runs/data/<hash>)")
    ap.add_argument("--variant", action="append", choices=sorted(VARIANTS), help="default: every variant")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (a quickstart trial has resources.cpu)")
    ap.add_argument("--profile", type=int, default=0, help="steps of today to profile first (0: none)")
    ap.add_argument("--rows", type=int, default=15, help="rows of the profile table")
    ap.add_argument("--allocators", action="store_true", help="compare memory allocators (see above)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.allocators:
        return compare_allocators(args)

    import torch

    from nas.builders import build_space, build_supernet
    from nas.data import PreparedData, TokenBatcher, Tokenizer
    from nas.precision import autocast_for, resolve_precision
    from nas.space import load_spec
    from trainers.engine import optimizer_step
    from trainers.optim import make_optimizer, make_scheduler
    from trainers.stages import SandwichArchs, StageContext, StepInfo, build_stage

    torch.set_num_threads(args.threads)
    spec = load_spec(args.spec)
    tr = spec.train
    root = args.data
    data = PreparedData(root, root / "spm.model", root / "train.arrow", root / "valid.parquet",
                        Tokenizer(root / "spm.model").vocab_size)
    need = 1 + args.steps * (args.rounds + 1) + args.profile  # a warm-up step, the rounds (round 0 warms up)
    batches = list(TokenBatcher(data.corpus("train"), tr.max_tokens, shuffle=True, seed=tr.seed).batches(0))[:need]
    precision = resolve_precision(tr.precision, "cpu")
    space = build_space(spec)

    def build(optim_kwargs: dict) -> list:
        torch.manual_seed(tr.seed)
        model = build_supernet(spec, data.vocab_size, space).train()
        optimizer = make_optimizer(model, tr.lr, tr.weight_decay, **optim_kwargs)
        scheduler = make_scheduler(optimizer, tr.warmup_steps, [tr.steps])
        archs = SandwichArchs(space, random.Random(tr.seed), tr.sandwich_k, balanced=tr.balanced_sampling)
        stage = build_stage("joint", StageContext(spec, archs, autocast_for(precision, "cpu")))
        return [model, optimizer, scheduler, stage, 0]

    def step(run: list, batch, name: str = "today") -> None:
        model, optimizer, scheduler, stage, number = run
        optimizer.zero_grad(set_to_none=True)
        swaps = [(module, attr, getattr(module, attr), new) for module, attr, new in patches(PATCHED.get(name, ()))]
        for module, attr, _, new in swaps:
            setattr(module, attr, new)
        try:
            stage.step(model, [batch], StepInfo(number, batch.ntokens))
        finally:
            for module, attr, original, _ in swaps:
                setattr(module, attr, original)
        optimizer_step(model, optimizer, scheduler, tr.clip_norm, "bench")
        run[4] = number + 1

    if args.child:  # one allocator's process: a warm-up step, then the timed ones, as JSON per step
        import json
        import resource

        run = build({})
        step(run, batches[0])
        before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for batch in batches[1:1 + args.steps]:
            step(run, batch)
        after, n = resource.getrusage(resource.RUSAGE_SELF), args.steps
        checksum = sum(float(p.detach().double().abs().sum()) for p in run[0].parameters())
        print(json.dumps({"s": (time.perf_counter() - t0) / n, "minflt": (after.ru_minflt - before.ru_minflt) / n,
                          "stime": (after.ru_stime - before.ru_stime) / n, "params": checksum}))
        return
    names = ["today", *(args.variant or VARIANTS)]
    runs = {name: build({} if name == "today" else VARIANTS[name]) for name in names}
    print(f"{args.spec.name}: {precision}, {args.threads} threads, {args.steps} steps x {args.rounds} rounds "
          f"(+1 warm-up round), batches of {tr.max_tokens} tokens, sandwich of {2 + tr.sandwich_k}", flush=True)
    for name, run in runs.items():
        step(run, batches[0], name)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        profiled = build({})
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for batch in batches[-args.profile:]:
                step(profiled, batch)
        print(f"profile of {args.profile} steps of today:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows), flush=True)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds + 1):
        chunk = batches[1 + r * args.steps: 1 + (r + 1) * args.steps]
        for name in names[r % len(names):] + names[:r % len(names)]:  # each variant first in turn (see above)
            run = runs[name]
            t0 = time.perf_counter()
            for batch in chunk:
                step(run, batch, name)
            if r:
                times[name].append((time.perf_counter() - t0) / len(chunk))
    base = statistics.median(times["today"])
    reference = dict(runs["today"][0].named_parameters())
    for name in names:
        med = statistics.median(times[name])
        diff = max(float((p.detach() - reference[n].detach()).abs().max()) for n, p in runs[name][0].named_parameters())
        print(f"  {name:>12}: {1000 * med:9.1f} ms/step  {med / base:.3f}x today  (rounds: "
              f"{', '.join(f'{1000 * t:.0f}' for t in times[name])} ms; max |param - today's| {diff:.2e})")


if __name__ == "__main__":
    main()
