"""Our decoder's incremental step, eager against ``torch.compile`` (issue 41: a compiled step is the lever left at
batch 1, where the eager step is bound by per-op dispatch).

Run: ``python benchmarks/bench_compile_step.py [--yaml benchmarks/plain_transformer.yaml] [--threads 1] [--beam 4]
[--sentences 8] [--steps 30] [--rounds 3] [--dynamic | --no-dynamic | --auto-dynamic] [--no-duck-shape] [--no-grad]
[--past-present [--profile]]``

The YAML's widest arch, freshly initialised (seed 0; fixed-length decoding does the same work whatever the weights),
translates ``--sentences`` random sources of 12 tokens one at a time (batch 1) with beam search of exactly
``--steps`` decoder steps (``min_len = max_len``, as ``bench_serving.py``'s fixed rows). Printed: the eager
decoder's ms per sentence and per step (median of ``--rounds``), then the same with
:meth:`nas.model.decode.IncrementalDecoder.step` wrapped in ``torch.compile`` (inductor): the first run's seconds
(compilation), ms per step, the ratio to eager, and whether the tokens are the same. A compilation that fails is
reported with its error's last line instead (exit 0: the failure is the measurement). ``--no-grad`` runs beam search
under ``torch.no_grad`` instead of its ``torch.inference_mode`` (and also prints the eager decoder under
``torch.inference_mode``, the figure to beat). ``--auto-dynamic`` passes ``dynamic=None`` (static first, dynamic once a
shape changes); ``--no-duck-shape`` gives sizes that happen to be equal (4 rows, 4 heads) their own symbols
(``torch.fx.experimental._config.use_duck_shape``).

``--past-present`` times :meth:`nas.model.supernet.SuperTransformer.decode_step` instead, the ONNX step's
interface (the state in, the grown state out, nothing kept between calls): ``--steps`` greedy steps of ``--beam``
rows (one sentence's beams, never reordered: the step alone, without beam search's bookkeeping), eager against
``torch.compile(dynamic=True)``, median of ``--rounds`` decodings of each, and the largest logit difference;
``--profile`` adds the compiled step's top ``torch.profiler`` ops.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--yaml", type=Path, default=REPO / "benchmarks" / "plain_transformer.yaml")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--sentences", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dynamic", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile(dynamic=...): the cache grows by one position a step")
    parser.add_argument("--auto-dynamic", action="store_true", help="torch.compile(dynamic=None)")
    parser.add_argument("--no-duck-shape", action="store_true", help="equal sizes get their own symbols")
    parser.add_argument("--no-grad", action="store_true")
    parser.add_argument("--past-present", action="store_true",
                        help="time SuperTransformer.decode_step (state in, state out) instead")
    parser.add_argument("--profile", action="store_true", help="with --past-present: the compiled step's top ops")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(REPO))
    import torch

    torch.set_num_threads(args.threads)
    from nas.builders import build_supernet
    from nas.model import beam_search
    from nas.model import decode
    from nas.space import load_spec

    spec = load_spec(args.yaml, check_files=False)
    torch.manual_seed(0)
    vocab = spec.data.tokenizer.vocab_size  # the size SentencePiece would train to
    model = build_supernet(spec, vocab).eval()
    gen = torch.Generator().manual_seed(1)
    eos = torch.tensor([[3]])
    sources = [torch.cat([torch.randint(4, vocab, (1, 12), generator=gen), eos], 1) for _ in range(args.sentences)]
    search = torch.no_grad()(beam_search.__wrapped__) if args.no_grad else beam_search
    if args.past_present:
        _past_present(model, sources[0].repeat(args.beam, 1), args)
        return

    def run() -> list[list[int]]:
        return [search(model, s, beam_size=args.beam, max_len_a=0.0, max_len_b=args.steps, min_len=args.steps)[0]
                for s in sources]

    def timed() -> tuple[float, list[list[int]]]:
        times, out = [], None
        for _ in range(args.rounds):
            start = time.perf_counter()
            out = run()
            times.append(time.perf_counter() - start)
        return statistics.median(times) / len(sources) * 1000, out

    print(f"{args.yaml.name}: widest arch, vocabulary {vocab}, untrained; batch 1, beam {args.beam}, {args.steps} "
          f"steps, {args.sentences} sentences, {args.threads} thread(s), torch {torch.__version__}", flush=True)
    run()  # warm-up
    eager_ms, eager_out = timed()
    print(f"eager:    {eager_ms:8.1f} ms/sentence  {eager_ms / args.steps:6.2f} ms/step", flush=True)
    if args.no_grad:  # the figure to beat: the eager decoder as beam_search runs it
        search, no_grad_search = beam_search, search
        run()
        inference_ms, _ = timed()
        search = no_grad_search
        print(f"eager under torch.inference_mode: {inference_ms:8.1f} ms/sentence  {inference_ms / args.steps:6.2f} "
              f"ms/step", flush=True)
        eager_ms = inference_ms

    if args.no_duck_shape:
        import torch.fx.experimental._config as fx_config

        fx_config.use_duck_shape = False
    torch._dynamo.config.cache_size_limit = 64  # the default 8 gives up (eager) after 8 shapes of the rows
    step = decode.IncrementalDecoder.step
    compiled = torch.compile(step, dynamic=None if args.auto_dynamic else args.dynamic)
    decode.IncrementalDecoder.step = lambda self, tokens: compiled(self, tokens)
    try:
        start = time.perf_counter()
        try:
            run()
        except Exception as e:  # the failure is the finding
            last = [line for line in str(e).splitlines()  # not dynamo's "Set TORCHDYNAMO_VERBOSE=1 ..." advice
                    if line.strip() and "TORCHDYNAMO" not in line and "TORCH_LOGS" not in line]
            print(f"compiled: FAILED after {time.perf_counter() - start:.1f} s ({type(e).__name__}: "
                  f"{last[-1] if last else ''})")
            return
        print(f"compiled: first run {time.perf_counter() - start:.1f} s (compilation)", flush=True)
        comp_ms, comp_out = timed()
        print(f"compiled: {comp_ms:8.1f} ms/sentence  {comp_ms / args.steps:6.2f} ms/step  "
              f"{comp_ms / eager_ms:.2f}x eager{' (inference_mode)' if args.no_grad else ''}; same tokens: "
              f"{comp_out == eager_out}")
    finally:
        decode.IncrementalDecoder.step = step


def _past_present(model, src, args: argparse.Namespace) -> None:
    """``--past-present``: eager against compiled ``decode_step`` on ``src [rows, s]`` (see the module docstring)."""
    import torch

    arch = model.check_arch(None)

    def step(tokens, pos, memory, src_pad, cache_in):
        cache = [{part: dict(tensors) for part, tensors in layer.items()} for layer in cache_in]
        return model.decode_step(tokens, pos, memory, src_pad, arch, cache), cache

    @torch.inference_mode()
    def decode(fn) -> tuple[float, torch.Tensor]:
        memory, src_pad = model.encode(src, arch)
        logits, cache = step(torch.full((src.size(0), 1), 2), 0, memory, src_pad, [{} for _ in model.decoder])
        out, start = [logits], time.perf_counter()  # step 0 eager: it fills the cross-attention keys/values
        for pos in range(1, args.steps):
            logits, cache = fn(logits.argmax(-1, keepdim=True), pos, memory, src_pad, cache)
            out.append(logits)
        return (time.perf_counter() - start) / (args.steps - 1) * 1000, torch.stack(out)

    print(f"decode_step, {src.size(0)} rows, {args.steps} greedy steps, {args.threads} thread(s)", flush=True)
    decode(step)
    eager = [decode(step) for _ in range(args.rounds)]
    eager_ms = statistics.median(ms for ms, _ in eager)
    print(f"eager:    {eager_ms:6.2f} ms/step", flush=True)
    compiled = torch.compile(step, dynamic=True)
    start = time.perf_counter()
    decode(compiled)
    print(f"compiled: first decoding {time.perf_counter() - start:.1f} s (compilation)", flush=True)
    runs = [decode(compiled) for _ in range(args.rounds)]
    comp_ms = statistics.median(ms for ms, _ in runs)
    diff = (runs[0][1] - eager[0][1]).abs().max().item()
    print(f"compiled: {comp_ms:6.2f} ms/step  {comp_ms / eager_ms:.2f}x eager; largest logit difference {diff:.1e}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            decode(compiled)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
