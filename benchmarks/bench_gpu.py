"""GPU training speed and model FLOPs utilisation (MFU): the widest sub-Transformer and a sandwich step against
torch.nn.Transformer at the same dimensions.

Run: ``python benchmarks/bench_gpu.py [search_spaces/multi30k_en_de.yaml] [--max-tokens 32768] [--compile] [--json PATH]``

Prints, side by side from one run, for each row: target tokens/s, the analytic training TFLOP/s achieved, MFU
(those FLOP/s over the device's dense bf16 peak, :data:`PEAK_BF16_TFLOPS`), peak GPU memory and the tokens/s
ratio to ``torch.nn.Transformer``:

- ours, the plain widest (the widest's widths and FFN widths with 1 branch, path and unit, sequential layers):
  extracted (a standalone model) and run inside the supernet (weights cropped every step);
- ``torch.nn.Transformer`` at the same dimensions: pre-norm, tied embeddings, sinusoidal positions, the same
  dropout, precision (bf16 autocast on CUDA), loss and fused Adam (goal: ours >= 0.9x its tokens/s);
- ours, the true widest in the supernet (with its branches, paths, units), when it differs from the plain one;
- one sandwich step (the widest, the narrowest and ``--sandwich-k`` random sub-Transformers on the batch);
- with ``--compile`` (CUDA): the plain widest and the sandwich step under ``torch.compile``, with the sandwich
  step's recompiles (its arch changes every step) and whether compiling paid.

Goal (issue): MFU >= 40% on an H100 at a large token batch (32k tokens); reported on any device.

Batches are synthetic (random ids, fixed lengths ``--src-len``/``--tgt-len``, ``--max-tokens // --tgt-len``
rows): no SentencePiece model, no data preparation. The script imports torch and the project's own code only
(``nas`` model, space, data and precision code, and the trainer's ``sandwich_step``, Adam and regularisation),
none of Ray, Optuna or MLflow, which a GPU machine may not have.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import random
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nas.builders import supernet_config
from nas.data import BOS_ID, EOS_ID, PAD_ID, Batch
from nas.atomic import atomic_write_text
from nas.model.losses import label_smoothed_nll
from nas.model.ops import sinusoidal_positions
from nas.model.regularization import Regularization
from nas.model.supernet import SuperTransformer, extract
from nas.precision import DeviceSettings, autocast_for, resolve_precision, training_device
from nas.space import SweepSpec, load_spec
from nas.space.arch import Arch, LayerArch, StackArch
from nas.space.space import SearchSpace
from trainers.optim import make_optimizer
from trainers.regularization_schedule import step_regularization
from trainers.stages.base import SandwichArchs
from trainers.stages.sandwich import sandwich_step

FIRST_WORD_ID = 4
"""The first id of an ordinary token (after PAD, UNK, BOS, EOS)."""

PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("H100 PCIe", 756.5),
    ("H100 NVL", 835.5),
    ("H200 NVL", 835.5),
    ("H100 SXM", 989.4),
    ("H100 80GB HBM3", 989.4),  # what torch.cuda.get_device_name() calls the H100 SXM
    ("H200", 989.4),
    ("A100", 312.0),
    ("L40S", 362.05),
    ("A10G", 70.0),
]
"""Dense (no 2:4 sparsity) bf16 tensor-core peak, TFLOP/s, by a substring of the device name (first match wins,
case-insensitive). Sources: NVIDIA's datasheets, which print the sparse figure, twice these: H100 (SXM 1979,
PCIe 1513, NVL 1671 TFLOPS "with sparsity"), H200 (SXM 1979, NVL 1671), A100 (312 dense), L40S (362.05 dense,
733 with sparsity); A10G: AWS's G5 instance figure (the A10G is not on NVIDIA's public datasheets)."""


def peak_bf16_tflops(device_name: str) -> float | None:
    """The dense bf16 peak (TFLOP/s) of a CUDA device named ``device_name`` (``torch.cuda.get_device_name``),
    or None for a device not in :data:`PEAK_BF16_TFLOPS` (pass ``--peak-tflops``)."""
    name = device_name.lower()
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key.lower() in name), None)


def _attention_flops(c: int, width: int, branches: int, groups: int, rows: int, q_len: int, kv_len: int,
                     relative: int = 0) -> int:
    """Forward FLOPs of one (multi-branch) attention sublayer for every one of ``groups`` (units x paths).

    ``rows`` sentences of ``q_len`` queries attend to ``kv_len`` keys (self-attention: ``kv_len == q_len``,
    keys and values projected from the queries' input; cross-attention: from the ``kv_len`` memory positions).
    The ``branches`` branches of width D are ``branches`` attentions of width D (MAT eq. 4)."""
    bd = branches * width  # all branches' heads together: B*h heads of D/h channels
    queries, keys = rows * q_len, rows * kv_len
    projections = 2 * queries * c * bd + 2 * keys * c * 2 * bd + 2 * queries * bd * c  # q; k and v; output
    scores = 2 * 2 * rows * q_len * kv_len * bd  # q k^T and probs v, every position pair (causal counted full)
    if relative:  # Shaw et al. eq. 4 (q a^K over the 2k+1 distances) and eq. 3 (probs a^V)
        scores += 2 * queries * (2 * relative + 1) * bd + 2 * rows * q_len * kv_len * bd
    return groups * (projections + scores)


def _layer_flops(layer: LayerArch, c: int, rows: int, length: int, memory_len: int | None, relative: int) -> int:
    """Forward FLOPs of one encoder (``memory_len`` None) or decoder layer with choices ``layer`` on ``rows`` x
    ``length`` positions of C channels (decoder: cross-attending to ``memory_len`` positions)."""
    groups = layer.units * (layer.paths if layer.layout == "sequential" else 1)
    tokens = rows * length
    flops = _attention_flops(c, layer.width, layer.branches, groups, rows, length, length,
                             relative if memory_len is None else 0)
    if memory_len is not None:
        flops += _attention_flops(c, layer.width, layer.branches, groups, rows, length, memory_len)
    flops += groups * 2 * 2 * tokens * c * layer.ffn_width  # the FFN's two linear maps
    if layer.layout == "prime" and layer.kernels:  # Unified Transformer eq. 5-7: kernel generator, taps, output
        flops += layer.units * 2 * tokens * (c * sum(layer.kernels) + layer.width * max(layer.kernels)
                                             + layer.width * c)
    return flops


def forward_flops(arch: Arch, *, model_dim: int, vocab_size: int, batch: int, src_len: int, tgt_len: int,
                  embed_dim: int | None = None, io_projection: bool = False, relative_positions: int = 0) -> int:
    """Analytic forward FLOPs of ``arch`` on ``batch`` sentence pairs of ``src_len`` source and ``tgt_len``
    target tokens (teacher forcing): ``2 m n k`` for each ``[m, k] @ [k, n]`` matrix product.

    Counted, per layer l with attention width D_l, FFN width F_l, B_l branches (B_l attentions of width D_l,
    MAT eq. 4), P_l paths and U_l units (each multiplies its sublayers: Multi-Path eq. 4, MUTE eq. 10): the
    q/k/v and output projections, the attention scores ``q k^T`` and ``probs v`` over every position pair (the
    decoder's causal self-attention counted full, as PaLM's MFU does), the cross-attention (keys and values
    projected from the ``k * src_len`` memory positions of the last k encoder layers a decoder layer attends to,
    :attr:`Arch.attended_layers`, HAT sec. 3.1), the FFN's two linear maps, Prime's convolution
    (its kernel generator, depthwise taps and output projection) and relative-position terms (Shaw et al.
    eq. 3-4), the input/output projections of Scalable Transformers eq. 3 (``io_projection``) and the output
    projection to the vocabulary. Not counted (standard: PaLM, Chowdhery et al. 2022, appendix B; Megatron-LM,
    Narayanan et al. 2021, sec. 5.1): embedding lookups, positions, softmax, layer norms, dropout, residual
    and PathNorm additions, the weighted sum of units, and products of weights alone (crops, folded layer-norm
    affines), which do not grow with the batch.

    Args:
        model_dim: C, the layers' width when ``arch.model_width`` is None (channels).
        embed_dim: E, the word-embedding width (channels; default C): the output projection is ``[E, V]``.
        relative_positions: Shaw et al.'s clipping distance k of the encoder self-attention (0: none).
    Returns:
        FLOPs of one forward pass; training (forward and backward) is 3x this (the backward pass computes
        two products per forward product: the input's and the weight's gradients).
    """
    c = arch.model_width or model_dim
    e = embed_dim or model_dim
    flops = sum(_layer_flops(d, c, batch, src_len, None, relative_positions) for d in arch.encoder.layer_dims())
    flops += sum(_layer_flops(d, c, batch, tgt_len, k * src_len, 0)
                 for d, k in zip(arch.decoder.layer_dims(), arch.attended_layers))
    if io_projection:  # W'_e on every source and target position, W'_o on every target position
        flops += 2 * batch * (src_len + tgt_len) * e * c + 2 * batch * tgt_len * c * e
    return flops + 2 * batch * tgt_len * e * vocab_size


def model_forward_flops(model: SuperTransformer, arch: Arch, batch: int, src_len: int, tgt_len: int) -> int:
    """:func:`forward_flops` of ``arch`` run by ``model`` (its widths, vocabulary and projections)."""
    return forward_flops(arch, model_dim=model.model_dim, vocab_size=model.vocab_size, batch=batch, src_len=src_len,
                         tgt_len=tgt_len, embed_dim=model.embed_dim, io_projection=model.io_projection,
                         relative_positions=model.relative_positions)


def synthetic_batch(max_tokens: int, src_len: int, tgt_len: int, vocab_size: int, device: torch.device | str,
                    seed: int = 0) -> Batch:
    """``max_tokens // tgt_len`` rows of random ids in ``[4, vocab_size)``.

    Raises:
        ValueError: no row fits, a length below 1, or a vocabulary without ordinary tokens.
    """
    rows = max_tokens // max(tgt_len, 1)
    if src_len < 1 or tgt_len < 1 or rows < 1:
        raise ValueError(f"--max-tokens {max_tokens} with --src-len {src_len} --tgt-len {tgt_len} holds no batch row")
    if vocab_size <= FIRST_WORD_ID:
        raise ValueError(f"--vocab {vocab_size} has no ordinary tokens (ids from {FIRST_WORD_ID})")
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(FIRST_WORD_ID, vocab_size, (rows, src_len), generator=g)  # [b, s]
    src[:, -1] = EOS_ID
    words = torch.randint(FIRST_WORD_ID, vocab_size, (rows, tgt_len - 1), generator=g)  # [b, t-1]
    tgt_in = torch.cat([torch.full((rows, 1), BOS_ID), words], 1)  # [b, t]
    tgt_out = torch.cat([words, torch.full((rows, 1), EOS_ID)], 1)  # [b, t]
    return Batch(src.to(device), tgt_in.to(device), tgt_out.to(device), rows * tgt_len)


class TorchReference(nn.Module):
    """Pre-norm ``nn.Transformer`` with tied embeddings (``sqrt(C) E[x]``), sinusoidal positions and an output
    projection by the embedding: the baseline at the plain widest's dimensions."""

    def __init__(self, vocab: int, dim: int, heads: int, enc: int, dec: int, ffn: int, dropout: float,
                 max_positions: int) -> None:
        super().__init__()
        self.dim = dim
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD_ID)
        self.register_buffer("pe", sinusoidal_positions(max_positions, dim), persistent=False)
        self.core = nn.Transformer(dim, heads, enc, dec, ffn, dropout, norm_first=True, batch_first=True)
        self.drop = nn.Dropout(dropout)

    def _emb(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.embed(x) * math.sqrt(self.dim) + self.pe[: x.size(1)])  # [b, t, C]

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """``src [b, s]``, ``tgt_in [b, t]`` -> logits ``[b, t, V]``."""
        pad = src.eq(PAD_ID)  # [b, s]
        mask = nn.Transformer.generate_square_subsequent_mask(tgt_in.size(1), device=tgt_in.device)  # [t, t]
        h = self.core(self._emb(src), self._emb(tgt_in), tgt_mask=mask, src_key_padding_mask=pad,
                      memory_key_padding_mask=pad, tgt_is_causal=True)  # [b, t, C]
        return F.linear(h, self.embed.weight)


