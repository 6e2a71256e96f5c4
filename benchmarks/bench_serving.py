"""Serving speed and quality of one exported sub-Transformer on every engine, one process per engine.

Run: ``python benchmarks/bench_serving.py EXPORT_DIR [--train YAML | --untrained YAML] [--rounds 3] [--threads 2]
[--engines pytorch,onnxruntime-fp32,...] [--base-repo DIR] [--sentences 1000] [--json OUT] [--profile]``

``EXPORT_DIR`` is a folder written by ``nas export``. For the CTranslate2 engines it must hold a plain
Transformer (1 branch, 1 path, 1 unit, sequential layers, one attention width per stack; see
``nas.export.ct2``). When it holds no export yet, ``--train benchmarks/plain_transformer.yaml`` trains that
one-arch space (``nas train``, resumable) and exports it; ``--untrained YAML`` exports the space's widest arch
from a freshly initialised supernet (seed 0) instead: the speed grid runs the same number of steps whatever the
weights, but BLEU means nothing then (the quality table says so). The benchmark writes, under ``--work``, the
ONNX graphs (``export_onnx``), an int8 copy (``quantize_onnx``) and the CTranslate2 model in float32 and int8
(``export_ctranslate2``). The same weights then run in

- ``pytorch``: the exported model with its key/value cache (``nas translate``'s path, this checkout);
- ``pytorch-aot``: the same decoder compiled ahead of time (``nas.export.aot.AotTranslator``; its packages are
  compiled in the first round, each in the untimed warm-up call, and cached under ``--work``);
- ``pytorch-base``: the same, with the ``nas`` package of ``--base-repo`` (e.g. a ``git worktree`` of an
  earlier commit): our decoder before and after a change, side by side in one run;
- ``onnxruntime-fp32`` / ``-int8``: the ONNX graphs under onnxruntime (``translate_onnx.py``'s path);
- ``ctranslate2-fp32`` / ``-int8``: CTranslate2 (``nas export --ctranslate2``), the engine MT engineers deploy.

**One process per engine.** Each engine runs in its own subprocess (``--worker ENGINE``), which loads only that
engine, sets ``--threads`` (torch threads, onnxruntime's intra-op threads, CTranslate2's ``intra_threads``;
``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` in its environment), times every configuration (one untimed
warm-up call first) and writes its figures and outputs to a JSON file. In one process, CTranslate2's libgomp
and onnxruntime slowed PyTorch's batch-1 decoding about 2x (issue 41). The parent prepares the engines'
files and the inputs (the same sentences and pieces for all), runs the workers ``--rounds`` times, the
engines interleaved in each round, and prints the median time of each engine divided by CTranslate2 fp32's
(the goals are judged on it) and, from 3 rounds, the quartiles of the rounds' own ratios (each round's time over
CTranslate2's in the same round): how far one figure can be trusted on a machine that drifts.

1. **Quality**: the first ``--sentences`` of Multi30k ``test_2016_flickr`` at ``--beam``, each engine batching
   its way (ours: sorted by length, 64 a batch; CTranslate2: equal source lengths together, 64 a batch): BLEU
   and chrF (sacrebleu), seconds, sentences/s, and the share of sentences whose output equals PyTorch's.
2. **Speed at fixed length** (``--grid``, default beam 1 batch 1, beam 4 batch 1, beam 4 batch 32): every
   output exactly ``--fixed`` decoder steps a sentence (EOS forbidden before, forced at the bound; ours emits
   ``--fixed - 1`` tokens and EOS, CTranslate2 ``--fixed`` tokens and stops without an EOS step), on the
   first ``--fixed-sentences`` sentences. The goals of issue 41, against CTranslate2 fp32: our decoder at
   batch 32, beam 4 at 1.2x its time or less, at batch 1, beam 4 at 1.0x or less.

``--profile`` adds torch.profiler's top ops of ``pytorch`` at batch 32, beam 4 (one more worker).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "multi30k"
ENGINES = ("pytorch", "pytorch-aot", "pytorch-base", "onnxruntime-fp32", "onnxruntime-int8", "ctranslate2-fp32", "ctranslate2-int8")
BASELINE = "ctranslate2-fp32"
GOALS = {(4, 32): 1.2, (4, 1): 1.0}  # (beam, batch) -> our decoder's time / CTranslate2 fp32's (issue 41)


def _padded(rows: list[list[int]], pad_id: int):
    import numpy as np

    out = np.full((len(rows), max(map(len, rows))), pad_id, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def _batches(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _engine(name: str, work: Path, export: Path, threads: int, base_repo: Path | None):
    """``(translate(sentences, beam) -> hyps, fixed(beam, batch, ids, pieces, length) -> run)`` of one engine,
    importing only what it needs (``pytorch-base``: the ``nas`` package of ``base_repo``)."""
    sys.path.insert(0, str(base_repo if name == "pytorch-base" else REPO))
    if name == "pytorch-aot":
        import torch

        torch.set_num_threads(threads)
        from nas.data import PAD_ID
        from nas.export import load_export
        from nas.export.aot import AotTranslator

        exported = load_export(export)
        translators: dict[int, AotTranslator] = {}

        def aot(beam):
            if beam not in translators:
                translators[beam] = AotTranslator(exported, beam, cache_dir=work / "aot")
            return translators[beam]

        def fixed(beam, batch, ids, pieces, length):
            tensors = [torch.from_numpy(_padded(b, PAD_ID)) for b in _batches(ids, batch)]
            return lambda: [h for t in tensors for h in aot(beam).beam_search(t, max_len_a=0.0, max_len_b=length,
                                                                               min_len=length)]
        return (lambda sentences, beam: aot(beam).translate(sentences)), fixed, exported.model
    if name.startswith("pytorch"):
        import torch

        torch.set_num_threads(threads)
        from nas.data import PAD_ID
        from nas.export import load_export
        from nas.model import beam_search

        exported = load_export(export)
        model = exported.model.eval()

        def fixed(beam, batch, ids, pieces, length):
            tensors = [torch.from_numpy(_padded(b, PAD_ID)) for b in _batches(ids, batch)]
            return lambda: [h for t in tensors for h in beam_search(model, t, beam_size=beam, max_len_a=0.0,
                                                                    max_len_b=length, min_len=length)]
        return (lambda sentences, beam: exported.translate(sentences, beam_size=beam)), fixed, model
    if name.startswith("onnxruntime"):
        from nas.data import PAD_ID
        from nas.export.translate_onnx import OnnxTranslator

        tr = OnnxTranslator(work / name.split("-")[1], threads)

        def fixed(beam, batch, ids, pieces, length):
            arrays = [_padded(b, PAD_ID) for b in _batches(ids, batch)]
            return lambda: [h for a in arrays for h in tr.beam_search(a, beam, min_len=length, max_len=length)]
        return (lambda sentences, beam: tr.translate(sentences, beam)), fixed, None
    from nas.export.ct2 import Ct2Translator

    tr = Ct2Translator(work / f"ct2_{name.split('-')[1]}", threads)

    def fixed(beam, batch, ids, pieces, length):
        chunks = _batches(pieces, batch)
        return lambda: [h for p in chunks for h in tr.translate_pieces(p, beam, max_batch_size=batch,
                                                                       min_length=length, max_length=length)]
    return (lambda sentences, beam: tr.translate(sentences, beam)), fixed, None


def _timed(run: Callable[[], list], warmup: Callable[[], object] | None = None) -> tuple[float, list]:
    """Seconds of one call of ``run`` after one untimed warm-up call (``warmup``, default ``run``), and its output."""
    (warmup or run)()
    start = time.perf_counter()
    out = run()
    return time.perf_counter() - start, out


def _profile(model, fixed: Callable, inputs: dict, length: int, top: int = 15) -> dict:
    """torch.profiler's top ops by self CPU time of our decoder at batch 32, beam 4, fixed length."""
    from torch.profiler import ProfilerActivity, profile

    run = fixed(4, 32, inputs["ids"], inputs["pieces"], length)
    run()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return {"wall_s": wall, "op_calls": sum(e.count for e in events),
            "top": [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3,
                     "share": e.self_cpu_time_total / total} for e in events[:top]]}


