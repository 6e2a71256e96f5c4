"""Where a step of the compiled decoder's beam search goes: the package calls against the Python around them.

Run: ``python benchmarks/bench_aot_step.py EXPORT_DIR [--base-repo DIR] [--pairs 3] [--rounds 5] [--beam 4]
[--fixed 30] [--sentences 32]``

Translates the first ``--sentences`` of Multi30k test2016 one at a time (batch 1, the search's workload) with
``nas.export.aot.AotTranslator`` at ``--beam``, every output exactly ``--fixed`` decoder steps (``--fixed 0``: as
long as the search makes it, as ``nas translate`` does), on one torch thread,
and times each package call of the step (``boxed_run``, or :class:`nas.export.steploop.StepLoop`'s ``run``, which
runs steps back to back from C) and the encoder's package call (once a sentence, shown per step) inside the whole
search: what is left is the Python of :func:`nas.model.decode.search`, the stepper's set-up
and their small ATen calls. With ``--base-repo`` (e.g. a ``git worktree`` of an earlier
commit) the ``nas`` of that checkout runs too, one process per checkout, the two alternating ``--pairs`` times (the
machine drifts between processes: compare the pairs, not runs of different minutes). Prints, per run, ms per decoder
step: the whole search, the step's package calls, the encoder's, the rest, and a hash of the tokens (equal across
checkouts when the change keeps them). Packages are compiled in the first run of each checkout (untimed) and cached
under ``--work``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "multi30k"


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(args.repo))
    import sentencepiece as spm
    import torch

    torch.set_num_threads(1)
    import nas.export.aot as aot
    from nas.data import EOS_ID, read_lines
    from nas.export import load_export

    exported = load_export(args.export)
    sp = spm.SentencePieceProcessor(model_file=str(args.export / "spm.model"))
    srcs = [torch.tensor([ids[:exported.max_src_tokens - 1] + [EOS_ID]])
            for ids in sp.encode(read_lines(DATA / "test_2016_flickr.en.gz", limit=args.sentences))]
    translator = aot.AotTranslator(exported, args.beam, cache_dir=args.work / "aot" / hashlib.md5(
        str(args.repo).encode()).hexdigest()[:8])
    in_calls, in_encoder, in_steps = [0.0], [0.0], [0]
    encoder_run = translator.encoder().loader.boxed_run  # compiled now if missing

    def timed_encoder(inputs):  # the encoder's package call (once a sentence, in the translator), timed
        start = time.perf_counter()
        out = encoder_run(inputs)
        in_encoder[0] += time.perf_counter() - start
        return out
    translator._encoder = SimpleNamespace(loader=SimpleNamespace(boxed_run=timed_encoder))
    init = aot._AotStepper.__init__

    def timed_init(self, *a, **kw):  # every package call of the stepper, timed
        init(self, *a, **kw)
        loop = getattr(self, "loop", None)  # nas.export.steploop: the package's steps run back to back from C
        if loop is not None and "run" in vars(loop):
            return  # the translator's loop, timed by its first stepper
        run = loop.run if loop is not None else self.run

        def timed(*inputs):
            start = time.perf_counter()
            out = run(*inputs)
            in_calls[0] += time.perf_counter() - start
            in_steps[0] += out[0] if loop is not None else 1
            return out
        if loop is not None:
            loop.run = timed  # run_ahead's calls and single steps (StepLoop.__call__) both
        else:
            self.run = timed
    aot._AotStepper.__init__ = timed_init

    lengths = dict(max_len_a=0.0, max_len_b=args.fixed, min_len=args.fixed) if args.fixed else {}  # 0: free

    def search() -> list:
        return [translator.beam_search(s, **lengths) for s in srcs]
    tokens = hashlib.md5(str(search()).encode()).hexdigest()[:10]  # compiles on first use: untimed
    whole, calls, encoder = [], [], []
    for _ in range(args.rounds):
        in_calls[0] = in_encoder[0] = in_steps[0] = 0
        start = time.perf_counter()
        search()
        whole.append(time.perf_counter() - start)
        calls.append(in_calls[0])
        encoder.append(in_encoder[0])
    steps = in_steps[0]  # decoder steps a round (len(srcs) * args.fixed at fixed length)
    per_step = {name: 1e3 * statistics.median(times) / steps
                for name, times in (("whole_ms", whole), ("calls_ms", calls), ("encoder_ms", encoder))}
    print(json.dumps({**per_step, "tokens": tokens}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--base-repo", type=Path, default=None)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--fixed", type=int, default=30, help="decoder steps a sentence; 0: free length (the search's "
                        "defaults, as nas translate)")
    parser.add_argument("--sentences", type=int, default=32)
    parser.add_argument("--work", type=Path, default=Path("bench_aot_step_work"))
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)  # the nas checkout to time
    args = parser.parse_args(argv)
    if args.worker is not None:
        args.repo = args.worker
        return worker(args)
    repos = {"this": REPO, **({"base": args.base_repo.resolve()} if args.base_repo else {})}
    print("ms per decoder step (batch 1, beam %d, %s, %d sentences, median of %d rounds)"
          % (args.beam, f"{args.fixed} steps" if args.fixed else "free length", args.sentences, args.rounds))
    print(f"{'pair':>4} {'checkout':>8} {'whole':>8} {'package':>8} {'encoder':>8} {'rest':>8}  tokens")
    for pair in range(args.pairs):
        for name, repo in repos.items():
            cmd = [sys.executable, __file__, str(args.export), "--worker", str(repo), "--rounds", str(args.rounds),
                   "--beam", str(args.beam), "--fixed", str(args.fixed), "--sentences", str(args.sentences),
                   "--work", str(args.work)]
            out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            print(f"{pair:>4} {name:>8} {out['whole_ms']:8.3f} {out['calls_ms']:8.3f} {out['encoder_ms']:8.3f} "
                  f"{out['whole_ms'] - out['calls_ms'] - out['encoder_ms']:8.3f}  {out['tokens']}", flush=True)


if __name__ == "__main__":
    main()
