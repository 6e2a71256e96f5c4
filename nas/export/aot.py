"""Our decoder compiled ahead of time: the encoder and the beam-search step of an exported sub-Transformer as AOTInductor packages
(``torch._inductor.aoti_compile_and_package``), run from :func:`nas.model.decode.search` (issue 41).

Why: at batch 1 the eager decoder is bound by per-op dispatch (about 190 ATen calls a step, 5-7 us each), not by
arithmetic, and ``torch.compile`` of the eager step failed or gained 7% (``benchmarks/bench_compile_step.py``). The
ONNX export's step interface (the state in, the grown state out, every shape a dynamic axis) exports with
``torch.export``; AOTInductor compiles it to a shared library whose kernels run from C++, with no Python and no
guards between them. On top of that step the graph here

- gathers the previous step's state by the surviving hypotheses (``rows``) before appending to it, so the
  reorder and the append are one pass;
- multiplies by the tied embedding transposed ``[E, V]``, a constant of the package (MKL's faster layout,
  :meth:`nas.model.supernet.SuperTransformer.step_logits`), and by every layer's weights in row-major copies, the
  bias added after the product (:class:`ProductLayout`, a graph pass over every package);
- reads the memory and the cross-attention keys/values once per sentence: the beams of a sentence attend to them
  in one product (:meth:`nas.model.attention.MultiBranchAttention._cached`), not once per beam;
- ends, in the package for few rows (``candidates=True``), with beam search's expansion: log-softmax, the banned
  tokens, the length limit and :func:`nas.model.decode.beam_candidates` (the function the eager search calls), so
  a step returns the ``2k`` candidates per sentence. The log-softmax is not written out over ``[n, k, V]``: the
  package computes each row's maximum and log-sum of shifted exponentials, and the log-probabilities of the blocks'
  maxima and of the candidates only, with log-softmax's own two subtractions (the same bits); its top-k calls are
  :mod:`nas.export.topk`'s loop where a C++ compiler is found, and the ``k`` best non-EOS candidates are taken in
  order (:func:`nas.model.decode.first_continuing`) rather than by a third ``topk``. With :class:`ProductLayout`
  writing the cross-attention's ``baddbmm`` as ``bmm`` and an addition fused into the softmax, a step at batch 1,
  beam 4 took 0.86-0.95x the time (a 2-core AVX2 EPYC, 4 pairs of processes, the same tokens;
  ``docs/benchmarks.md``);
- ends, in the package for many rows, with the logits and each row's log-sum-exp: Inductor's log-softmax over
  ``[128, 6000]`` took 1.8-2.4 ms a step against ATen's 0.4-0.9 ms, so ATen ranks the candidates from the logits
  and the log-sum-exp, computing the log-probabilities of the few candidates only (0.90x the step's time of
  ATen's log-softmax, 9 interleaved rounds).

The encoder, with every decoder layer's cross-attention keys and values, is a third package (the ONNX export's
encoder graph), run once per batch of sentences before the beams are repeated: eager, it took 8% of a batch-1
compiled search's time and computed the keys and values once per beam.

Both rank candidates by :func:`nas.model.decode.top_candidates`, the top ``2k`` found through block maxima
(a third of ``topk``'s time at batch 32, beam 4). What stays in Python is :func:`~nas.model.decode.search`'s
bookkeeping (finished hypotheses, length limits, finished sentences leaving the batch): the same code as the
eager :func:`~nas.model.decode.beam_search`. The package for few rows also returns what that bookkeeping computes
with tensors while every sentence goes on (the rows to continue, whether an EOS ranks among a sentence's first
``k``, the grown token history), so no tensor op of the search runs in Python then: at batch 1, beam 4 the Python
share of a step fell from 0.26-0.27 to 0.14-0.18 ms on a 2-core AVX2 EPYC (``benchmarks/bench_aot_step.py``).
Running several steps per package call gained nothing there (2, 3, 4 steps: 1.01x, 1.00x, 1.07x the time of one;
a call's fixed cost is small against its matrix products, 77% of the step). What was left of Python, about 30 us of a
400 us step on a 2-core Intel Xeon, goes where a C++ compiler is found: the few-rows package's steps run back to back
in C while no EOS ranks among the first ``k`` and no length limit or ``min_len`` changes the step's inputs
(:mod:`nas.export.steploop`; ``run_ahead`` of :func:`nas.model.decode.search`'s stepper): about 0.95x the step's
time at beam 4 and greedy, the same tokens (``docs/benchmarks.md``).

The two packages (:data:`VARIANTS`) differ in where the candidates are ranked: in the graph for up to
:data:`SMALL_ROWS` hypotheses (at 4 rows 0.84x the time of ranking from logits), by ATen for more (at 128 rows 0.85x
the time of ranking in the graph; the two are even at 32 rows). Both use ATen's matrix products: autotuning
Inductor's C++ GEMM template against them (``autotune=True``) gave 0.98x at 4 rows once the pattern matcher was off,
for 18 s of compilation instead of 14 s, and, tuned at the example's 12 rows, a 1.4x slower step at 128 rows.
Inductor's pattern matcher is off: it rewrote the cached attention's two ``bmm`` into a flash-attention call that
took 27 us a layer at 4 rows.

Departures and limits:

- The compiled kernels sum in other orders than the eager ones: logits differ by about 1e-6, and a candidate's
  log-probability ``x - lse`` may differ from ``log_softmax``'s in its last bit; where two candidates tie, the
  chosen one may differ. So on near-ties a token may differ from the eager decoder's (as onnxruntime's may).
  ``tests/export/test_aot.py`` checks tokens and scores against the eager search.
- Compilation takes 12-20 s per package on these CPUs (the plain Transformer's dimensions); packages are cached under ``cache_dir`` by a hash of the
  weights, the arch, the beam size, the variant, the ``nas`` model code, torch's version and the CPU's
  instruction set (:func:`package_key`).
- CPU only (the package's kernels are built for this machine's instruction set). A package serves one beam size.
- AOTInductor assumes the strides its example inputs had: every input is made contiguous before a call.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nas.data import BOS_ID, EOS_ID, PAD_ID
from nas.export.folder import Exported, load_export
from nas.export.aot_products import PACKING, ProductLayout, packing, sgemm_cpu
from nas.export.sgemm import load as load_sgemm, shim_options
from nas.export.steploop import StepLoop, load as load_steploop, model_library
from nas.export.topk import load as load_topk, shim_options as topk_shim_options
from nas.export.onnx import cache_layout, cross_kv_fn, EncoderGraph, run_cache, sample_src
from nas.model.decode import aten_topk, beam_candidates, candidate_block, search
from nas.model.supernet import SuperTransformer
from nas.space.arch import Arch

__all__ = ["AotTranslator", "ProductLayout", "compile_beam_step", "compile_encoder", "package_key", "default_cache_dir"]

log = logging.getLogger(__name__)

_LEN_DEFAULTS = {"len_penalty": 1.0, "max_len_a": 1.5, "max_len_b": 10}  # as nas.model.decode.beam_search


class _BeamStepGraph(nn.Module):
    """One beam-search step: the ONNX decoder step (:class:`nas.export.onnx._DecoderStepGraph`) on the state
    gathered by ``rows``, then log-softmax, the banned tokens, the length limit and
    :func:`~nas.model.decode.beam_candidates`.

    ``forward(tokens [n*k, 1 + t], rows [n*k], scores [n, k], ban [V], limit [n], eos_zero [], memory [n, K*s, C],
    src_pad [n, s], cross, past)`` -> the seven tensors of ``beam_candidates``, then what
    :func:`nas.model.decode.search` computes from them when every sentence goes on (``src_rows [n*k]``, ``eos_any
    []``, the grown token history ``[n*k, 2 + t]``: about 10 Python ops a step less, module docstring), then the new
    state (``present``, ``n*k`` rows, one position longer). ``tokens`` is each hypothesis's token history (the newest
    last); ``rows[i]`` is the row of ``past`` that hypothesis ``i`` continues; ``memory``, ``src_pad`` and the
    cross-attention keys/values ``cross`` hold one row per sentence, not per hypothesis (the beams of a sentence
    attend to its memory together: :meth:`nas.model.attention.MultiBranchAttention._cached`);
    ``ban`` is 0 or ``-inf`` per token (added: the same values as the eager search's ``index_fill_``); where
    ``limit`` is True every token but EOS gets ``-inf`` and EOS keeps its log-probability, or 0 with ``eos_zero``
    (the eager search's forcing, :func:`nas.model.decode.search`).
    """

    def __init__(self, model: SuperTransformer, arch: Arch, cross: list[dict], state: list[dict], beam_size: int,
                 eos_id: int, candidates: bool = True, small_topk: bool = False) -> None:
        super().__init__()
        self.model, self.arch, self.cross, self.state = model, arch, cross, state
        self.clock = next(i for i, e in enumerate(state) if e["time_axis"] is not None)
        self.axes = [e["batch_axis"] for e in state]
        self.beam_size, self.eos_id, self.candidates = beam_size, eos_id, candidates
        self.topk = _small_topk if small_topk else aten_topk  # the ranking's top-k (nas.export.topk)
        eos_only = torch.full((model.vocab_size,), float("-inf"))
        eos_only[eos_id] = 0.0
        self.register_buffer("eos_only", eos_only, persistent=False)  # [V]: the additive mask of a forced EOS
        # the tied embedding transposed [E, V]: MKL multiplies rows by it faster than by F.linear's view of [V, E]
        # (SuperTransformer.step_logits; 4 rows: 104 against 193 us, 128 rows: 914 against 1,041 us)
        self.register_buffer("embed_t", model.embed.weight.detach().t().contiguous(), persistent=False)

    def forward(self, tokens: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, ban: torch.Tensor,
                limit: torch.Tensor, eos_zero: torch.Tensor, memory: torch.Tensor, src_pad: torch.Tensor,
                cross: tuple[torch.Tensor, ...], past: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        history, tokens = tokens, tokens[:, -1:]  # [n*k, 1 + t] -> the newest token [n*k, 1]
        past = tuple(p.index_select(axis, rows) for p, axis in zip(past, self.axes))
        cache: list[dict] = [{} for _ in self.model.decoder]
        for e, t in (*zip(self.cross, cross), *zip(self.state, past)):
            cache[e["layer"]].setdefault(e["part"], {})[e["key"]] = t
        step = past[self.clock].size(self.state[self.clock]["time_axis"])
        h = self.model.decode_step(tokens, step, memory, src_pad, self.arch, cache, features=True)  # [n*k, E]
        logits = h @ self.embed_t  # [n*k, V]
        # contiguous: the next call reads them as inputs, and AOTInductor assumes the example inputs' strides
        # (Prime's convolution window is a slice of a longer tensor)
        present = [cache[e["layer"]][e["part"]][e["key"]].contiguous() for e in self.state]
        if not self.candidates:  # the logits, each row's log-sum-exp and its blocks' maxima (banned tokens -inf)
            block = candidate_block(logits.size(-1))
            banned = logits + ban
            block_max = banned.view(banned.size(0), -1, block).amax(-1) if block else banned[:, :1]
            return (logits, torch.logsumexp(logits, dim=-1), block_max, *present)
        # the banned tokens and the length limit as one additive mask per sentence [n, 1, V] (0 or -inf): where the
        # limit holds only EOS is left. EOS is banned exactly while eos_zero holds (search's min_len), so a forced
        # EOS keeps its log-probability, or 0 with eos_zero, as the eager search's forcing. One select over [n, V]
        # instead of two over [n, k, V] with the masks loaded per entry (16 of the step's 590 us at batch 1, beam 4)
        mask = torch.where(limit[:, None], self.eos_only, ban)[:, None, :]  # [n, 1, V]
        # log-softmax as Inductor decomposes it, (x - max) - log(sum(exp(x - max))), but applied only to the 2k
        # candidates and to the blocks' maxima (top_candidates with lse = (shift, log_sum): the same bits), not
        # written out over [n, k, V] (the kernel took 27 against 36 us a step, module docstring). A forced EOS with
        # eos_zero scores (x - x) - 0 = 0: its row's shift is its own logit and its log-sum 0 (every other token is
        # -inf there)
        n, k = scores.shape
        logits = logits.float().view(n, k, -1)  # [n, k, V]
        top = logits.amax(-1)  # [n, k]
        log_sum = (logits - top[:, :, None]).exp().sum(-1).log()  # [n, k]
        zero = (limit & eos_zero)[:, None]  # [n, 1]
        lse = (torch.where(zero, logits[:, :, self.eos_id], top), torch.where(zero, 0.0, log_sum))
        masked = logits + mask  # [n, k, V]: the logits, banned tokens -inf
        block = candidate_block(masked.size(-1))
        block_max = masked.view(n, k, -1, block).amax(-1) if block else None
        cands = beam_candidates(masked, scores, self.eos_id, blocked=True, lse=lse, block_max=block_max,
                                in_order=True, topk=self.topk)
        # search's bookkeeping when every sentence goes on (nas.model.decode.search, ``continued``): the rows the
        # k best non-EOS candidates continue, whether an EOS ranks among a sentence's first k, the grown history
        src_rows = (cands[5] + torch.arange(n, device=scores.device)[:, None] * k).reshape(-1)  # [n*k]
        grown = torch.cat([history.index_select(0, src_rows), cands[6].reshape(-1, 1)], 1)  # [n*k, 2 + t]
        return (*cands, src_rows, cands[3][:, :k].any(), grown, *present)


def _small_topk(x: torch.Tensor, kk: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.nas.small_topk(x, kk)


def default_cache_dir() -> Path:
    """``$NAS_AOT_CACHE``, else ``~/.cache/nas/aot``: where compiled packages are kept."""
    return Path(os.environ.get("NAS_AOT_CACHE") or Path.home() / ".cache" / "nas" / "aot")


def package_key(model: SuperTransformer, arch: Arch, beam_size: int, variant: dict[str, bool],
                options: dict[str, Any] | None = None) -> str:
    """A hash of what the compiled package depends on: weights, config, arch, beam size, options, the source of
    ``nas.model``, of the export code it is traced with and of the products' graph pass (:mod:`nas.export.aot_products`), torch's version, the machine and its CPU instruction
    set (``torch.backends.cpu.get_cpu_capability()``)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    code = Path(__file__).parent.parent  # the nas package: the graph is traced from its model and export code
    sources = [*(code / "model").glob("*.py"), Path(__file__), code / "export" / "onnx.py",
               code / "export" / "aot_products.py",  # the graph pass that lays out the products
               code / "export" / "sgemm.py",  # the C shim of oneDNN's sgemm those products may call
               code / "export" / "topk.py"]  # the C shim of the ranking's top-k
    for source in sorted(sources):
        h.update(source.read_bytes())
    meta = {"config": model.config(), "arch": arch.to_dict(), "beam": beam_size, "variant": variant,
            "options": options or {}, "torch": torch.__version__, "machine": platform.machine(),
            "isa": torch.backends.cpu.get_cpu_capability(), "format": 2}
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    return h.hexdigest()[:20]


@torch.no_grad()
def compile_beam_step(model: SuperTransformer, arch: Arch, beam_size: int, path: str | Path, *,
                      autotune: bool = False, candidates: bool = True, options: dict[str, Any] | None = None,
                      pack: str = "none", small_topk: bool = False) -> Path:
    """Export the beam-search step of ``arch`` (:class:`_BeamStepGraph`) and compile it with AOTInductor into the
    package ``path`` (written atomically). Every row count, source length and past length is a dynamic axis.

    ``pack``: which products multiply by oneDNN's pre-packed weights or through its sgemm (:data:`PACKING`; the
    package of an ``sgemm`` choice loads only where :func:`nas.export.sgemm.load` has loaded the shim).
    ``small_topk``: the candidates' top-k by :mod:`nas.export.topk`'s loop (the package loads only where
    :func:`nas.export.topk.load` has loaded its shim; ``candidates`` only).

    Raises:
        ValueError: ``beam_size < 1``, an unknown ``pack``.
        RuntimeError: from ``torch.export`` or Inductor (an op it cannot compile, no C++ compiler).
    """
    if beam_size < 1:
        raise ValueError(f"beam_size={beam_size} must be >= 1")
    if pack not in PACKING:
        raise ValueError(f"pack={pack!r}: one of {', '.join(PACKING)}")
    from torch.export import Dim

    model = model.eval()
    entries = cache_layout(model, arch)
    cross = [e for e in entries if e["source"] == "encoder"]
    state = [e for e in entries if e["source"] == "step"]
    graph = _BeamStepGraph(model, arch, cross, state, beam_size, EOS_ID, candidates, small_topk).eval()
    # Example: 3 sentences (3k rows) continuing from 4k rows of a 2-position past, source length 7.
    k, sents = beam_size, 3
    src = sample_src(model, sents, 7)  # the memory and the cross-attention keys/values: one row per sentence
    memory, src_pad = model.encode(src, arch)
    snap = run_cache(model, arch, sample_src(model, sents + 1, 7).repeat_interleave(k, 0), 2)[-1]
    crossed = cross_kv_fn(model, arch, cross, src)(model, arch, memory, src_pad)
    cross_t = tuple(crossed[e["layer"]][e["part"]][e["key"]].contiguous() for e in cross)
    past_t = tuple(snap[e["layer"]][e["part"]][e["key"]].contiguous() for e in state)
    rows = torch.arange(sents * k) + (torch.arange(sents * k) % 2)  # some rows of the 4k, in another order
    ban = torch.zeros(model.vocab_size)
    ban[[PAD_ID, BOS_ID]] = float("-inf")
    history = torch.full((sents * k, 3), BOS_ID, dtype=torch.long)  # BOS and the 2 tokens of the past
    args = (history, rows, torch.zeros(sents, k), ban,
            torch.tensor([False, True, False]), torch.tensor(False), memory.contiguous(), src_pad.contiguous(),
            cross_t, past_t)
    dyn, n = Dim.DYNAMIC, Dim("sentences", min=1, max=1 << 20)
    nk = n if k == 1 else k * n  # rows: one per hypothesis (derived, so that [n*k] views as [n, k] exactly)
    axes = lambda shape, batch: {i: (batch if d == "batch" else dyn) for i, d in enumerate(shape) if isinstance(d, str)}
    shapes = ({0: nk, 1: dyn}, {0: nk}, {0: n}, None, {0: n}, None, {0: n, 1: dyn}, {0: n, 1: dyn},
              tuple(axes(e["shape"], n) for e in cross), tuple(axes(e["shape"], dyn) for e in state))
    program = torch.export.export(graph, args, dynamic_shapes=shapes)
    options = dict(options or {})  # more Inductor settings
    if autotune:
        options.update({"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                        "autotune_num_choices_displayed": 0})  # no table per product on stderr
    return _compile(program, Path(path), options, ProductLayout(pack, SMALL_ROWS if candidates else 8 * SMALL_ROWS),
                    small_topk)


def _compile(program: Any, path: Path, options: dict[str, Any], layout: ProductLayout | None = None,
             small_topk: bool = False) -> Path:
    """AOTInductor-compile an exported program into the package ``path``, written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))  # ours: removed below
    try:
        options = {"post_grad_custom_post_pass": layout or ProductLayout(), **options}
        shims: dict = {}  # the custom ops that compile to direct calls of their C shims
        if layout is not None and layout.pack.startswith("sgemm"):
            shims.update(shim_options()["aot_inductor.custom_ops_to_c_shims"])
        if small_topk:
            shims.update(topk_shim_options()["aot_inductor.custom_ops_to_c_shims"])
        if shims:
            options["aot_inductor.custom_ops_to_c_shims"] = shims
        torch._inductor.aoti_compile_and_package(program, package_path=str(work / "package.pt2"),
                                                 inductor_configs=options)
        os.replace(work / "package.pt2", path)  # a kill leaves no half-written package under the name
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path


class _EncoderPackageGraph(EncoderGraph):
    """The ONNX export's encoder graph (:class:`nas.export.onnx.EncoderGraph`: ``src [b, s]`` -> ``memory``,
    ``src_pad`` and each decoder layer's cross-attention keys/values), its outputs contiguous (the step package
    reads them as inputs, with the strides of its example)."""

    def forward(self, src: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.contiguous() for t in super().forward(src))


@torch.no_grad()
def compile_encoder(model: SuperTransformer, arch: Arch, path: str | Path, *,
                    options: dict[str, Any] | None = None, pack: str = "none") -> Path:
    """Export the encoder of ``arch`` with the cross-attention keys/values of every decoder layer
    (:class:`_EncoderPackageGraph`) and compile it with AOTInductor into the package ``path`` (written atomically).
    Batch and source length are dynamic axes. At batch 1 the eager encoder took 8% of a compiled beam search's time.

    Raises:
        RuntimeError: from ``torch.export`` or Inductor.
    """
    from torch.export import Dim

    model = model.eval()
    cross = [e for e in cache_layout(model, arch) if e["source"] == "encoder"]
    src = sample_src(model, 3, 7)
    graph = _EncoderPackageGraph(model, arch, cross, cross_kv_fn(model, arch, cross, src)).eval()
    program = torch.export.export(graph, (src,), dynamic_shapes=({0: Dim.DYNAMIC, 1: Dim.DYNAMIC},))
    return _compile(program, Path(path), dict(options or {}), ProductLayout(pack, 8 * SMALL_ROWS))


class _AotStepper:
    """:func:`nas.model.decode.search`'s stepper on a compiled package: the state lives in tensors passed in and
    out of each call."""

    def __init__(self, runner: Any, candidates: bool, vocab: int, cross: list[dict], state: list[dict],
                 memory: torch.Tensor, src_pad: torch.Tensor, cross_t: list[torch.Tensor],
                 ban: dict[tuple, torch.Tensor], beams: int, shared: dict | None = None) -> None:
        self.candidates, self.ban, self.state = candidates, ban, state
        self.loop = runner if isinstance(runner, StepLoop) else None  # the package's steps in C (few rows)
        self.run = self.loop or runner.loader.boxed_run
        self.run_ahead = self._ahead if self.loop is not None else None  # read by search
        self.eos_id, self.block = EOS_ID, candidate_block(vocab)
        self.memory, self.src_pad = memory.contiguous(), src_pad.contiguous()
        self.cross = [t.contiguous() for t in cross_t]
        self.cross_axes = [e["batch_axis"] for e in cross]
        self.beams, n = beams, memory.size(0) * beams  # memory, src_pad, cross: per sentence; the state: per row
        # inputs that no call writes to, made once per translator (``shared``) rather than once per batch: at batch
        # 1 each tensor made here cost 5-10 us a sentence on a 2-core AVX2 EPYC
        shared = {} if shared is None else shared
        if ("past", n) not in shared:  # the empty state: no past position yet
            shared["past", n] = tuple(memory.new_zeros([n if d == "batch" else 0 if d == "past_len" else d
                                                        for d in e["shape"]]) for e in state)
        self.past: tuple[torch.Tensor, ...] | list[torch.Tensor] = shared["past", n]
        self.identity: dict[int, torch.Tensor] = shared.setdefault("identity", {})
        if n not in self.identity:
            self.identity[n] = torch.arange(n)
        self.no_limit: dict[int, torch.Tensor] = shared.setdefault("no_limit", {})
        if "flags" not in shared:
            shared["flags"] = {False: torch.tensor(False), True: torch.tensor(True)}
        self.flags = shared["flags"]
        self.rows = self.identity[n]

    def step(self, tokens: torch.Tensor, scores: torch.Tensor, banned: torch.Tensor, at_limit: list[bool],
             eos_zero: bool) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...] | None]:
        limit = torch.tensor(at_limit) if any(at_limit) else self._no_limit(len(at_limit))
        out = self.run(self._inputs(tokens, scores, banned, limit, eos_zero))
        self.rows = self._identity(tokens.size(0))  # no reorder unless search asks for one
        if self.candidates:
            self.past = out[10:]
            return None, tuple(out[:10])
        logits, lse, block_max, self.past = out[0], out[1], out[2], out[3:]  # see _BeamStepGraph
        if any(at_limit):  # the search forces EOS on the log-probabilities (once a sentence)
            lprobs = torch.log_softmax(logits, dim=-1).view(scores.size(0), scores.size(1), -1)
            return lprobs.index_fill_(2, banned, float("-inf")), None
        logits = logits.view(scores.size(0), scores.size(1), -1).index_fill_(2, banned, float("-inf"))
        n, k = scores.shape
        return None, beam_candidates(logits, scores, self.eos_id, blocked=True, lse=lse.view(n, k),
                                     block_max=block_max.view(n, k, -1) if self.block else None)

    def _ahead(self, tokens: torch.Tensor, scores: torch.Tensor, banned: torch.Tensor, eos_zero: bool,
               budget: int) -> tuple[int, torch.Tensor, tuple[torch.Tensor, ...]]:
        """Up to ``budget`` steps in C, no sentence at its limit, the banned tokens and ``eos_zero`` the same on
        each (:mod:`nas.export.steploop`), until one whose EOS ranks among a sentence's first ``k``: returns the
        steps run, that step's token history ``[n*k, 1 + t]`` and its candidates (as :meth:`step`'s)."""
        inputs = self._inputs(tokens, scores, banned, self._no_limit(scores.size(0)), eos_zero)
        ran, tokens, out = self.loop.run(inputs, budget)
        self.past, self.rows = out[10:], self._identity(tokens.size(0))  # no reorder unless search asks for one
        return ran, tokens, tuple(out[:10])

    def _inputs(self, tokens: torch.Tensor, scores: torch.Tensor, banned: torch.Tensor, limit: torch.Tensor,
                eos_zero: bool) -> list[torch.Tensor]:
        """The package's flat calling convention: the inputs in the exported order, no pytree (a list it may
        empty)."""
        return [tokens.contiguous(), self.rows, scores.contiguous(), self.ban[tuple(banned.tolist())], limit,
                self.flags[eos_zero], self.memory, self.src_pad, *self.cross, *self.past]

    def _no_limit(self, n: int) -> torch.Tensor:
        """``[n]`` False: no sentence at its length limit (made once per size)."""
        limit = self.no_limit.get(n)
        if limit is None:
            limit = self.no_limit[n] = torch.zeros(n, dtype=torch.bool)
        return limit

    def _identity(self, n: int) -> torch.Tensor:
        """``arange(n)``: every row continues itself (made once per size)."""
        rows = self.identity.get(n)
        if rows is None:
            rows = self.identity[n] = torch.arange(n)
        return rows

    def reorder(self, src_rows: torch.Tensor, sent_rows: torch.Tensor | None) -> None:
        self.rows = src_rows.contiguous()
        if sent_rows is not None:  # the rows of the sentences that go on -> those sentences
            sentences = sent_rows[::self.beams] // self.beams
            self.memory = self.memory.index_select(0, sentences)
            self.src_pad = self.src_pad.index_select(0, sentences)
            self.cross = [t.index_select(a, sentences) for t, a in zip(self.cross, self.cross_axes)]


SMALL_ROWS = 16
"""Hypotheses (sentences x beams) up to which :class:`AotTranslator` ranks candidates in the graph (module docstring)."""
DEFAULT_OPTIONS = {"pattern_matcher": False, "freezing": True, "cpp.weight_prepack": False}
"""Inductor settings of both packages (module docstring): no pattern matcher; the weights frozen, so that what the
layers compute from weights alone (cropping, the query scale folded in) is computed once at compilation, not every
step (0.97x the time at batch 1 and at batch 32, beam 4, interleaved A/B), without oneDNN's packed weights (slower
at 4 rows)."""
VARIANTS = {True: {"autotune": False, "candidates": True}, False: {"autotune": False, "candidates": False}}
"""The two packages of :class:`AotTranslator`: for up to :data:`SMALL_ROWS` hypotheses (True) and for more."""


class AotTranslator:
    """Translate with an export's decoder compiled ahead of time (module docstring): the same search, tokens and
    batching as :meth:`nas.export.Exported.translate`, on the compiled step.

    An encoder package per model and two step packages per beam size, each compiled on first use (12-20 s on a
    2-core CPU for the plain Transformer's dimensions) and cached: for up to ``small_rows`` hypotheses (sentences x
    beams) a step that ranks the candidates in its graph, for more one that returns logits and leaves the ranking to
    ATen (module docstring).

    Args:
        export: a folder written by ``nas export`` (or a loaded :class:`~nas.export.Exported`).
        beam_size: the beam size compiled for (default: the export's); a package serves one beam size.
        cache_dir: where packages are kept (default :func:`default_cache_dir`).
        small_rows: the hypotheses up to which the package that ranks in its graph runs.
        options: more Inductor settings (experiments; part of the cache key).
        step_loop: run the few-rows package's steps from C where its library builds (:mod:`nas.export.steploop`);
            False calls it from Python once a step.

    Raises:
        nas.errors.MissingFileError, DamagedFileError: from :func:`~nas.export.load_export`.
        ValueError: ``beam_size < 1``.
    """

    def __init__(self, export: str | Path | Exported, beam_size: int | None = None, *,
                 cache_dir: str | Path | None = None, small_rows: int = SMALL_ROWS,
                 options: dict[str, Any] | None = None, step_loop: bool = True) -> None:
        self.exported = export if isinstance(export, Exported) else load_export(export)
        self.model = model = self.exported.model.eval()
        self.arch = model.check_arch(self.exported.arch)
        self.beam_size = self.exported.beam_size if beam_size is None else beam_size
        if self.beam_size < 1:
            raise ValueError(f"beam_size={self.beam_size} must be >= 1")
        self.cache_dir = Path(cache_dir or default_cache_dir())
        self.small_rows, self.step_loop = small_rows, step_loop
        self.options = {**DEFAULT_OPTIONS, **(options or {})}
        self.compile_seconds: dict[bool | str, float] = {}  # small or not, "encoder" -> seconds (this process)
        self._runners: dict[bool, Any] = {}
        self._encoder: Any = None
        self._shared: dict = {}  # the steppers' constant inputs (_AotStepper)
        entries = cache_layout(model, self.arch)
        self.cross = [e for e in entries if e["source"] == "encoder"]
        self.state = [e for e in entries if e["source"] == "step"]
        self.ban: dict[tuple, torch.Tensor] = {}
        for ids in ({PAD_ID, BOS_ID} - {EOS_ID}, {PAD_ID, BOS_ID, EOS_ID}):
            ban = torch.zeros(model.vocab_size)
            ban[sorted(ids)] = float("-inf")
            self.ban[tuple(sorted(ids))] = ban

    def package(self, small: bool) -> Path:
        """The cached package (compiled now if missing) for few rows (``small``) or many (:data:`VARIANTS`)."""
        variant = VARIANTS[small]
        pack = packing(small, self.beam_size, sgemm=self._sgemm())
        small_topk = variant["candidates"] and load_topk(self.cache_dir)  # the ranking's top-k by its C loop
        key = package_key(self.model, self.arch, self.beam_size, {**variant, "pack": pack, "small_topk": small_topk},
                          self.options)
        path = self.cache_dir / f"beam{self.beam_size}_{'small' if small else 'large'}_{key}.pt2"
        if not path.exists():
            start = time.perf_counter()
            compile_beam_step(self.model, self.arch, self.beam_size, path, options=self.options, pack=pack,
                              small_topk=small_topk, **variant)
            self.compile_seconds[small] = time.perf_counter() - start
        return path

    def _sgemm(self) -> bool:
        """Whether oneDNN's sgemm is loaded for the packages (:mod:`nas.export.sgemm`; built and loaded only on
        CPUs where :func:`~nas.export.aot_products.packing` would choose it)."""
        return sgemm_cpu() and load_sgemm(self.cache_dir)

    def encoder(self) -> Any:
        """The loaded encoder package (compiled now if missing; one per model, any beam size)."""
        if self._encoder is None:
            pack = packing(None, sgemm=self._sgemm())
            key = package_key(self.model, self.arch, 0, {"encoder": True, "pack": pack}, self.options)
            path = self.cache_dir / f"encoder_{key}.pt2"
            if not path.exists():
                start = time.perf_counter()
                compile_encoder(self.model, self.arch, path, options=self.options, pack=pack)
                self.compile_seconds["encoder"] = time.perf_counter() - start
            self._encoder = torch._inductor.aoti_load_package(str(path))
        return self._encoder

    def runner(self, rows: int) -> tuple[Any, bool]:
        """The loaded package for ``rows`` hypotheses, and whether it returns candidates (else logits): for few
        rows a :class:`~nas.export.steploop.StepLoop` where its library builds and loads, else (and for many rows)
        ``aoti_load_package``'s runner."""
        small = rows <= self.small_rows
        if small not in self._runners:
            path = self.package(small)
            lib = load_steploop(self.cache_dir) if small and self.step_loop else None
            if lib is not None:
                n_cross = len(self.cross)  # inputs: tokens, rows, scores, ban, limit, eos_zero, memory, src_pad,
                # cross, past; outputs: the seven candidates, src_rows, eos_any, grown, present (_BeamStepGraph)
                feed = [(0, 9), (1, 7), (2, 4), *((8 + n_cross + i, 10 + i) for i in range(len(self.state)))]
                try:
                    self._runners[small] = StepLoop(lib, model_library(path), feed, stop=8)
                except (OSError, RuntimeError, ValueError) as e:
                    log.warning("%s; the compiled decoder calls its package once a step from Python", e)
            if small not in self._runners:
                self._runners[small] = torch._inductor.aoti_load_package(str(path))
        return self._runners[small], VARIANTS[small]["candidates"]

    @torch.no_grad()
    def beam_search(self, src: torch.Tensor, *, len_penalty: float = 1.0, max_len_a: float = 1.5,
                    max_len_b: int = 10, min_len: int = 0, return_scores: bool = False):
        """:func:`nas.model.decode.beam_search` of ``src [b, s]`` at the compiled beam size (same arguments).

        Raises:
            ValueError: ``src`` is longer than the model's ``max_positions``.
        """
        model, k = self.model, self.beam_size
        if src.size(1) > model.max_positions:
            raise ValueError(f"source of {src.size(1)} tokens exceeds max_positions={model.max_positions}")
        memory, src_pad, *cross_t = self.encoder().loader.boxed_run([src.contiguous()])  # per sentence
        src_len = (~src_pad).sum(1)
        max_len = torch.clamp((src_len.float() * max_len_a + max_len_b).long(), max=model.max_positions - 1)
        # memory, src_pad and the cross-attention keys/values stay one row per sentence (not repeated per beam)
        stepper = _AotStepper(*self.runner(src.size(0) * k), model.vocab_size, self.cross, self.state, memory,
                              src_pad, cross_t, self.ban, k, self._shared)
        return search(stepper, src.size(0), max_len.tolist(), beam_size=k, vocab=model.vocab_size,
                      pad_id=model.pad_id, bos_id=BOS_ID, eos_id=EOS_ID, len_penalty=len_penalty, min_len=min_len,
                      return_scores=return_scores, device="cpu", blocked_topk=True)

    def translate(self, sentences: list[str], beam_size: int | None = None, *, max_tokens: int | None = None,
                  batch_size: int = 64, on_batch=None) -> list[str]:
        """Detokenized translations in input order, batched as :func:`nas.eval.scores.translate` (the signature of
        :meth:`nas.export.Exported.translate`).

        Raises:
            ValueError: ``beam_size`` is not the compiled one (a package serves one beam size).
        """
        from nas.eval.scores import translate

        if beam_size is not None and beam_size != self.beam_size:
            raise ValueError(f"beam_size={beam_size}: this AotTranslator is compiled for beam size {self.beam_size}; "
                             f"make another with beam_size={beam_size}")
        return translate(self.model, self.exported.tokenizer, sentences, self.arch, beam_size=self.beam_size,
                         max_tokens=max_tokens, batch_size=batch_size, on_batch=on_batch,
                         search=lambda src: self.beam_search(src))