def worker(args: argparse.Namespace) -> None:
    """One engine in this process: every configuration of ``args.inputs`` timed, written to ``args.out``."""
    inputs = json.loads(args.inputs.read_text(encoding="utf-8"))
    translate, fixed, model = _engine(args.worker, args.work, args.export, args.threads, args.base_repo)
    result: dict = {"engine": args.worker, "pid": os.getpid()}
    if args.profile:
        result["profile"] = _profile(model, fixed, inputs, args.fixed)
    else:
        sources = inputs["sources"]
        if sources:
            seconds, hyps = _timed(lambda: translate(sources, args.beam), lambda: translate(sources[:64], args.beam))
            result["quality"] = {"seconds": seconds, "hyps": hyps}
        result["fixed"] = []
        for beam, batch in args.grid:
            seconds, out = _timed(fixed(beam, batch, inputs["ids"], inputs["pieces"], args.fixed))
            result["fixed"].append({"beam": beam, "batch": batch, "seconds": seconds,
                                    "output_lengths": sorted({len(h) for h in out}),
                                    "outputs": out if args.worker.startswith("pytorch") else None})
    args.out.write_text(json.dumps(result), encoding="utf-8")


def _train_and_export(yaml_file: Path, export_dir: Path, work: Path, train: bool = True) -> None:
    """``nas train`` the one-arch space of ``yaml_file`` into ``work/supernet`` (resumable; ``train=False``: a
    freshly initialised supernet, seed 0) and export its widest arch."""
    import torch

    sys.path.insert(0, str(REPO))
    from nas.builders import build_supernet, prepare_sweep_data
    from nas.export import export_arch
    from nas.model.io import load_model, save_model
    from nas.space import load_spec

    spec = load_spec(yaml_file)
    data = prepare_sweep_data(spec)
    supernet_dir = work / "supernet"
    if train:
        from trainers import train_supernet

        train_supernet(spec, data, supernet_dir, report=lambda metrics: None)
    else:
        torch.manual_seed(0)
        save_model(build_supernet(spec, data.vocab_size), supernet_dir, "supernet")
    arch = load_model(supernet_dir, "supernet").full_arch
    export_arch(supernet_dir, data.spm_model, arch, export_dir, beam_size=spec.search.beam_size)