def plain_arch(arch: Arch) -> Arch:
    """``arch``'s widths and FFN widths with one branch, path and unit in sequential layers (what
    ``nn.Transformer`` can express)."""
    stacks = (StackArch(st.width, st.ffn_width) for st in (arch.encoder, arch.decoder))
    return Arch(*stacks, model_width=arch.model_width)


def reference_problem(plain: Arch, model_dim: int) -> str | None:
    """Why ``nn.Transformer`` cannot have ``plain``'s dimensions (None: it can)."""
    c = plain.model_width or model_dim
    widths = set(plain.encoder.width + plain.decoder.width)
    ffn = set(plain.encoder.ffn_width + plain.decoder.ffn_width)
    if widths != {c}:
        return f"attention widths {sorted(widths)} differ from the model width {c}"
    if len(ffn) != 1:
        return f"FFN widths {sorted(ffn)} differ between layers"
    return None


@dataclasses.dataclass
class Row:
    """One timed configuration."""

    name: str
    arch: str
    """The sub-Transformer(s) trained each step (``Arch.summary``)."""
    tokens_per_s: float
    """Target tokens per second (a sandwich step trains all its archs on the same tokens)."""
    tflops_per_s: float
    """Analytic training TFLOP/s achieved (3 x :func:`forward_flops`)."""
    mfu_percent: float | None
    """``tflops_per_s`` over the device's dense bf16 peak, percent (None: no peak known)."""
    peak_memory_gib: float | None
    """``torch.cuda.max_memory_allocated`` over the row: weights, gradients, Adam state, activations (GiB)."""
    step_ms: float
    """Mean wall time of one optimizer step (ms)."""
    train_gflop_per_step: float
    """Mean analytic training GFLOPs of one step."""
    warmup_s: float
    """Wall time of the warm-up steps (s; with ``torch.compile``, its compilations)."""
    vs_nn_transformer: float | None = None
    """``tokens_per_s`` over ``torch.nn.Transformer``'s (None: no reference row)."""
    compile: dict[str, Any] | None = None
    """``torch.compile`` rows: graphs compiled, recompiles after the first step, graph breaks, limit hit."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, clip_norm: float) -> None:
    """Clip, Adam and (MUTE eq. 17-18) AutoShuffle renormalisation, as ``trainers.engine.optimizer_step``."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    optimizer.step()
    if isinstance(model, SuperTransformer):
        model.renormalize_autoshuffle_()


