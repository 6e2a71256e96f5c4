"""Decoding speed: key/value-cached against recomputing decoding, and against torch.nn.Transformer.

Run: ``python benchmarks/bench_decode.py [search_spaces/quickstart.yaml] [--tokens 30] [--batch 8] [--threads 1]``

Greedy decoding of exactly ``--tokens`` output tokens per sentence (no early stop, so every
variant does the same work) over the first validation sentences, at batch size 1 and at
``--batch`` (PAD-padded batches). Printed side by side from one run (interleaved rounds, medians,
time per sentence including its encoding):

- our extracted model with the key/value cache (``IncrementalDecoder``: weights cropped once,
  preallocated self-attention keys/values, cross-attention keys/values computed once) vs the
  same model recomputing the whole prefix with ``model.decode`` at every step (goal >= 3x);
- ``torch.nn.Transformer`` of the same dimensions recomputing the prefix (the usual greedy
  loop) vs our cached extracted model (goal: ours faster).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from torch import nn

from nas.data import EOS_ID, PAD_ID
from nas.model.decode import IncrementalDecoder
from nas.model.ops import sinusoidal_positions
from nas.model.supernet import SuperTransformer, extract
from nas.builders import prepare_sweep_data
from nas.space.arch import Arch, StackArch
from nas.space.space import SearchSpace
from nas.space import load_spec
from nas.builders import build_supernet


@torch.no_grad()
def greedy_cached(model: SuperTransformer, src: torch.Tensor, steps: int) -> None:
    memory, pad = model.encode(src)
    decoder = IncrementalDecoder(model, memory, pad, max_len=steps)
    token = torch.full((src.size(0), 1), 2)
    for _ in range(steps):
        token = decoder.step(token).argmax(-1, keepdim=True)


@torch.no_grad()
def greedy_recompute(model: SuperTransformer, src: torch.Tensor, steps: int) -> None:
    memory, pad = model.encode(src)
    out = torch.full((src.size(0), 1), 2)
    for _ in range(steps):
        out = torch.cat([out, model.decode(out, memory, pad)[:, -1].argmax(-1, keepdim=True)], 1)


class TorchReference(nn.Module):
    """Pre-norm ``nn.Transformer`` with tied embeddings: the usual greedy loop recomputes the prefix."""

    def __init__(self, vocab: int, dim: int, heads: int, enc: int, dec: int, ffn: int) -> None:
        super().__init__()
        self.dim = dim
        self.embed = nn.Embedding(vocab, dim)
        self.register_buffer("pe", sinusoidal_positions(1024, dim), persistent=False)
        self.core = nn.Transformer(dim, heads, enc, dec, ffn, 0.0, norm_first=True, batch_first=True)

    def _emb(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x) * math.sqrt(self.dim) + self.pe[: x.size(1)]

    @torch.no_grad()
    def greedy(self, src: torch.Tensor, steps: int) -> None:
        pad = src.eq(PAD_ID)  # [b, s]
        memory = self.core.encoder(self._emb(src), src_key_padding_mask=pad)
        out = torch.full((src.size(0), 1), 2)
        for _ in range(steps):
            mask = nn.Transformer.generate_square_subsequent_mask(out.size(1))
            h = self.core.decoder(self._emb(out), memory, tgt_mask=mask, tgt_is_causal=True,
                                  memory_key_padding_mask=pad)
            out = torch.cat([out, (h[:, -1] @ self.embed.weight.T).argmax(-1, keepdim=True)], 1)


def _batches(src_ids: list[list[int]], count: int, batch: int) -> list[torch.Tensor]:
    """``count`` sentences (up to 60 ids + EOS) as PAD-padded ``[batch, s]`` tensors."""
    rows = [ids[:60] + [EOS_ID] for ids in src_ids[:count]]
    out = []
    for i in range(0, len(rows) - batch + 1, batch):
        chunk = rows[i:i + batch]
        src = torch.full((batch, max(map(len, chunk))), PAD_ID, dtype=torch.long)  # [b, s]
        for r, ids in enumerate(chunk):
            src[r, : len(ids)] = torch.tensor(ids)
        out.append(src)
    return out


def _time(runs: dict, batches: list[torch.Tensor], rounds: int) -> dict[str, float]:
    """Median over interleaved rounds of each run's time per sentence (ms)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():
        fn(batches[0])  # warm-up
    sentences = sum(b.size(0) for b in batches)
    for _ in range(rounds):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            for src in batches:
                fn(src)
            times[name].append((time.perf_counter() - t0) / sentences * 1000)
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", nargs="?", default="search_spaces/quickstart.yaml")
    parser.add_argument("--tokens", type=int, default=30)
    parser.add_argument("--sentences", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8, help="the second batch size (the first is 1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    spec = load_spec(args.spec)
    data = prepare_sweep_data(spec, progress=False)
    widest = SearchSpace.from_spec(spec).widest()
    one_branch = Arch(*(StackArch(s.width, s.ffn_width) for s in (widest.encoder, widest.decoder)))
    model = extract(build_supernet(spec, data.vocab_size), one_branch).eval()  # nn.Transformer's dims
    sn = spec.supernet
    if len(set(one_branch.encoder.ffn_width + one_branch.decoder.ffn_width)) != 1:
        raise SystemExit("the nn.Transformer reference needs one FFN width in every layer")
    ref = TorchReference(data.vocab_size, sn.model_dim, sn.model_dim // sn.head_width, one_branch.encoder.layers,
                         one_branch.decoder.layers, one_branch.encoder.ffn_width[0]).eval()
    src_ids, _ = data.load_split("valid")
    runs = {
        "ours, key/value cache": lambda s: greedy_cached(model, s, args.tokens),
        "ours, recompute the prefix": lambda s: greedy_recompute(model, s, args.tokens),
        "torch.nn.Transformer, recompute the prefix": lambda s: ref.greedy(s, args.tokens),
    }
    print(f"greedy, {args.tokens} output tokens, {args.threads} thread(s), extracted {spec.name} model: "
          f"C={sn.model_dim}, {sn.model_dim // sn.head_width} heads of {sn.head_width}, {one_branch.encoder.layers}+{one_branch.decoder.layers} layers, "
          f"FFN {one_branch.encoder.ffn_width[0]}, vocabulary {data.vocab_size}; {args.sentences} validation "
          f"sentences, median of {args.rounds} interleaved rounds")
    print(f"{'batch':>5}  {'decoder':<44}{'ms/sentence':>12}{'x ours cached':>15}")
    summary = []
    for batch in (1, args.batch):
        med = _time(runs, _batches(src_ids, args.sentences, batch), args.rounds)
        base = med["ours, key/value cache"]
        for name in runs:
            print(f"{batch:>5}  {name:<44}{med[name]:>12.2f}{med[name] / base:>15.2f}")
        summary.append(f"batch {batch}: cache speed-up {med['ours, recompute the prefix'] / base:.2f}x (goal >= 3), "
                       f"vs nn.Transformer {med['torch.nn.Transformer, recompute the prefix'] / base:.2f}x (goal > 1)")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