def _prepare(args: argparse.Namespace, engines: list[str]) -> dict:
    """Write the engines' files under ``args.work`` and the inputs every worker reads; returns the inputs."""
    import sentencepiece as spm

    sys.path.insert(0, str(REPO))
    from nas.data import EOS_ID, read_lines
    from nas.export import load_export

    if any(e.startswith("onnxruntime") for e in engines):
        from nas.export.onnx import export_onnx, quantize_onnx

        for q in ("fp32", "int8"):  # an earlier run's copies are replaced, any other folder refused
            export_onnx(args.export, args.work / q)
        quantize_onnx(args.work / "int8")
    if any(e.startswith("ctranslate2") for e in engines):
        from nas.export.ct2 import export_ctranslate2

        for q in ("fp32", "int8"):
            export_ctranslate2(args.export, args.work / f"ct2_{q}", quantization=None if q == "fp32" else q)
    limit = load_export(args.export).max_src_tokens
    sp = spm.SentencePieceProcessor(model_file=str(args.export / "spm.model"))
    sources = read_lines(args.src, limit=max(args.sentences, args.fixed_sentences))
    pieces = [p[:limit] for p in sp.encode(sources[:args.fixed_sentences], out_type=str)]
    return {"sources": sources[:args.sentences], "pieces": pieces,
            "ids": [[sp.piece_to_id(p) for p in ps] + [EOS_ID] for ps in pieces]}


def _run_worker(args: argparse.Namespace, engine: str, out: Path, profile: bool = False) -> dict:
    """Run ``engine`` in a subprocess (this script with ``--worker``) and read what it wrote."""
    cmd = [sys.executable, str(Path(__file__).resolve()), str(args.export), "--worker", engine,
           "--work", str(args.work),
           "--inputs", str(args.work / "inputs.json"), "--out", str(out), "--threads", str(args.threads),
           "--beam", str(args.beam), "--fixed", str(args.fixed), "--grid", ",".join(f"{b}x{n}" for b, n in args.grid)]
    if args.base_repo is not None:
        cmd += ["--base-repo", str(args.base_repo)]
    if profile:
        cmd.append("--profile")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"worker {engine} failed (exit {done.returncode}): {done.stderr[-3000:]}")
    return json.loads(out.read_text(encoding="utf-8"))


