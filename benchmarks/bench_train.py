"""Supernet training speed against torch.nn.Transformer, and inherited-weight evaluations per hour.

Run: ``python benchmarks/bench_train.py [search_spaces/quickstart.yaml] [--steps 30] [--sandwich-k 0 1 2]``

Prints, side by side from one run (interleaved rounds, so machine noise hits both alike):
- training tokens/s of the supernet's widest sub-Transformer vs ``torch.nn.Transformer``
  (same dimensions, pre-norm, tied embeddings, same batches, same precision), and their ratio
  (goal: nn.Transformer / supernet time <= 1.15);
- training tokens/s of one sandwich-rule step (widest + narrowest + k random, for each ``--sandwich-k``)
  relative to the widest alone;
- inherited-weight evaluations per hour: ``score_arch`` (BLEU, chrF, loss, params, latency) of
  random sub-Transformers on ``--valid`` validation sentences.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import time

import torch
from torch import nn

from nas.data import TokenBatcher
from nas.model.ops import sinusoidal_positions
from nas.model.io import load_model
from nas.model.losses import label_smoothed_nll
from nas.precision import autocast_for, resolve_precision
from nas.builders import prepare_sweep_data
from nas.search.trials import score_arch
from nas.space.arch import Arch, StackArch
from nas.space.space import SearchSpace
from nas.space import load_spec
from nas.builders import build_supernet
from trainers import check_fingerprint, supernet_fingerprint


REG = None
"""The supernet's training regularisation (its dropout, no drop-branch), set in main()."""


class Reference(nn.Module):
    """Pre-norm nn.Transformer with tied embeddings and sinusoidal positions (the baseline)."""

    def __init__(self, vocab: int, dim: int, heads: int, enc: int, dec: int, ffn: int, dropout: float) -> None:
        super().__init__()
        self.dim = dim
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.register_buffer("pe", sinusoidal_positions(1024, dim), persistent=False)
        self.core = nn.Transformer(dim, heads, enc, dec, ffn, dropout, norm_first=True, batch_first=True)
        self.drop = nn.Dropout(dropout)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        emb = lambda x: self.drop(self.embed(x) * math.sqrt(self.dim) + self.pe[: x.size(1)])
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.size(1))
        h = self.core(emb(src), emb(tgt), tgt_mask=mask, src_key_padding_mask=src.eq(0),
                      memory_key_padding_mask=src.eq(0), tgt_is_causal=True)
        return h @ self.embed.weight.T


