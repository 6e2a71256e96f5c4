"""Serving speed and quality of one exported sub-Transformer on every engine we ship, side by side in one run.

Run: ``python benchmarks/bench_serving.py EXPORT_DIR [--sentences 1000] [--beam 4] [--threads 2] [--json OUT]``

``EXPORT_DIR`` is a folder written by ``nas export`` (e.g. ``exported/quickstart`` after
``scripts/quickstart.sh``). The benchmark writes, under ``--work``, the ONNX graphs of that export
(``export_onnx``) and an int8 copy of them (``quantize_onnx``), then translates the first ``--sentences``
of Multi30k ``test_2016_flickr`` with

- ``pytorch``: the exported model with its key/value cache (``nas translate``'s path);
- ``onnxruntime fp32``: the ONNX graphs under onnxruntime (``translate_onnx.py``'s path);
- ``onnxruntime int8``: the same graphs with int8 matrix weights (``nas export --quantize int8``).

and prints, per engine: BLEU and chrF (sacrebleu, against the reference), seconds, sentences/s and
target tokens/s (SentencePiece pieces of the output), and each engine's time against PyTorch's and int8's
BLEU against fp32's. Each engine translates the set ``--rounds`` times (interleaved); the median time counts.
CTranslate2 (issue 17) is not in this run yet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import sacrebleu
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nas.data import read_lines  # noqa: E402
from nas.export import load_export  # noqa: E402
from nas.export.onnx import export_onnx, quantize_onnx  # noqa: E402
from nas.export.translate_onnx import OnnxTranslator  # noqa: E402

DATA = REPO.parent / "shared" / "data" / "multi30k"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export", type=Path, help="a folder written by `nas export`")
    parser.add_argument("--src", type=Path, default=DATA / "test_2016_flickr.en.gz")
    parser.add_argument("--ref", type=Path, default=DATA / "test_2016_flickr.de.gz")
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("bench_serving_work"), help="ONNX copies (rewritten)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    source = read_lines(args.src, limit=args.sentences)
    reference = read_lines(args.ref, limit=args.sentences)
    fp32_dir, int8_dir = args.work / "fp32", args.work / "int8"
    for folder in (fp32_dir, int8_dir):  # an earlier run's copies are replaced, any other folder refused
        export_onnx(args.export, folder)
    report = quantize_onnx(int8_dir)

    exported = load_export(args.export)
    engines = {
        "pytorch": lambda lines: exported.translate(lines, beam_size=args.beam),
        "onnxruntime fp32": (lambda t: lambda lines: t.translate(lines, args.beam))(OnnxTranslator(fp32_dir, args.threads)),
        "onnxruntime int8": (lambda t: lambda lines: t.translate(lines, args.beam))(OnnxTranslator(int8_dir, args.threads)),
    }
    for run in engines.values():
        run(source[:8])  # warm-up
    times: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[str]] = {}
    for _ in range(args.rounds):
        for name, run in engines.items():
            start = time.perf_counter()
            outputs[name] = run(source)
            times[name].append(time.perf_counter() - start)
    rows = {}
    for name in engines:
        seconds = statistics.median(times[name])
        tokens = sum(map(len, exported.tokenizer.encode(outputs[name])))
        rows[name] = {"bleu": sacrebleu.corpus_bleu(outputs[name], [reference]).score,
                      "chrf": sacrebleu.corpus_chrf(outputs[name], [reference]).score,
                      "seconds": seconds, "sentences_per_s": len(source) / seconds, "tokens_per_s": tokens / seconds,
                      "time_vs_pytorch": seconds / statistics.median(times["pytorch"])}
    print(f"{exported.arch.summary()}; {len(source)} sentences of {args.src.name}, beam {args.beam}, "
          f"{args.threads} thread(s), median of {args.rounds} round(s)")
    print(f"{'engine':<18}{'BLEU':>7}{'chrF':>7}{'s':>8}{'sent/s':>8}{'tok/s':>8}{'time / pytorch':>16}")
    for name, r in rows.items():
        print(f"{name:<18}{r['bleu']:>7.2f}{r['chrf']:>7.2f}{r['seconds']:>8.1f}{r['sentences_per_s']:>8.1f}"
              f"{r['tokens_per_s']:>8.0f}{r['time_vs_pytorch']:>16.2f}")
    fp32, int8 = rows["onnxruntime fp32"], rows["onnxruntime int8"]
    print(f"int8 vs fp32 (onnxruntime): BLEU {int8['bleu'] - fp32['bleu']:+.2f} (goal within 0.3), speed-up "
          f"{fp32['seconds'] / int8['seconds']:.2f}x; weight products made int8: "
          + ", ".join(f"{g} {r['quantized']}" for g, r in report.items()))
    result = {"arch": exported.arch.summary(), "sentences": len(source), "beam": args.beam, "threads": args.threads,
              "rounds": args.rounds, "engines": rows, "quantized": report}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