def _report(args: argparse.Namespace, engines: list[str], runs: dict[str, list[dict]], inputs: dict) -> dict:
    """Medians over rounds, ratios to CTranslate2 fp32 (or the first engine), printed and returned."""
    import sacrebleu

    base = BASELINE if BASELINE in engines else engines[0]
    result: dict = {"engines": engines, "baseline": base, "threads": args.threads, "rounds": args.rounds,
                    "untrained": args.untrained is not None, "fixed_tokens": args.fixed,
                    "fixed_sentences": len(inputs["ids"]), "quality": {}, "fixed_length": []}
    if inputs["sources"]:
        reference = _read_refs(args)
        seconds = {e: statistics.median(r["quality"]["seconds"] for r in runs[e]) for e in engines}
        ours = runs[engines[0]][-1]["quality"]["hyps"]
        print(f"quality: {len(inputs['sources'])} sentences of {args.src.name}, beam {args.beam}, {args.threads} "
              f"thread(s), median of {args.rounds} round(s), one process per engine"
              + ("; UNTRAINED weights: BLEU means nothing" if args.untrained else ""))
        print(f"{'engine':<19}{'BLEU':>7}{'chrF':>7}{'s':>8}{'sent/s':>8}{'time/ct2':>10}{'=' + engines[0]:>14}")
        for e in engines:
            hyps = runs[e][-1]["quality"]["hyps"]
            row = {"bleu": sacrebleu.corpus_bleu(hyps, [reference]).score,
                   "chrf": sacrebleu.corpus_chrf(hyps, [reference]).score, "seconds": seconds[e],
                   "sentences_per_s": len(hyps) / seconds[e], "time_vs_baseline": seconds[e] / seconds[base],
                   "same_as_first": sum(a == b for a, b in zip(hyps, ours)) / len(hyps)}
            result["quality"][e] = row
            print(f"{e:<19}{row['bleu']:>7.2f}{row['chrf']:>7.2f}{row['seconds']:>8.2f}{row['sentences_per_s']:>8.1f}"
                  f"{row['time_vs_baseline']:>10.2f}{row['same_as_first']:>14.1%}")
    print(f"\nfixed length: {args.fixed} decoder steps a sentence, {len(inputs['ids'])} sentences; time / {base} "
          f"(median of {args.rounds} round(s); {base}'s sentences/s in brackets; from 3 rounds, the quartiles of the "
          f"rounds' own ratios after it)")
    print(f"{'beam':>4}{'batch':>6}" + "".join(f"{e:>18}" for e in engines))
    for i, (beam, batch) in enumerate(args.grid):
        seconds = {e: statistics.median(r["fixed"][i]["seconds"] for r in runs[e]) for e in engines}
        cells = []
        for e in engines:
            ratio = seconds[e] / seconds[base]
            by_round = [r["fixed"][i]["seconds"] for r in runs[e]]
            rounds = round_ratios(by_round, [r["fixed"][i]["seconds"] for r in runs[base]])
            row = {"beam": beam, "batch": batch, "engine": e, "seconds": seconds[e], "time_vs_baseline": ratio,
                   "seconds_by_round": by_round, "ratio_by_round": rounds, "ratio_quartiles": quartiles(rounds),
                   "output_lengths": runs[e][-1]["fixed"][i]["output_lengths"]}
            result["fixed_length"].append(row)
            if e == base:
                extra = f" ({len(inputs['ids']) / seconds[e]:.1f})"
            else:
                extra = " ({:.2f}-{:.2f})".format(*row["ratio_quartiles"]) if len(rounds) >= 3 else ""
            cells.append(f"{ratio:.2f}{extra}")
        print(f"{beam:>4}{batch:>6}" + "".join(f"{c:>18}" for c in cells))
        for other, key in (("pytorch-base", "base_outputs_equal"), ("pytorch-aot", "aot_outputs_equal")):
            if "pytorch" in engines and other in engines:  # before/after a change, or compiled: the same tokens?
                same = runs["pytorch"][-1]["fixed"][i]["outputs"] == runs[other][-1]["fixed"][i]["outputs"]
                result.setdefault(key, {})[f"{beam}x{batch}"] = same
                print(f"{'':>10}{other}'s outputs {'equal' if same else 'DIFFER FROM'} pytorch's")
    for (beam, batch), goal in GOALS.items():
        for ours in ("pytorch", "pytorch-aot"):
            got = [r for r in result["fixed_length"] if (r["beam"], r["batch"], r["engine"]) == (beam, batch, ours)]
            if got and base == BASELINE:
                ok = "met" if got[0]["time_vs_baseline"] <= goal else "MISSED"
                print(f"goal beam {beam}, batch {batch}: {ours} at {got[0]['time_vs_baseline']:.2f}x CTranslate2 "
                      f"fp32's time (goal {goal}x or less): {ok}")
    return result