def _step(model, optimizer, batch, archs, autocast, smoothing):
    optimizer.zero_grad(set_to_none=True)
    for arch in archs:
        with autocast:
            logits = model(batch.src, batch.tgt_in) if arch is None else model(batch.src, batch.tgt_in, arch, reg=REG)
        loss, _ = label_smoothed_nll(logits, batch.tgt_out, smoothing)
        (loss / batch.ntokens).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", nargs="?", default="search_spaces/quickstart.yaml")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per model and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--valid", type=int, default=200, help="validation sentences per evaluation")
    parser.add_argument("--evals", type=int, default=3, help="random sub-Transformers evaluated")
    parser.add_argument("--sandwich-k", type=int, nargs="+", default=None,
                        help="random sub-Transformers per sandwich step to time, e.g. 0 1 2 (default: train.sandwich_k)")
    args = parser.parse_args()

    spec = load_spec(args.spec)
    data = prepare_sweep_data(spec)
    space = SearchSpace.from_spec(spec)
    sn, tr = spec.supernet, spec.train
    torch.manual_seed(0)
    supernet = build_supernet(spec, data.vocab_size).train()
    global REG
    REG = supernet.regularization(drop_branch=0.0)  # nn.Transformer has no drop-branch: the same computation
    widest = space.widest()
    if len(set(widest.encoder.ffn_width + widest.decoder.ffn_width)) != 1:
        raise SystemExit("the nn.Transformer reference needs one FFN width in every layer")
    ref = Reference(data.vocab_size, sn.model_dim, sn.model_dim // sn.head_width, widest.encoder.layers, widest.decoder.layers,
                    widest.encoder.ffn_width[0], sn.dropout).train()
    batcher = TokenBatcher(data.corpus("train"), tr.max_tokens, seed=0)
    batches = list(itertools.islice(batcher.batches(0), args.steps))
    precision = resolve_precision(tr.precision, "cpu")  # auto: fp32 where bf16 would be emulated
    autocast = autocast_for(precision, "cpu")
    rng = random.Random(0)
    one_branch = Arch(*(StackArch(st.width, st.ffn_width, (1,) * st.layers) for st in (widest.encoder, widest.decoder)))
    runs = {
        "nn.Transformer": (ref, lambda: [None]),
        "supernet, nn.Transformer's dims": (supernet, lambda: [one_branch]),
        "supernet widest": (supernet, lambda: [widest]),
    }
    for k in args.sandwich_k if args.sandwich_k is not None else [tr.sandwich_k]:
        runs[f"sandwich (widest+narrowest+{k})"] = (
            supernet, lambda k=k: [widest, space.narrowest()] + [space.sample(rng) for _ in range(k)])
    optimizers = {name: torch.optim.Adam(m.parameters(), lr=1e-4) for name, (m, _) in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    ntok = sum(b.ntokens for b in batches)
    print(f"{spec.name}: C={sn.model_dim}, widest {widest.summary()}, {len(batches)} batches of <= {tr.max_tokens} "
          f"tokens, {precision}, {torch.get_num_threads()} threads")
    for name, (model, archs) in runs.items():  # warm-up
        _step(model, optimizers[name], batches[0], archs(), autocast, tr.label_smoothing)
    for _ in range(args.rounds):
        for name, (model, archs) in runs.items():
            t0 = time.perf_counter()
            for b in batches:
                _step(model, optimizers[name], b, archs(), autocast, tr.label_smoothing)
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["supernet widest"])
    print(f"{'model':<42}{'tokens/s':>12}{'time / supernet widest':>26}")
    for name in runs:
        t = statistics.median(times[name])
        print(f"{name:<42}{ntok / t:>12.0f}{t / base:>26.3f}")
    ratio = statistics.median(times["supernet, nn.Transformer's dims"]) / statistics.median(times["nn.Transformer"])
    print(f"supernet / nn.Transformer time ratio at the same dimensions (1 branch): {ratio:.3f} (goal <= 1.15)")

    if args.evals == 0:
        return
    trained = spec.run_dir / "supernet"
    if (trained / "supernet.safetensors").is_file():  # realistic output lengths need trained weights
        check_fingerprint(trained, supernet_fingerprint(spec, data))
        supernet = load_model(trained, "supernet")
        print(f"evaluating with the trained supernet in {trained}")
    else:
        print("evaluating with untrained weights (run `nas sweep` first for realistic decoding lengths)")
    supernet.eval()
    torch.set_num_threads(max(1, int(spec.search.cpu_per_trial)))
    small = spec.model_copy(update={"search": spec.search.model_copy(update={"valid_sentences": args.valid})})
    durations = []
    for i in range(args.evals):
        arch = space.sample(random.Random(100 + i))
        t0 = time.perf_counter()
        m = score_arch(supernet, arch, small, data)
        durations.append(time.perf_counter() - t0)
        print(f"eval {i}: {arch.summary()} {durations[-1]:.1f} s (BLEU {m['bleu']:.2f}, latency {m['latency_ms']:.1f} ms)")
    per_sentence = statistics.median(durations) / args.valid
    n_valid = len(data.valid_text()[0])
    print(f"inherited-weight evaluations per hour ({torch.get_num_threads()} thread(s), beam {spec.search.beam_size}): "
          f"{3600 / statistics.median(durations):.0f} on {args.valid} sentences, "
          f"~{3600 / (per_sentence * n_valid):.0f} on the full {n_valid}-sentence validation set")


if __name__ == "__main__":
    main()
