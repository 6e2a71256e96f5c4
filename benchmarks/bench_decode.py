"""Decoding speed: key/value-cached against recomputing decoding, and against torch.nn.Transformer.

Run: ``python benchmarks/bench_decode.py [search_spaces/quickstart.yaml] [--tokens 30] [--threads 1]``

Greedy decoding of exactly ``--tokens`` output tokens per sentence (no early stop, so every
variant does the same work), batch size 1, over the first validation sentences. Printed side
by side from one run (interleaved rounds, medians):

- our extracted model with the key/value cache vs the same model recomputing the whole prefix
  at every step (goal >= 3x);
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

from nas.data import EOS_ID
from nas.model.layers import sinusoidal_positions
from nas.model.supernet import SuperTransformer, extract
from nas.search.runner import prepare_sweep_data
from nas.space.arch import Arch, StackArch
from nas.space.space import SearchSpace
from nas.space.spec import load_spec
from trainers import build_supernet


@torch.no_grad()
def greedy_cached(model: SuperTransformer, src: torch.Tensor, steps: int) -> None:
    memory, pad = model.encode(src)
    cache = [{} for _ in model.decoder]
    token = torch.full((src.size(0), 1), 2)
    for step in range(steps):
        token = model.decode_step(token, step, memory, pad, None, cache).argmax(-1, keepdim=True)


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
        memory = self.core.encoder(self._emb(src))
        out = torch.full((src.size(0), 1), 2)
        for _ in range(steps):
            mask = nn.Transformer.generate_square_subsequent_mask(out.size(1))
            h = self.core.decoder(self._emb(out), memory, tgt_mask=mask, tgt_is_causal=True)
            out = torch.cat([out, (h[:, -1] @ self.embed.weight.T).argmax(-1, keepdim=True)], 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", nargs="?", default="search_spaces/quickstart.yaml")
    parser.add_argument("--tokens", type=int, default=30)
    parser.add_argument("--sentences", type=int, default=10)
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
    ref = TorchReference(data.vocab_size, sn.model_dim, sn.heads, one_branch.encoder.layers,
                         one_branch.decoder.layers, one_branch.encoder.ffn_width[0]).eval()
    src_ids, _ = data.load_split("valid")
    sources = [torch.tensor([ids[:60] + [EOS_ID]]) for ids in src_ids[: args.sentences]]
    runs = {
        "ours, key/value cache": lambda s: greedy_cached(model, s, args.tokens),
        "ours, recompute the prefix": lambda s: greedy_recompute(model, s, args.tokens),
        "torch.nn.Transformer, recompute the prefix": lambda s: ref.greedy(s, args.tokens),
    }
    times = {name: [] for name in runs}
    for fn in runs.values():
        fn(sources[0])  # warm-up
    for _ in range(args.rounds):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            for s in sources:
                fn(s)
            times[name].append((time.perf_counter() - t0) / len(sources) * 1000)
    med = {name: statistics.median(v) for name, v in times.items()}
    base = med["ours, key/value cache"]
    print(f"greedy, {args.tokens} output tokens, batch 1, {args.threads} thread(s), C={sn.model_dim}, "
          f"{one_branch.encoder.layers}+{one_branch.decoder.layers} layers, vocabulary {data.vocab_size}")
    print(f"{'decoder':<46}{'ms/sentence':>12}{'x ours cached':>15}")
    for name in runs:
        print(f"{name:<46}{med[name]:>12.1f}{med[name] / base:>15.2f}")
    print(f"cache speed-up: {med['ours, recompute the prefix'] / base:.2f}x (goal >= 3); "
          f"vs nn.Transformer: {med['torch.nn.Transformer, recompute the prefix'] / base:.2f}x (goal > 1)")


if __name__ == "__main__":
    main()