def round_ratios(mine: list[float], base: list[float]) -> list[float]:
    """Each round's time over the baseline engine's in the same round (the engines ran one after the other in it,
    so a round's ratio is less exposed to the machine's drift than the medians' ratio)."""
    if len(mine) != len(base):
        raise ValueError(f"{len(mine)} rounds against the baseline's {len(base)}")
    return [a / b for a, b in zip(mine, base)]


def quartiles(values: list[float]) -> tuple[float, float]:
    """The first and third quartiles of ``values`` (``statistics.quantiles``, inclusive); one value: it twice."""
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def _read_refs(args: argparse.Namespace) -> list[str]:
    from nas.data import read_lines

    return read_lines(args.ref, limit=args.sentences)


def _print_profile(profile: dict) -> None:
    print(f"\nprofile, pytorch at batch 32, beam 4 ({profile['wall_s']:.2f} s under the profiler; "
          f"{profile['op_calls']} op calls):")
    for r in profile["top"]:
        print(f"  {r['op']:<40}{r['calls']:>8}{r['self_ms']:>10.1f} ms{r['share']:>8.1%}")


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export", type=Path, help="a folder written by `nas export` (written first with --train)")
    made = parser.add_mutually_exclusive_group()
    made.add_argument("--train", type=Path, default=None, metavar="YAML",
                      help="train this one-arch space (e.g. benchmarks/plain_transformer.yaml) and export it to EXPORT")
    made.add_argument("--untrained", type=Path, default=None, metavar="YAML",
                      help="export this space's widest arch from a freshly initialised supernet (speed only)")
    parser.add_argument("--engines", default=None, help=f"comma-separated, of {', '.join(ENGINES)} (default: all; "
                                                        "pytorch-base only with --base-repo)")
    parser.add_argument("--base-repo", type=Path, default=None, help="a checkout whose nas runs as pytorch-base")
    parser.add_argument("--src", type=Path, default=DATA / "test_2016_flickr.en.gz")
    parser.add_argument("--ref", type=Path, default=DATA / "test_2016_flickr.de.gz")
    parser.add_argument("--sentences", type=int, default=1000, help="of the quality table (0: no quality table)")
    parser.add_argument("--beam", type=int, default=4, help="beam of the quality table")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fixed", type=int, default=30, help="decoder steps per sentence of the speed grid")
    parser.add_argument("--fixed-sentences", type=int, default=64, help="sentences of the speed grid")
    parser.add_argument("--grid", default="1x1,4x1,4x32", help="BEAMxBATCH,... of the speed grid")
    parser.add_argument("--work", type=Path, default=Path("bench_serving_work"), help="engine copies (rewritten)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--profile", action="store_true", help="also profile pytorch at batch 32, beam 4")
    parser.add_argument("--worker", choices=ENGINES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--inputs", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.grid = [tuple(int(x) for x in cell.split("x")) for cell in args.grid.split(",")]
    if args.worker is not None:
        return worker(args)

    engines = [e for e in ENGINES if e != "pytorch-base" or args.base_repo is not None]
    if args.engines:
        engines = args.engines.split(",")
        unknown = sorted(set(engines) - set(ENGINES))
        if unknown:
            parser.error(f"--engines {unknown}: expected some of {', '.join(ENGINES)}")
    if "pytorch-base" in engines and args.base_repo is None:
        parser.error("--engines pytorch-base needs --base-repo (a checkout whose nas package it runs)")
    args.work.mkdir(parents=True, exist_ok=True)
    if (args.train or args.untrained) and not (args.export / "export.json").is_file():
        _train_and_export(args.train or args.untrained, args.export, args.work, train=args.train is not None)
    inputs = _prepare(args, engines)
    (args.work / "inputs.json").write_text(json.dumps(inputs), encoding="utf-8")
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for r in range(args.rounds):
        for e in engines:
            runs[e].append(_run_worker(args, e, args.work / f"worker_{e}_{r}.json"))
    result = _report(args, engines, runs, inputs)
    if args.profile:
        result["profile"] = _run_worker(args, "pytorch", args.work / "worker_profile.json", profile=True)["profile"]
        _print_profile(result["profile"])
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
