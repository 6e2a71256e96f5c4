"""Our decoder compiled ahead of time: the beam-search step of an exported sub-Transformer as one AOTInductor
package (``torch._inductor.aoti_compile_and_package``), run from :func:`nas.model.decode.search` (issue 41).

Why: at batch 1 the eager decoder is bound by per-op dispatch (about 190 ATen calls a step, 5-7 us each), not by
arithmetic, and ``torch.compile`` of the eager step failed or gained 7% (``benchmarks/bench_compile_step.py``). The
ONNX export's step interface (the state in, the grown state out, every shape a dynamic axis) exports with
``torch.export``; AOTInductor compiles it to a shared library whose kernels run from C++, with no Python and no
guards between them. On top of the ONNX step the graph here

- gathers the previous step's state by the surviving hypotheses (``rows``) before appending to it, so the
  reorder and the append are one pass (the eager decoder's ``index_select`` into a spare buffer, then a copy);
- ends with beam search's expansion: log-softmax, the banned tokens, and
  :func:`nas.model.decode.beam_candidates` (the same function the eager search calls), so a step returns the
  ``2k`` candidates per sentence instead of ``[n, V]`` logits.

What stays in Python is :func:`~nas.model.decode.search`'s bookkeeping (finished hypotheses, length limits,
finished sentences leaving the batch): the same code as the eager :func:`~nas.model.decode.beam_search`.

With ``autotune=True`` Inductor's C++ GEMM template is tried against ATen's for each matrix product
(``max_autotune``, ``max_autotune_gemm_backends="CPP,ATEN"``), at the example's 12 rows: on a 2-core Xeon, 1 thread,
the plain Transformer's dimensions, 4 rows (batch 1, beam 4), a whole beam-search step took 0.65 ms against 0.76 ms
without (0.94 ms eager); at 128 rows (batch 32, beam 4) 9.8 ms against 6.6 ms without (7.0 ms eager). So
:class:`AotTranslator` compiles both and picks by the number of rows. Inductor's pattern matcher is off: it
rewrote the cached attention's two ``bmm`` into a flash-attention call that took 27 us a layer at 4 rows.

Departures and limits:

- The compiled kernels sum in other orders than the eager ones: logits differ by about 1e-6, so on near-ties a
  token may differ from the eager decoder's (as onnxruntime's may). ``tests/export/test_aot.py`` checks the tokens
  and scores against the eager search.
- Compilation takes 15-35 s per package (model, beam size, autotuned or not) on these CPUs; the package is cached under ``cache_dir`` by a
  hash of the weights, the arch, the beam size, torch's version and the CPU's instruction set.
- CPU only (the package's kernels are built for this machine's instruction set).
- AOTInductor assumes the strides its example inputs had: every input is made contiguous before a call.
"""

from __future__ import annotations

import hashlib
import json
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
from nas.export.onnx import _cache_layout, _cross_fn, _DecoderStepGraph, _run_cache, _sample_src
from nas.model.decode import beam_candidates, search
from nas.model.supernet import SuperTransformer
from nas.space.arch import Arch

__all__ = ["AotTranslator", "compile_beam_step", "package_key", "default_cache_dir"]

_LEN_DEFAULTS = {"len_penalty": 1.0, "max_len_a": 1.5, "max_len_b": 10}  # as nas.model.decode.beam_search


