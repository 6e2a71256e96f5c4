"""Serving speed and quality of one exported sub-Transformer on every engine, CTranslate2 included, in one run.

Run: ``python benchmarks/bench_serving.py EXPORT_DIR [--sentences 1000] [--beam 4] [--threads 2] [--json OUT]``

``EXPORT_DIR`` is a folder written by ``nas export``. For the CTranslate2 engines it must hold a plain
Transformer (1 branch, 1 path, 1 unit, sequential layers, one attention width per stack; see
``nas.export.ct2``): ``--train benchmarks/plain_transformer.yaml`` trains one (``nas train``, resumable) and
exports it into ``EXPORT_DIR`` first. The benchmark writes, under ``--work``, the ONNX graphs of the export
(``export_onnx``) and an int8 copy (``quantize_onnx``), and the CTranslate2 model in float32 and int8
(``export_ctranslate2``). The same weights then run in

- ``pytorch``: the exported model with its key/value cache (``nas translate``'s path);
- ``onnxruntime fp32`` / ``int8``: the ONNX graphs under onnxruntime (``translate_onnx.py``'s path);
- ``ctranslate2 fp32`` / ``int8``: CTranslate2 (``nas export --ctranslate2``), the engine MT engineers deploy.

Two tables, each engine's time also divided by CTranslate2 fp32's (in the same run: these machines are noisy):

1. **Quality**: the first ``--sentences`` of Multi30k ``test_2016_flickr`` at ``--beam``, each engine batching
   its way (ours: sorted by length, 64 a batch; CTranslate2: equal source lengths together, 64 a batch): BLEU
   and chrF (sacrebleu), seconds, sentences/s, target tokens/s (SentencePiece pieces of the output), and the
   share of sentences whose output equals PyTorch's.
2. **Speed at fixed length**: greedy and beam 4, at batch 1 and batch 32, every output exactly ``--fixed``
   decoder steps a sentence (EOS forbidden before, forced at the bound: each engine runs the same number of
   steps whatever the weights; ours emits ``--fixed - 1`` tokens and EOS, CTranslate2 ``--fixed`` tokens and
   stops without an EOS step), on the first ``--fixed-sentences`` sentences: sentences/s and target tokens/s
   (one a step). The goal of issue
   17 is read at batch 32, beam 4: our best engine's time at most 1.5x CTranslate2 fp32's.

Each configuration runs ``--rounds`` times, the engines interleaved; the median time counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import sacrebleu
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nas.data import EOS_ID, PAD_ID, read_lines  # noqa: E402
from nas.export import load_export  # noqa: E402
from nas.export.ct2 import Ct2Translator, export_ctranslate2  # noqa: E402
from nas.export.onnx import export_onnx, quantize_onnx  # noqa: E402
from nas.export.translate_onnx import OnnxTranslator  # noqa: E402
from nas.model import beam_search  # noqa: E402

DATA = REPO.parent / "shared" / "data" / "multi30k"


def _train_and_export(yaml_file: Path, export_dir: Path, work: Path) -> None:
    """``nas train`` the one-arch space of ``yaml_file`` into ``work/supernet`` (resumable) and export its widest."""
    from nas.builders import prepare_sweep_data
    from nas.export import export_arch
    from nas.model.io import load_model
    from nas.space import load_spec
    from trainers import train_supernet

    spec = load_spec(yaml_file)
    data = prepare_sweep_data(spec)
    supernet_dir = work / "supernet"
    train_supernet(spec, data, supernet_dir, report=lambda metrics: None)
    arch = load_model(supernet_dir, "supernet").full_arch
    export_arch(supernet_dir, data.spm_model, arch, export_dir, beam_size=spec.search.beam_size)


def _timed(runs: dict[str, Callable[[], object]], rounds: int) -> tuple[dict[str, float], dict[str, object]]:
    """Median seconds per engine over ``rounds`` interleaved rounds (after one warm-up call each), and each
    engine's last output."""
    outputs = {name: run() for name, run in runs.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            outputs[name] = run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, outputs


def _batches(ids: list[list[int]], size: int) -> list[list[list[int]]]:
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def _padded(rows: list[list[int]]) -> np.ndarray:
    out = np.full((len(rows), max(map(len, rows))), PAD_ID, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def fixed_length_grid(exported, onnx: dict[str, OnnxTranslator], ct2: dict[str, Ct2Translator],
                      sources: list[str], length: int, rounds: int) -> list[dict]:
    """Sentences/s and target tokens/s of every engine decoding exactly ``length`` tokens a sentence, for
    greedy and beam 4 at batch 1 and 32 (batch 1: one call per sentence)."""
    model = exported.model.eval()
    sp = next(iter(ct2.values())).sp
    pieces = next(iter(ct2.values())).pieces(sources)
    ids = [[sp.piece_to_id(p) for p in ps] + [EOS_ID] for ps in pieces]
    rows = []
    for beam in (1, 4):
        for batch in (1, 32):
            id_batches = _batches(ids, batch)
            tensors = [torch.from_numpy(_padded(b)) for b in id_batches]
            arrays = [_padded(b) for b in id_batches]
            piece_batches = _batches(pieces, batch)
            # ours: max_len = min_len = length steps, the last one EOS: length - 1 tokens + EOS = `length` steps;
            # CTranslate2: `length` tokens, `length` steps (it does not run a step for the EOS after the bound).
            runs: dict[str, Callable[[], object]] = {
                "pytorch": lambda: [beam_search(model, t, beam_size=beam, max_len_a=0.0, max_len_b=length,
                                                min_len=length) for t in tensors]}
            for name, translator in onnx.items():
                runs[f"onnxruntime {name}"] = (lambda tr: lambda: [tr.beam_search(a, beam, min_len=length,
                                                                                  max_len=length) for a in arrays])(translator)
            for name, translator in ct2.items():
                runs[f"ctranslate2 {name}"] = (lambda tr: lambda: [tr.translate_pieces(p, beam, max_batch_size=batch,
                                                                                       min_length=length, max_length=length)
                                                                   for p in piece_batches])(translator)
            seconds, outputs = _timed(runs, rounds)
            lengths = {name: sorted({len(h) for chunk in out for h in chunk}) for name, out in outputs.items()}
            base = seconds["ctranslate2 fp32"]
            for name, s in seconds.items():
                tokens = len(sources) * length  # one target token a decoder step, EOS included (see above)
                rows.append({"beam": beam, "batch": batch, "engine": name, "seconds": s,
                             "sentences_per_s": len(sources) / s, "tokens_per_s": tokens / s,
                             "time_vs_ctranslate2": s / base, "output_lengths": lengths[name]})
    return rows


def _profile(exported, ct2: Ct2Translator, sources: list[str], length: int, top: int = 15) -> list[dict]:
    """Where PyTorch's time goes at batch 32, beam 4, fixed length: torch.profiler's top ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    model = exported.model.eval()
    ids = [[ct2.sp.piece_to_id(p) for p in ps] + [EOS_ID] for ps in ct2.pieces(sources)]
    tensors = [torch.from_numpy(_padded(b)) for b in _batches(ids, 32)]
    run = lambda: [beam_search(model, t, beam_size=4, max_len_a=0.0, max_len_b=length, min_len=length) for t in tensors]
    run()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    rows = [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3,
             "share": e.self_cpu_time_total / total} for e in events[:top]]
    print(f"\nprofile, PyTorch at batch 32, beam 4, {length} tokens ({wall:.2f} s under the profiler; "
          f"{sum(e.count for e in events)} op calls):")
    for r in rows:
        print(f"  {r['op']:<40}{r['calls']:>8}{r['self_ms']:>10.1f} ms{r['share']:>8.1%}")
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export", type=Path, help="a folder written by `nas export` (written first with --train)")
    parser.add_argument("--train", type=Path, default=None, metavar="YAML",
                        help="train this one-arch space (e.g. benchmarks/plain_transformer.yaml) and export it to EXPORT")
    parser.add_argument("--src", type=Path, default=DATA / "test_2016_flickr.en.gz")
    parser.add_argument("--ref", type=Path, default=DATA / "test_2016_flickr.de.gz")
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--fixed", type=int, default=30, help="output tokens per sentence of the speed grid")
    parser.add_argument("--fixed-sentences", type=int, default=64, help="sentences of the speed grid")
    parser.add_argument("--work", type=Path, default=Path("bench_serving_work"), help="engine copies (rewritten)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--profile", action="store_true",
                        help="also profile PyTorch at batch 32, beam 4, fixed length (torch.profiler, top ops)")
    args = parser.parse_args(argv)

    if args.train is not None and not (args.export / "export.json").is_file():
        _train_and_export(args.train, args.export, args.work)
    torch.set_num_threads(args.threads)
    source = read_lines(args.src, limit=args.sentences)
    reference = read_lines(args.ref, limit=args.sentences)
    fp32_dir, int8_dir = args.work / "fp32", args.work / "int8"
    for folder in (fp32_dir, int8_dir):  # an earlier run's copies are replaced, any other folder refused
        export_onnx(args.export, folder)
    report = quantize_onnx(int8_dir)
    ct2_dirs = {q: export_ctranslate2(args.export, args.work / f"ct2_{q}", quantization=None if q == "fp32" else q)
                for q in ("fp32", "int8")}

    exported = load_export(args.export)
    onnx = {"fp32": OnnxTranslator(fp32_dir, args.threads), "int8": OnnxTranslator(int8_dir, args.threads)}
    ct2 = {q: Ct2Translator(folder, args.threads) for q, folder in ct2_dirs.items()}
    engines: dict[str, Callable[[], object]] = {"pytorch": lambda: exported.translate(source, beam_size=args.beam)}
    for q, t in onnx.items():
        engines[f"onnxruntime {q}"] = (lambda tr: lambda: tr.translate(source, args.beam))(t)
    for q, t in ct2.items():
        engines[f"ctranslate2 {q}"] = (lambda tr: lambda: tr.translate(source, args.beam))(t)
    seconds, outputs = _timed(engines, args.rounds)
    rows = {}
    for name in engines:
        hyps = outputs[name]
        tokens = sum(map(len, exported.tokenizer.encode(hyps)))
        rows[name] = {"bleu": sacrebleu.corpus_bleu(hyps, [reference]).score,
                      "chrf": sacrebleu.corpus_chrf(hyps, [reference]).score,
                      "seconds": seconds[name], "sentences_per_s": len(source) / seconds[name],
                      "tokens_per_s": tokens / seconds[name],
                      "time_vs_ctranslate2": seconds[name] / seconds["ctranslate2 fp32"],
                      "same_as_pytorch": sum(a == b for a, b in zip(hyps, outputs["pytorch"])) / len(source)}
    print(f"{exported.arch.summary()}; {len(source)} sentences of {args.src.name}, beam {args.beam}, "
          f"{args.threads} thread(s), median of {args.rounds} round(s)")
    print(f"{'engine':<19}{'BLEU':>7}{'chrF':>7}{'s':>8}{'sent/s':>8}{'tok/s':>8}{'time/ct2':>10}{'=pytorch':>10}")
    for name, r in rows.items():
        print(f"{name:<19}{r['bleu']:>7.2f}{r['chrf']:>7.2f}{r['seconds']:>8.2f}{r['sentences_per_s']:>8.1f}"
              f"{r['tokens_per_s']:>8.0f}{r['time_vs_ctranslate2']:>10.2f}{r['same_as_pytorch']:>10.1%}")
    fp32, int8 = rows["onnxruntime fp32"], rows["onnxruntime int8"]
    print(f"int8 vs fp32: onnxruntime BLEU {int8['bleu'] - fp32['bleu']:+.2f} (goal within 0.3), speed-up "
          f"{fp32['seconds'] / int8['seconds']:.2f}x; CTranslate2 BLEU "
          f"{rows['ctranslate2 int8']['bleu'] - rows['ctranslate2 fp32']['bleu']:+.2f}, speed-up "
          f"{rows['ctranslate2 fp32']['seconds'] / rows['ctranslate2 int8']['seconds']:.2f}x")

    fixed_sources = source[:args.fixed_sentences]
    grid = fixed_length_grid(exported, onnx, ct2, fixed_sources, args.fixed, args.rounds)
    print(f"\nfixed length: {args.fixed} output tokens a sentence, {len(fixed_sources)} sentences")
    print(f"{'beam':>4}{'batch':>6}  {'engine':<19}{'s':>8}{'sent/s':>8}{'tok/s':>8}{'time/ct2':>10}  lengths")
    for r in grid:
        print(f"{r['beam']:>4}{r['batch']:>6}  {r['engine']:<19}{r['seconds']:>8.3f}{r['sentences_per_s']:>8.1f}"
              f"{r['tokens_per_s']:>8.0f}{r['time_vs_ctranslate2']:>10.2f}  {r['output_lengths']}")
    goal = [r for r in grid if r["beam"] == 4 and r["batch"] == 32]
    ours = min((r for r in goal if r["engine"] in ("pytorch", "onnxruntime fp32")), key=lambda r: r["seconds"])
    print(f"goal (batch 32, beam 4, fp32): our best ({ours['engine']}) takes {ours['time_vs_ctranslate2']:.2f}x "
          f"CTranslate2's time (goal 1.5x or less)")
    profile = _profile(exported, ct2["fp32"], fixed_sources, args.fixed) if args.profile else None
    result = {"arch": exported.arch.summary(), "sentences": len(source), "beam": args.beam, "threads": args.threads,
              "rounds": args.rounds, "engines": rows, "quantized": report, "fixed_tokens": args.fixed,
              "fixed_sentences": len(fixed_sources), "fixed_length": grid,
              "goal_ratio": {"engine": ours["engine"], "time_vs_ctranslate2": ours["time_vs_ctranslate2"]},
              "profile": profile}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