def run_row(name: str, arch: str, make_step: Callable[[], Callable[[int], int]], args: argparse.Namespace,
            device: torch.device, ntokens: int, peak_tflops: float | None) -> Row:
    """Build a row's model and optimizer (``make_step``), run ``--warmup`` then ``--steps`` timed steps; each
    ``step(i)`` does one optimizer step and returns its analytic training FLOPs (no host synchronisation)."""
    _free(device)
    step = make_step()
    _free(device)  # what building left behind (a supernet an extracted model was cropped from)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t0 = time.perf_counter()
    for i in range(args.warmup):
        step(i)
    _sync(device)
    t1 = time.perf_counter()
    flops = sum(step(i) for i in range(args.warmup, args.warmup + args.steps))
    _sync(device)
    seconds = time.perf_counter() - t1
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    del step
    tflops = flops / seconds / 1e12
    return Row(name=name, arch=arch, tokens_per_s=ntokens * args.steps / seconds, tflops_per_s=tflops,
               mfu_percent=None if peak_tflops is None else 100 * tflops / peak_tflops, peak_memory_gib=peak,
               step_ms=1000 * seconds / args.steps, train_gflop_per_step=flops / args.steps / 1e9,
               warmup_s=t1 - t0)


def _dynamo_counts() -> dict[str, int]:
    """Graphs compiled so far, graph breaks, and whether a function hit dynamo's recompile limit (then it runs
    eagerly: dynamo's own fallback)."""
    from torch._dynamo.utils import counters  # private but stable since torch 2.0; only with --compile

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "recompile_limit_hit": int(any("recompile limit" in k.lower() for k in counters["unimplemented"]))}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", nargs="?", default="search_spaces/multi30k_en_de.yaml")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--max-tokens", type=int, default=32768,
                        help="target tokens per batch (rows: this // --tgt-len)")
    parser.add_argument("--src-len", type=int, default=32, help="source tokens per row")
    parser.add_argument("--tgt-len", type=int, default=32, help="target tokens per row")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size (a WMT-like shared vocabulary)")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per row")
    parser.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps per row before them")
    parser.add_argument("--sandwich-k", type=int, default=1, help="random sub-Transformers per sandwich step")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile (CUDA only)")
    parser.add_argument("--compile-cpu", action="store_true", help="let --compile run on CPU (for testing)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (testing: eager)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense bf16 peak (TFLOP/s); default: looked up by the device name")
    parser.add_argument("--json", type=Path, default=None, help="also write every row and setting here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.sandwich_k < 0:
        parser.error(f"--steps {args.steps} must be >= 1, --warmup {args.warmup} and --sandwich-k "
                     f"{args.sandwich_k} >= 0")
    return args


@dataclasses.dataclass
class Bench:
    """What every row shares: the spec, the device and its settings, the precision, the batch."""

    args: argparse.Namespace
    spec: SweepSpec
    settings: DeviceSettings
    autocast: AbstractContextManager
    batch: Batch
    config: dict[str, Any]
    """The supernet's constructor arguments (:func:`supernet_config`)."""
    plain: Arch
    """The plain widest (:func:`plain_arch`): the reference's dimensions."""

    @property
    def device(self) -> torch.device:
        return self.settings.device

    def supernet(self) -> SuperTransformer:
        """A fresh supernet (seed 0) on the device, in training mode."""
        torch.manual_seed(0)
        with torch.device(self.device):
            return SuperTransformer.from_config(self.config).train()

    def reference(self, plain: Arch) -> TorchReference:
        """``nn.Transformer`` (seed 0) at ``plain``'s dimensions (:func:`reference_problem` is None)."""
        sn = self.spec.supernet
        c = plain.model_width or sn.model_dim
        torch.manual_seed(0)
        with warnings.catch_warnings():  # "enable_nested_tensor is True, but ... norm_first was True": inference only
            warnings.filterwarnings("ignore", message="enable_nested_tensor")
            return TorchReference(self.args.vocab, c, c // sn.head_width, plain.encoder.layers, plain.decoder.layers,
                                  plain.encoder.ffn_width[0], sn.dropout, sn.max_positions).to(self.device).train()

    def _flops(self, model: SuperTransformer, arch: Arch) -> int:
        """Analytic training FLOPs of one step of ``arch`` on the batch."""
        rows, s = self.batch.src.shape
        return 3 * model_forward_flops(model, arch, rows, s, self.batch.tgt_in.size(1))

    def _optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        tr = self.spec.train
        return make_optimizer(model, tr.lr, tr.weight_decay, fused=self.settings.fused_adam)

    def single(self, build: Callable[[], nn.Module], arch: Arch | None,
               reg_of: Callable[[SuperTransformer], Regularization | None] = lambda model: None,
               compiled: bool = False) -> Callable[[], Callable[[int], int]]:
        """A row training one model: ``build()`` runs ``arch`` with ``reg_of(model)`` (``arch`` None: the
        reference, whose FLOPs are those of the plain widest ``self.plain``)."""
        tr, batch = self.spec.train, self.batch

        def make() -> Callable[[int], int]:
            model = build()
            opt = self._optimizer(model)
            run = torch.compile(model, backend=self.args.compile_backend) if compiled else model
            if arch is None:  # nn.Transformer: no relative positions, no input/output projections
                rows, s = batch.src.shape
                forward = run
                flops = 3 * forward_flops(self.plain, model_dim=self.spec.supernet.model_dim,
                                          vocab_size=self.args.vocab, batch=rows, src_len=s,
                                          tgt_len=batch.tgt_in.size(1))
            else:
                reg = reg_of(model)
                forward, flops = (lambda x, y: run(x, y, arch, reg=reg)), self._flops(model, arch)

            def step(i: int) -> int:
                opt.zero_grad(set_to_none=True)
                with self.autocast:
                    logits = forward(batch.src, batch.tgt_in)  # [b, t, V]
                loss, _ = label_smoothed_nll(logits, batch.tgt_out, tr.label_smoothing)
                (loss / batch.ntokens).backward()
                _optimizer_step(model, opt, tr.clip_norm)
                return flops
            return step
        return make

    def sandwich(self, space: SearchSpace, compiled: bool = False) -> Callable[[], Callable[[int], int]]:
        """A row of sandwich steps (:func:`sandwich_step`) on the supernet, archs drawn as the trainer draws them,
        at the steady drop-branch rate (past ``train.drop_branch_warmup``)."""
        tr = self.spec.train

        def make() -> Callable[[int], int]:
            model = self.supernet()
            opt = self._optimizer(model)
            forward = torch.compile(model, backend=self.args.compile_backend) if compiled else model
            draws = SandwichArchs(space, random.Random(0), self.args.sandwich_k)

            def step(i: int) -> int:
                archs = draws.draw(i)
                opt.zero_grad(set_to_none=True)
                # the trainer's own step; a compiled model passes its attributes through to the supernet
                sandwich_step(forward, [self.batch], archs, None, self.spec, self.autocast, self.batch.ntokens,
                              step=tr.drop_branch_warmup + i)
                _optimizer_step(model, opt, tr.clip_norm)
                return sum(self._flops(model, a) for a in archs)
            return step
        return make


def compiled_row(make: Callable[[], Callable[[int], int]],
                 counts: dict[str, Any]) -> Callable[[], Callable[[int], int]]:
    """``make``'s row after ``torch._dynamo.reset()`` (this row's compilations only), recording in ``counts`` the
    dynamo counters after the first step (``first``) and after the last (``last``)."""
    def wrapped() -> Callable[[int], int]:
        torch._dynamo.reset()
        inner = make()

        def step(i: int) -> int:
            flops = inner(i)
            counts["first" if i == 0 else "last"] = _dynamo_counts()
            return flops
        return step
    return wrapped


def _plan(bench: Bench, space: SearchSpace, widest: Arch, ref_problem: str | None
          ) -> tuple[list[tuple[str, str, Callable[[], Callable[[int], int]]]], dict[str, dict], str | None]:
    """The rows to time, in order: (name, archs, make); the dynamo counters of compiled rows; a note when
    ``--compile`` is skipped."""
    args, spec, plain = bench.args, bench.spec, bench.plain
    sn = spec.supernet
    # nn.Transformer's regularisation: dropout everywhere (attention probabilities too), no drop-branch
    plain_reg = lambda model: Regularization(dropout=sn.dropout, attention_dropout=sn.dropout)
    extracted = lambda: extract(bench.supernet(), plain)
    plan = [("ours, plain widest (extracted)", plain.summary(), bench.single(extracted, plain, plain_reg)),
            ("ours, plain widest in the supernet", plain.summary(), bench.single(bench.supernet, plain, plain_reg))]
    if ref_problem is None:
        plan.append(("torch.nn.Transformer, same dims", plain.summary(),
                     bench.single(lambda: bench.reference(plain), None)))
    if widest != plain:
        plan.append(("ours, widest in the supernet", widest.summary(), bench.single(
            bench.supernet, widest, lambda model: step_regularization(model, spec, spec.train.drop_branch_warmup,
                                                                      widest))))
    k = args.sandwich_k
    plan.append((f"sandwich step (widest+narrowest+{k})", f"{k + 2} archs a step", bench.sandwich(space)))
    counts: dict[str, dict] = {}
    if not args.compile:
        return plan, counts, None
    if bench.device.type == "cpu" and not args.compile_cpu:
        return plan, counts, ("--compile skipped on cpu: torch.compile's inductor backend needs a C++ toolchain, "
                              "and the CPU is not this benchmark's target (--compile-cpu runs it anyway)")
    import torch._dynamo  # noqa: F401  (only with --compile)

    warnings.filterwarnings("ignore", message=".*functools.lru_cache")  # nas.model.supernet.check_arch: harmless

    counts["plain"], counts["sandwich"] = {}, {}
    plan.append(("ours, plain widest (extracted), compiled", plain.summary(),
                 compiled_row(bench.single(extracted, plain, plain_reg, compiled=True), counts["plain"])))
    plan.append((f"sandwich step (widest+narrowest+{k}), compiled", f"{k + 2} archs a step",
                 compiled_row(bench.sandwich(space, compiled=True), counts["sandwich"])))
    return plan, counts, None


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    settings = training_device(args.device)  # TF32 on CUDA; fused Adam
    device = settings.device
    spec = load_spec(args.spec, check_files=False)  # synthetic batches: the YAML's data files are not read
    sn = spec.supernet
    if max(args.src_len, args.tgt_len) > sn.max_positions:
        raise SystemExit(f"--src-len/--tgt-len {max(args.src_len, args.tgt_len)} exceed supernet.max_positions="
                         f"{sn.max_positions} of {args.spec}")
    space = SearchSpace.from_spec(spec)
    widest = space.widest()
    precision = resolve_precision("auto", device)
    batch = synthetic_batch(args.max_tokens, args.src_len, args.tgt_len, args.vocab, device)
    bench = Bench(args, spec, settings, autocast_for(precision, device), batch, supernet_config(spec, args.vocab),
                  plain_arch(widest))
    plain, config = bench.plain, bench.config
    ref_problem = reference_problem(plain, sn.model_dim)
    plan, counts, compile_note = _plan(bench, space, widest, ref_problem)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = args.peak_tflops or (peak_bf16_tflops(name) if device.type == "cuda" else None)
    rows, s, t = batch.src.size(0), args.src_len, args.tgt_len

    print(f"{name}, torch {torch.__version__}, {precision}" + (", fused Adam" if settings.fused_adam else "")
          + (", TF32" if settings.tf32 else "")
          + f"; dense bf16 peak {f'{peak:g} TFLOP/s' if peak else 'unknown (--peak-tflops): MFU n/a'}")
    print(f"{spec.name}: C={sn.model_dim}, head width {sn.head_width}, vocabulary {args.vocab}; synthetic batch of "
          f"{rows} rows x ({s} source, {t} target) tokens = {batch.ntokens} target tokens; {args.warmup} warm-up + "
          f"{args.steps} timed steps per row")
    print(f"plain widest: {plain.summary()}")
    if widest != plain:
        print(f"widest:       {widest.summary()} (nn.Transformer is compared with the plain widest)")
    if ref_problem is not None:
        print(f"no torch.nn.Transformer row: {ref_problem}")
    elif config["relative_positions"] or config["io_projection"]:
        print("ours differs from torch.nn.Transformer by: " + ", ".join(
            x for x, on in (("relative positions", config["relative_positions"]),
                            ("input/output projections", config["io_projection"])) if on))
    results: list[Row] = []
    try:
        for row_name, summary, make in plan:
            results.append(run_row(row_name, summary, make, args, device, batch.ntokens, peak))
    except torch.OutOfMemoryError:
        print(f"out of GPU memory at --max-tokens {args.max_tokens} (row {plan[len(results)][0]!r}); "
              f"lower --max-tokens, e.g. --max-tokens {args.max_tokens // 2}")
        return 1
    ref = next((r for r in results if r.name.startswith("torch.nn.Transformer")), None)
    for r in results:
        r.vs_nn_transformer = None if ref is None else r.tokens_per_s / ref.tokens_per_s
        if r.name.endswith(", compiled"):
            r.compile = _compile_info(counts["sandwich" if r.name.startswith("sandwich") else "plain"])
    _print_table(results)
    goals = _goals(results, ref, name, batch.ntokens)
    for line in (*goals["lines"], *([compile_note] if compile_note else []), *_compile_lines(results)):
        print(line)
    print("FLOPs: 3 x forward (PaLM appendix B); forward: 2mnk per matrix product (projections, attention scores "
          "over every position pair, the causal ones counted full, FFN, vocabulary projection); embeddings, "
          "softmax and layer norms not counted")
    if args.json:
        report = {"spec": str(args.spec), "device": name, "torch": torch.__version__, "precision": precision,
                  "peak_bf16_tflops": peak,
                  "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  "batch": {"rows": rows, "src_len": s, "tgt_len": t, "target_tokens": batch.ntokens},
                  "plain_widest": plain.to_dict(), "widest": widest.to_dict(),
                  "rows": [dataclasses.asdict(r) for r in results], "goals": goals["met"],
                  "compile_note": compile_note}
        atomic_write_text(args.json, json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _compile_info(counts: dict[str, dict[str, int]]) -> dict[str, Any]:
    """A compiled row's dynamo counters: graphs, those compiled after the first step (recompiles: each new arch),
    graph breaks, whether the recompile limit was hit."""
    first, last = counts.get("first", {}), counts.get("last", counts.get("first", {}))
    return {"graphs": last.get("graphs", 0),
            "recompiles_after_first_step": last.get("graphs", 0) - first.get("graphs", 0),
            "graph_breaks": last.get("graph_breaks", 0),
            "recompile_limit_hit": bool(last.get("recompile_limit_hit"))}


def _print_table(results: list[Row]) -> None:
    na = lambda v, fmt: "n/a" if v is None else format(v, fmt)
    print(f"{'':<46}{'tokens/s':>11}{'TFLOP/s':>9}{'MFU %':>7}{'peak GiB':>10}{'x nn.Tr.':>10}{'ms/step':>9}")
    for r in results:
        print(f"{r.name:<46}{r.tokens_per_s:>11.0f}{r.tflops_per_s:>9.2f}{na(r.mfu_percent, '.1f'):>7}"
              f"{na(r.peak_memory_gib, '.2f'):>10}{na(r.vs_nn_transformer, '.3f'):>10}{r.step_ms:>9.1f}")


def _goals(results: list[Row], ref: Row | None, device_name: str, ntokens: int) -> dict[str, Any]:
    """The issue's two goals, met or missed, as printed lines and as JSON."""
    ours = results[0]
    lines, met = [], {}
    if ref is None:
        lines.append("goal ours >= 0.90x torch.nn.Transformer tokens/s: n/a (no reference row)")
    else:
        ratio = ours.tokens_per_s / ref.tokens_per_s
        met["vs_nn_transformer"] = {"ratio": ratio, "met": ratio >= 0.9}
        lines.append(f"goal ours (plain widest, extracted) >= 0.90x torch.nn.Transformer tokens/s: {ratio:.3f}x "
                     f"{'met' if ratio >= 0.9 else 'missed'}")
    if ours.mfu_percent is None:
        lines.append("goal MFU >= 40%: n/a (no bf16 peak known for this device: pass --peak-tflops)")
        return {"lines": lines, "met": met}
    goal_setting = "H100" in device_name and ntokens >= 32768
    lines.append("goal MFU >= 40% on an H100 at >= 32k tokens"
                 + ("" if goal_setting else f" (this run: {device_name}, {ntokens} tokens)") + ":")
    for r in results:
        if r.name.startswith(("ours", "sandwich")) and not r.name.endswith("compiled"):
            met[f"mfu: {r.name}"] = {"mfu_percent": r.mfu_percent, "met": r.mfu_percent >= 40}
            lines.append(f"  {r.name}: {r.mfu_percent:.1f}% {'met' if r.mfu_percent >= 40 else 'missed'}")
    return {"lines": lines, "met": met}


def _compile_lines(results: list[Row]) -> list[str]:
    """Whether compiling paid, per compiled row against its eager row."""
    eager = {r.name: r for r in results}
    lines = []
    for r in results:
        if not r.name.endswith(", compiled"):
            continue
        base = eager.get(r.name.removesuffix(", compiled"))
        gain = r.tokens_per_s / base.tokens_per_s if base else float("nan")
        info = r.compile or {}
        limit = ", dynamo's recompile limit hit (then it runs eagerly)" if info.get("recompile_limit_hit") else ""
        lines.append(f"compile, {r.name.removesuffix(', compiled')}: {gain:.2f}x eager tokens/s "
                     f"({'pays' if gain > 1.0 else 'does not pay: keep it eager'}); graphs compiled: "
                     f"{info.get('graphs', 0)}, {info.get('recompiles_after_first_step', 0)} after the first step "
                     f"(recompiles), {info.get('graph_breaks', 0)} graph breaks{limit}; warm-up with compilation "
                     f"{r.warmup_s:.1f} s")
    return lines


if __name__ == "__main__":
    sys.exit(main())