class _BeamStepGraph(nn.Module):
    """One beam-search step: the ONNX decoder step (:class:`nas.export.onnx._DecoderStepGraph`) on the state
    gathered by ``rows``, then log-softmax, the banned tokens and :func:`~nas.model.decode.beam_candidates`.

    ``forward(tokens [n, 1], rows [n], scores [n/k, k], ban [V], memory [n, K*s, C], src_pad [n, s], cross,
    past)`` -> ``lprobs [n/k, k, V]`` (banned tokens at ``-inf``), the seven tensors of ``beam_candidates``, then
    the new state (``present``, ``n`` rows, one position longer). ``rows[i]`` is the row of ``past`` that
    hypothesis ``i`` continues; ``ban`` is 0 or ``-inf`` per token (added: the same values as the eager search's
    ``index_fill_``).
    """

    def __init__(self, model: SuperTransformer, arch: Arch, cross: list[dict], state: list[dict], beam_size: int,
                 eos_id: int) -> None:
        super().__init__()
        self.step = _DecoderStepGraph(model, arch, cross, state)
        self.axes = [e["batch_axis"] for e in state]
        self.beam_size, self.eos_id = beam_size, eos_id

    def forward(self, tokens: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, ban: torch.Tensor,
                memory: torch.Tensor, src_pad: torch.Tensor, cross: tuple[torch.Tensor, ...],
                past: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        past = tuple(p.index_select(axis, rows) for p, axis in zip(past, self.axes))
        logits, *present = self.step(tokens, memory, src_pad, cross, past)
        lprobs = torch.log_softmax(logits.float(), dim=-1).view(-1, self.beam_size, logits.size(-1)) + ban
        return (lprobs, *beam_candidates(lprobs, scores, self.eos_id), *present)


def default_cache_dir() -> Path:
    """``$NAS_AOT_CACHE``, else ``~/.cache/nas/aot``: where compiled packages are kept."""
    return Path(os.environ.get("NAS_AOT_CACHE") or Path.home() / ".cache" / "nas" / "aot")


def package_key(model: SuperTransformer, arch: Arch, beam_size: int, autotune: bool,
                options: dict[str, Any] | None = None) -> str:
    """A hash of what the compiled package depends on: weights, config, arch, beam size, options, torch's version,
    the machine and its CPU instruction set (``torch.backends.cpu.get_cpu_capability()``)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    meta = {"config": model.config(), "arch": arch.to_dict(), "beam": beam_size, "autotune": autotune,
            "options": options or {}, "torch": torch.__version__, "machine": platform.machine(),
            "isa": torch.backends.cpu.get_cpu_capability(), "format": 1}
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    return h.hexdigest()[:20]


@torch.no_grad()
def compile_beam_step(model: SuperTransformer, arch: Arch, beam_size: int, path: str | Path, *,
                      autotune: bool = True, options: dict[str, Any] | None = None) -> Path:
    """Export the beam-search step of ``arch`` (:class:`_BeamStepGraph`) and compile it with AOTInductor into the
    package ``path`` (written atomically). Every row count, source length and past length is a dynamic axis.

    Raises:
        ValueError: ``beam_size < 1``.
        RuntimeError: from ``torch.export`` or Inductor (an op it cannot compile, no C++ compiler).
    """
    if beam_size < 1:
        raise ValueError(f"beam_size={beam_size} must be >= 1")
    from torch.export import Dim

    model = model.eval()
    entries = _cache_layout(model, arch)
    cross = [e for e in entries if e["source"] == "encoder"]
    state = [e for e in entries if e["source"] == "step"]
    graph = _BeamStepGraph(model, arch, cross, state, beam_size, EOS_ID).eval()
    # Example: 3 sentences (n = 3k rows) continuing from 4k rows of a 2-position past, source length 7.
    k, sents = beam_size, 3
    src = _sample_src(model, sents, 7).repeat_interleave(k, 0)
    memory, src_pad = model.encode(src, arch)
    snap = _run_cache(model, arch, _sample_src(model, sents + 1, 7).repeat_interleave(k, 0), 2)[-1]
    crossed = _cross_fn(model, arch, cross, src)(model, arch, memory, src_pad)
    cross_t = tuple(crossed[e["layer"]][e["part"]][e["key"]].contiguous() for e in cross)
    past_t = tuple(snap[e["layer"]][e["part"]][e["key"]].contiguous() for e in state)
    rows = torch.arange(sents * k) + (torch.arange(sents * k) % 2)  # some rows of the 4k, in another order
    ban = torch.zeros(model.vocab_size)
    ban[[PAD_ID, BOS_ID]] = float("-inf")
    args = (torch.full((sents * k, 1), BOS_ID, dtype=torch.long), rows, torch.zeros(sents, k), ban,
            memory.contiguous(), src_pad.contiguous(), cross_t, past_t)
    dyn = Dim.DYNAMIC
    axes = lambda shape: {i: dyn for i, d in enumerate(shape) if isinstance(d, str)}
    shapes = ({0: dyn}, {0: dyn}, {0: dyn}, None, {0: dyn, 1: dyn}, {0: dyn, 1: dyn},
              tuple(axes(e["shape"]) for e in cross), tuple(axes(e["shape"]) for e in state))
    program = torch.export.export(graph, args, dynamic_shapes=shapes)
    options = dict(options or {})  # more Inductor settings
    if autotune:
        options.update({"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                        "autotune_num_choices_displayed": 0})  # no table per product on stderr
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))  # ours: removed below
    try:
        torch._inductor.aoti_compile_and_package(program, package_path=str(work / "step.pt2"),
                                                 inductor_configs=options)
        os.replace(work / "step.pt2", path)  # a kill leaves no half-written package under the name
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path


class _AotStepper:
    """:func:`nas.model.decode.search`'s stepper on a compiled package: the state lives in tensors passed in and
    out of each call."""

    def __init__(self, runner: Any, model: SuperTransformer, arch: Arch, cross: list[dict], state: list[dict],
                 memory: torch.Tensor, src_pad: torch.Tensor, ban: dict[tuple, torch.Tensor],
                 cross_fn) -> None:
        self.runner, self.ban, self.state = runner, ban, state
        self.memory, self.src_pad = memory.contiguous(), src_pad.contiguous()
        crossed = cross_fn(model, arch, memory, src_pad)
        self.cross = [crossed[e["layer"]][e["part"]][e["key"]].contiguous() for e in cross]
        self.cross_axes = [e["batch_axis"] for e in cross]
        n = memory.size(0)
        self.past = [memory.new_zeros([n if d == "batch" else 0 if d == "past_len" else d for d in e["shape"]])
                     for e in state]
        self.identity = {n: torch.arange(n)}
        self.rows = self.identity[n]

    def step(self, tokens: torch.Tensor, scores: torch.Tensor, banned: torch.Tensor):
        out = self.runner(tokens[:, -1:].contiguous(), self.rows, scores.contiguous(), self.ban[tuple(banned.tolist())],
                          self.memory, self.src_pad, self.cross, self.past)
        self.past = out[8:]
        n = tokens.size(0)
        self.rows = self.identity.get(n)  # no reorder unless search asks for one
        if self.rows is None:
            self.rows = self.identity[n] = torch.arange(n)
        return out[0], tuple(out[1:8])

    def reorder(self, src_rows: torch.Tensor, sent_rows: torch.Tensor | None) -> None:
        self.rows = src_rows.contiguous()
        if sent_rows is not None:
            self.memory = self.memory.index_select(0, sent_rows)
            self.src_pad = self.src_pad.index_select(0, sent_rows)
            self.cross = [t.index_select(a, sent_rows) for t, a in zip(self.cross, self.cross_axes)]


SMALL_ROWS = 16
"""Hypotheses (sentences x beams) up to which :class:`AotTranslator` runs the autotuned package (module docstring)."""


class AotTranslator:
    """Translate with an export's decoder compiled ahead of time (module docstring): the same search, tokens and
    batching as :meth:`nas.export.Exported.translate`, on the compiled step.

    Two packages per beam size, each compiled on first use and cached: for up to ``small_rows`` hypotheses
    (sentences x beams) one where Inductor's C++ GEMM template was autotuned against ATen (it wins on few rows),
    for more one with ATen's matrix products (the template, tuned on few rows, was 1.4x slower at 128 rows; on a
    2-core Xeon, 1 thread: ``benchmarks/bench_serving.py``'s ``pytorch-aot``).

    Args:
        export: a folder written by ``nas export`` (or a loaded :class:`~nas.export.Exported`).
        beam_size: the beam size compiled for (default: the export's); a package serves one beam size.
        cache_dir: where packages are kept (default :func:`default_cache_dir`).
        small_rows: the hypotheses up to which the autotuned package runs.
        options: more Inductor settings (experiments; part of the cache key).

    Raises:
        nas.errors.MissingFileError, DamagedFileError: from :func:`~nas.export.load_export`.
        ValueError: ``beam_size < 1``.
    """

    def __init__(self, export: str | Path | Exported, beam_size: int | None = None, *,
                 cache_dir: str | Path | None = None, small_rows: int = SMALL_ROWS,
                 options: dict[str, Any] | None = None) -> None:
        self.exported = export if isinstance(export, Exported) else load_export(export)
        self.model = model = self.exported.model.eval()
        self.arch = model.check_arch(self.exported.arch)
        self.beam_size = beam_size or self.exported.beam_size
        if self.beam_size < 1:
            raise ValueError(f"beam_size={self.beam_size} must be >= 1")
        self.cache_dir = Path(cache_dir or default_cache_dir())
        self.small_rows = small_rows
        self.options = {"pattern_matcher": False, **(options or {})}
        self.compile_seconds: dict[bool, float] = {}  # autotuned or not -> seconds (compiled in this process)
        self._runners: dict[bool, Any] = {}
        entries = _cache_layout(model, self.arch)
        self.cross = [e for e in entries if e["source"] == "encoder"]
        self.state = [e for e in entries if e["source"] == "step"]
        with torch.no_grad():
            self.cross_fn = _cross_fn(model, self.arch, self.cross, _sample_src(model, 3, 7))
        self.ban: dict[tuple, torch.Tensor] = {}
        for ids in ({PAD_ID, BOS_ID} - {EOS_ID}, {PAD_ID, BOS_ID, EOS_ID}):
            ban = torch.zeros(model.vocab_size)
            ban[sorted(ids)] = float("-inf")
            self.ban[tuple(sorted(ids))] = ban

    def package(self, autotune: bool) -> Path:
        """The cached package (compiled now if missing): autotuned (few rows) or with ATen's products."""
        key = package_key(self.model, self.arch, self.beam_size, autotune, self.options)
        path = self.cache_dir / f"beam{self.beam_size}_{'small' if autotune else 'large'}_{key}.pt2"
        if not path.exists():
            start = time.perf_counter()
            compile_beam_step(self.model, self.arch, self.beam_size, path, autotune=autotune, options=self.options)
            self.compile_seconds[autotune] = time.perf_counter() - start
        return path

    def runner(self, rows: int):
        """The loaded package for ``rows`` hypotheses."""
        autotune = rows <= self.small_rows
        if autotune not in self._runners:
            self._runners[autotune] = torch._inductor.aoti_load_package(str(self.package(autotune)))
        return self._runners[autotune]

    @torch.no_grad()
    def beam_search(self, src: torch.Tensor, *, len_penalty: float = 1.0, max_len_a: float = 1.5,
                    max_len_b: int = 10, min_len: int = 0, return_scores: bool = False):
        """:func:`nas.model.decode.beam_search` of ``src [b, s]`` at the compiled beam size (same arguments)."""
        model, k = self.model, self.beam_size
        memory, src_pad = model.encode(src, self.arch)
        src_len = (~src_pad).sum(1)
        max_len = torch.clamp((src_len.float() * max_len_a + max_len_b).long(), max=model.max_positions - 1)
        rows = torch.arange(src.size(0)).repeat_interleave(k)
        memory, src_pad = memory.index_select(0, rows), src_pad.index_select(0, rows)
        stepper = _AotStepper(self.runner(src.size(0) * k), model, self.arch, self.cross, self.state, memory, src_pad, self.ban,
                              self.cross_fn)
        return search(stepper, src.size(0), max_len.tolist(), beam_size=k, vocab=model.vocab_size,
                      pad_id=model.pad_id, bos_id=BOS_ID, eos_id=EOS_ID, len_penalty=len_penalty, min_len=min_len,
                      return_scores=return_scores, device="cpu")

    def translate(self, sentences: list[str], *, max_tokens: int | None = None, batch_size: int = 64,
                  on_batch=None) -> list[str]:
        """Detokenized translations in input order, batched as :func:`nas.eval.scores.translate`."""
        from nas.eval.scores import translate

        return translate(self.model, self.exported.tokenizer, sentences, self.arch, beam_size=self.beam_size,
                         max_tokens=max_tokens, batch_size=batch_size, on_batch=on_batch,
                         search=lambda src: self.beam_search(src))
