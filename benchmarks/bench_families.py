"""Speed of the unified layer's batched families, as ratios printed side by side in one run.

Run: ``python benchmarks/bench_families.py [--rounds 5] [--threads 2]``

1. A 3-branch attention of width 256 against a 1-branch attention of width 768 (same FLOPs),
   forward + backward (goal <= 1.15): branches are extra heads of one SDPA call.
2. A 4-path FFN sublayer (per-path LN, FFN, PathNorm, weighted fuse) against a 1-path FFN
   sublayer with 4x the inner width (goal <= 1.15): the per-path LN affine is folded into the
   first projection, so the 4 paths' first projections are one matmul of the shared input. A second line
   times the same with the input's gradient, as inside a model (informative; the goal is the first line's). A
   third, where the fused PathNorm kernel is available (:mod:`nas.model.fused`), times the 4-path sublayer with it
   against the same with ATen's kernels (``NAS_FUSED_KERNELS=0``), then PathNorm and the sum alone the same way.
3. The supernet running an arch against ``extract(arch)`` running the same arch, for random
   archs of ``search_spaces/unified.yaml``: training step (forward + backward, goal <= 1.15)
   and inference (teacher-forced forward, no grad; goal <= 1.05).

Each side first runs `--reps` times (warm-up); rounds are then interleaved (A, B, A, B, ...) and medians
compared, so machine noise hits both. The goals are judged on the medians' ratio; after it, the first and third
quartiles of the rounds' own ratios (each A round over the B round next to it) show how far one figure can be
trusted on a noisy machine (on a 2-core VM the FFN line's medians' ratio moved 1.05-1.34 between processes at 5
rounds: prefer `--rounds 15` for a figure to report).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Callable

import torch
from bench_serving import quartiles, round_ratios

from nas.model.attention import MultiBranchAttention
from nas.model import fused
from nas.model.ffn import ElasticFFN, path_ffn
from nas.model.paths import PathFusion
from nas.model.supernet import extract
from nas.precision import autocast_for, resolve_precision
from nas.space.space import SearchSpace
from nas.space import load_spec
from nas.builders import build_supernet


def _time(fn: Callable[[], None], reps: int) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _compare(name: str, a: Callable[[], None], b: Callable[[], None], rounds: int, reps: int,
             goal: float | None) -> float:
    for _ in range(reps):  # warm-up: the allocator settles (glibc raises its mmap threshold after frees)
        a()
        b()
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(_time(a, reps))
        tb.append(_time(b, reps))
    ratio = statistics.median(ta) / statistics.median(tb)
    low, high = quartiles(round_ratios(ta, tb))
    print(f"{name:<62}{statistics.median(ta) * 1e3:>9.2f} ms {statistics.median(tb) * 1e3:>9.2f} ms"
          f"{ratio:>8.3f} ({low:.2f}-{high:.2f})  " + ("(no goal)" if goal is None else f"(goal <= {goal})"))
    return ratio


def _attention_step(attn: MultiBranchAttention, x: torch.Tensor, width: int, branches: int, autocast) -> Callable[[], None]:
    def step() -> None:
        attn.zero_grad(set_to_none=True)
        with autocast:
            y = attn(x, width=width, branches=branches, causal=True)
        y.float().square().mean().backward()
    return step


def _ffn_step(fusion: PathFusion, ffn: ElasticFFN, x: torch.Tensor, paths: int, width: int, autocast) -> Callable[[], None]:
    def step() -> None:
        ffn.zero_grad(set_to_none=True)
        fusion.zero_grad(set_to_none=True)
        x.grad = None
        with autocast:
            y = fusion.fuse(x, path_ffn(fusion, ffn, x, width, paths))  # the layers' own code path
        y.float().square().mean().backward()
    return step


def _pathnorm_step(fusion: PathFusion, x: torch.Tensor, paths: int, dtype: torch.dtype) -> Callable[[], None]:
    """``fusion.fuse`` alone, forward and backward, on fixed path outputs ``[paths, b, t, C]`` in ``dtype``."""
    ys = torch.randn(paths, *x.shape[1:], dtype=dtype, requires_grad=True)

    def step() -> None:
        fusion.zero_grad(set_to_none=True)
        ys.grad = None
        fusion.fuse(x, ys).float().square().mean().backward()
    return step


def _with_fused(flag: str, step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with the fused CPU kernels on (``"1"``) or off (``"0"``): :func:`nas.model.fused.available`."""
    def run() -> None:
        os.environ["NAS_FUSED_KERNELS"] = flag
        try:
            step()
        finally:
            os.environ.pop("NAS_FUSED_KERNELS")
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                        help="auto: bf16 where this CPU has it natively, else fp32")
    parser.add_argument("--archs", type=int, default=3, help="random unified.yaml archs for the extract comparison")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    args.precision = resolve_precision(args.precision, "cpu")
    autocast = autocast_for(args.precision, "cpu")
    print(f"{args.threads} threads, {args.precision}; medians of {args.rounds} interleaved rounds x {args.reps} reps")
    print(f"{'comparison (A vs B)':<62}{'A':>12}{'B':>12}{'A/B':>8} (quartiles of the rounds' own A/B)")

    c, bsz, t = 512, 32, 32
    x = torch.randn(1, bsz, t, c)  # [groups, b, t, C]
    three = MultiBranchAttention(c, 256, 3, heads=4)
    one = MultiBranchAttention(c, 768, 1, heads=12)  # same head width (64) and FLOPs
    _compare("attention fwd+bwd: 3 branches x 256 vs 1 branch x 768", _attention_step(three, x, 256, 3, autocast),
             _attention_step(one, x, 768, 1, autocast), args.rounds, args.reps, 1.15)

    xs = torch.randn(1, bsz, t, c, requires_grad=False)
    four = (PathFusion(c, 4), ElasticFFN(c, 512, max_paths=4))
    wide = (PathFusion(c, 1), ElasticFFN(c, 2048, max_paths=1))
    _compare("FFN sublayer fwd+bwd: 4 paths x 512 vs 1 path x 2048", _ffn_step(*four, xs, 4, 512, autocast),
             _ffn_step(*wide, xs, 1, 2048, autocast), args.rounds, args.reps, 1.15)
    xg = xs.clone().requires_grad_()  # as inside a model: the input's gradient too (no goal of its own)
    _compare("  the same, the input's gradient too", _ffn_step(*four, xg, 4, 512, autocast),
             _ffn_step(*wide, xg, 1, 2048, autocast), args.rounds, args.reps, None)
    act_dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32  # the paths' outputs under autocast
    if fused.available(xs.to(act_dtype), torch.float32):
        four_step = _ffn_step(*four, xg, 4, 512, autocast)
        _compare("  4 paths: fused PathNorm vs ATen's (NAS_FUSED_KERNELS=0)", _with_fused("1", four_step),
                 _with_fused("0", four_step), args.rounds, args.reps, None)
        norm_step = _pathnorm_step(four[0], xs, 4, act_dtype)
        _compare("  PathNorm and the sum alone: fused vs ATen's", _with_fused("1", norm_step),
                 _with_fused("0", norm_step), args.rounds, args.reps, None)

    spec = load_spec("search_spaces/unified.yaml", check_files=False)
    space = SearchSpace.from_spec(spec)
    supernet = build_supernet(spec, 6000)
    reg = supernet.regularization(drop_branch=0.0)  # the same computation on both sides (drop-branch is random)
    src = torch.randint(4, 6000, (bsz, 24))
    tgt = torch.randint(4, 6000, (bsz, 26))
    for i in range(args.archs):
        arch = space.sample(random.Random(i))
        sub = extract(supernet, arch)

        def train_step(model, arch=arch):
            def step() -> None:
                model.zero_grad(set_to_none=True)
                with autocast:
                    logits = model(src, tgt, arch, reg=reg)
                logits.float().logsumexp(-1).mean().backward()
            return step

        def infer(model, arch=arch):
            def step() -> None:
                with torch.no_grad(), autocast:
                    model(src, tgt, arch, reg=reg)
            return step

        print(f"arch {i}: {arch.summary()}")
        supernet.train(), sub.train()
        _compare("  training step: supernet vs extract(arch)", train_step(supernet), train_step(sub),
                 args.rounds, args.reps, 1.15)
        supernet.eval(), sub.eval()
        _compare("  inference: supernet vs extract(arch)", infer(supernet), infer(sub), args.rounds, args.reps, 1.05)


if __name__ == "__main__":
    main()
