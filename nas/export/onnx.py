"""ONNX export of an exported sub-Transformer, checked against PyTorch with onnxruntime.

An ONNX folder is a complete ``nas export`` folder (``model.safetensors``, ``model.json``,
``arch.json``, ``export.json``, ``spm.model``) plus:

- ``encoder.onnx``: ``src [b, s]`` int64 -> ``memory [b, K*s, C]``, ``src_pad [b, s]`` bool and,
  per decoder layer, the cross-attention keys/values ``cross.<layer>.<key>`` (computed once
  per sentence, as the PyTorch cache's "cross" part). With HAT's arbitrary encoder-decoder attention
  a decoder layer attends to the last k encoder layers: its keys/values are ``k * s`` long (axis
  ``"<k>*src_len"`` in the manifest) and ``memory`` holds the last K (the most any layer attends to)
  encoder outputs concatenated along the length (:meth:`SuperTransformer.encode`);
- ``decoder_step.onnx``: ``tokens [n, 1]`` (the newest token), ``memory``, ``src_pad``, the
  ``cross.*`` tensors and the step state ``past.<layer>.<part>.<key>`` -> ``logits [n, V]``
  (raw, before log-softmax) and the new state ``present.<layer>.<part>.<key>``. The step
  (target position) is the past length: self-attention keys/values grow along their time
  axis by one per step, so no separate step input can disagree with the cache;
- ``onnx.json``: the manifest (inputs, outputs, cache layout, decoding constants);
- ``translate_onnx.py``: greedy/beam translation with onnxruntime, numpy and sentencepiece only (a copy of
  :mod:`nas.export.translate_onnx`, a standalone script that imports nothing of ``nas``);
- after :func:`quantize_onnx` (``nas export --quantize int8``): ``encoder.int8.onnx`` and
  ``decoder_step.int8.onnx``, whose matrix weights are int8, and which ``onnx.json`` then names (the fp32
  graphs stay beside them, named ``fp32_file``).

Batch, source length and past length are dynamic axes. The graphs come from
``torch.onnx.export(dynamo=True)`` (torch.export); the TorchScript exporter cannot take the
layers' width-cropping ``x.size(-1)`` as a layer-norm shape. The exporter's own
``scaled_dot_product_attention`` translation handles 4-D inputs only; the layers attend with
5-D ``[G, b, heads, t, d]`` tensors, so a rank-generic translation (PyTorch's math
attention) is registered here.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from nas.data import BOS_ID, EOS_ID, Tokenizer
from nas.export.folder import PROVENANCE
from nas.atomic import atomic_path, atomic_write_text, output_dir
from nas.model.decode import beam_search
from nas.model.io import load_model, save_model
from nas.model.supernet import SuperTransformer, extract
from nas.space.arch import Arch

__all__ = ["export_onnx", "verify_onnx", "quantize_onnx", "TRANSLATE_SCRIPT", "MANIFEST", "MIN_OPSET"]

MANIFEST = "onnx.json"
MIN_OPSET = 18
"""The lowest ONNX opset the torch.export-based exporter writes."""
_FORMAT_VERSION = 1
_TORCH_FILES = ("model.safetensors", "model.json", "arch.json", PROVENANCE, "spm.model")
TRANSLATE_SCRIPT = Path(__file__).with_name("translate_onnx.py").read_text(encoding="utf-8")
"""The standalone translation script written into every ONNX folder: the source of :mod:`nas.export.translate_onnx`."""


# ---------------------------------------------------------------------------
# Cache layout
# ---------------------------------------------------------------------------


def sample_src(model: SuperTransformer, batch: int, src_len: int, seed: int = 0) -> torch.Tensor:
    """``[batch, src_len]`` random non-pad ids ending in EOS; row 0 ends in two PADs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.vocab_size - 1, (batch, src_len), generator=g)
    ids = ids + (ids >= model.pad_id).long()  # skip the pad id
    ids[:, -1] = EOS_ID
    ids[0, -2:] = model.pad_id
    ids[0, -3] = EOS_ID
    return ids


@torch.no_grad()
def run_cache(model: SuperTransformer, arch: Arch, src: torch.Tensor, steps: int) -> list[list[dict]]:
    """PyTorch greedy steps on ``src``; the cache after each step, as ``[step][layer] {part: {key: tensor}}``."""
    memory, src_pad = model.encode(src, arch)
    cache: list = [{} for _ in model.decoder]
    tokens = torch.full((src.size(0), 1), BOS_ID, dtype=torch.long)
    snapshots = []
    for step in range(steps):
        logits = model.decode_step(tokens, step, memory, src_pad, arch, cache)
        tokens = logits.argmax(-1, keepdim=True)
        snapshots.append([{p: dict(keys) for p, keys in layer.items()} for layer in cache])
    return snapshots


def cache_layout(model: SuperTransformer, arch: Arch) -> list[dict[str, Any]]:
    """Discover each cached tensor's axes by running PyTorch at two batch sizes, two source
    lengths and two steps: an axis is ``batch``, ``src_len`` (``"<k>*src_len"`` for the keys/values of a
    cross-attention over the last k encoder layers), ``past_len`` or a fixed size.

    The "cross" part comes from the encoder graph; every other part ("self", "conv") is
    step state, reordered every beam-search step (as ``SuperTransformer.reorder_cache``).

    Raises:
        RuntimeError: a cached tensor has no single batch axis, step state depends on the source
            length, or no tensor has a time axis.
    """
    a = run_cache(model, arch, sample_src(model, 3, 7), 2)
    b = run_cache(model, arch, sample_src(model, 2, 7), 1)[0]
    c = run_cache(model, arch, sample_src(model, 3, 6), 1)[0]
    entries = []
    for layer, parts in enumerate(a[0]):
        for part in sorted(parts):
            for key in sorted(parts[part]):
                shapes = [tuple(s[layer][part][key].shape) for s in (a[0], a[1], b, c)]
                dims: list[int | str] = []
                for axis, size in enumerate(shapes[0]):
                    if shapes[2][axis] != size:
                        dims.append("batch")
                    elif shapes[3][axis] != size:  # source lengths 7 and 6: k * 7 and k * 6 positions
                        k = size - shapes[3][axis]
                        if size != 7 * k:
                            raise RuntimeError(f"cache {layer}.{part}.{key} {shapes[0]}: axis {axis} is not a "
                                               f"multiple of the source length")
                        dims.append("src_len" if k == 1 else f"{k}*src_len")
                    elif shapes[1][axis] != size:
                        dims.append("past_len")
                    else:
                        dims.append(int(size))
                if dims.count("batch") != 1:
                    raise RuntimeError(f"cache {layer}.{part}.{key} {shapes[0]} has no single batch axis")
                source = "encoder" if part == "cross" else "step"
                if source == "step" and "src_len" in dims:
                    raise RuntimeError(f"step state {layer}.{part}.{key} {shapes[0]} grows with the source length")
                name = f"cross.{layer}.{key}" if source == "encoder" else f"{layer}.{part}.{key}"
                entries.append(dict(
                    layer=layer, part=part, key=key, source=source,
                    input=name if source == "encoder" else f"past.{name}",
                    output=name if source == "encoder" else f"present.{name}",
                    shape=dims,  # as a step's input: "past_len" is 0 at the first step (all-zero state)
                    batch_axis=dims.index("batch"),
                    time_axis=dims.index("past_len") if "past_len" in dims else None,
                    reorder="every_step" if source == "step" else "when_sentences_finish",
                ))
    if not any(e["time_axis"] is not None for e in entries):
        raise RuntimeError("no cached tensor grows with the step; cannot tell the decoding position")
    return entries


# ---------------------------------------------------------------------------
# The two graphs
# ---------------------------------------------------------------------------


def _cross_by_step(model: SuperTransformer, arch: Arch, memory: torch.Tensor, src_pad: torch.Tensor) -> list[dict]:
    """Each decoder layer's cache after a first ``decode_step`` on a dummy token (public interface only)."""
    cache: list = [{} for _ in model.decoder]
    model.decode_step(torch.zeros_like(src_pad[:, :1], dtype=torch.long), 0, memory, src_pad, arch, cache)
    return cache


def _cross_direct(model: SuperTransformer, arch: Arch, memory: torch.Tensor, src_pad: torch.Tensor) -> list[dict]:
    """Each decoder layer's cross-attention keys/values from ``DecoderLayer.cross_kv`` alone (the
    function its cached forward calls). Traces about half the ops of :func:`_cross_by_step`, so the
    encoder exports in half the time; it is used only where it reproduces :func:`_cross_by_step`
    exactly (checked on the example batch)."""
    cache = []
    sources = model.cross_sources(memory, src_pad, arch)  # per layer: the last k encoder outputs [b, k*s, C]
    for layer, dims, (mem, _) in zip(model.decoder, arch.decoder.layer_dims(), sources):
        k, v = layer.cross_kv(mem, dims)  # each [G, b, B*h, k*s, dh]
        cache.append({"cross": {"ck": k, "cv": v}})
    return cache


def cross_kv_fn(model: SuperTransformer, arch: Arch, cross: list[dict], src: torch.Tensor):
    """:func:`_cross_direct` where it gives the same tensors as :func:`_cross_by_step`, else the latter."""
    memory, src_pad = model.encode(src, arch)
    reference = _cross_by_step(model, arch, memory, src_pad)
    try:
        direct = _cross_direct(model, arch, memory, src_pad)
        same = all(torch.equal(direct[e["layer"]]["cross"][e["key"]], reference[e["layer"]]["cross"][e["key"]])
                   for e in cross)
    except (AttributeError, TypeError, KeyError, RuntimeError, ValueError):
        same = False
    return _cross_direct if same else _cross_by_step


class EncoderGraph(nn.Module):
    """``src [b, s]`` -> ``memory [b, K*s, C]``, ``src_pad [b, s]``, then each ``cross.*`` tensor."""

    def __init__(self, model: SuperTransformer, arch: Arch, cross: list[dict], cross_fn) -> None:
        super().__init__()
        self.model, self.arch, self.cross, self.cross_fn = model, arch, cross, cross_fn

    def forward(self, src: torch.Tensor) -> tuple[torch.Tensor, ...]:
        memory, src_pad = self.model.encode(src, self.arch)
        cache = self.cross_fn(self.model, self.arch, memory, src_pad)
        return (memory, src_pad, *[cache[e["layer"]][e["part"]][e["key"]] for e in self.cross])


class _DecoderStepGraph(nn.Module):
    """One ``decode_step`` at position ``past_len``: -> ``logits [n, V]``, then each ``present.*`` tensor."""

    def __init__(self, model: SuperTransformer, arch: Arch, cross: list[dict], state: list[dict]) -> None:
        super().__init__()
        self.model, self.arch, self.cross, self.state = model, arch, cross, state
        self.clock = next(i for i, e in enumerate(state) if e["time_axis"] is not None)

    def forward(self, tokens: torch.Tensor, memory: torch.Tensor, src_pad: torch.Tensor,
                cross: tuple[torch.Tensor, ...], past: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        cache: list[dict] = [{} for _ in self.model.decoder]
        for e, t in (*zip(self.cross, cross), *zip(self.state, past)):
            cache[e["layer"]].setdefault(e["part"], {})[e["key"]] = t
        step = past[self.clock].size(self.state[self.clock]["time_axis"])
        logits = self.model.decode_step(tokens, step, memory, src_pad, self.arch, cache)
        return (logits, *[cache[e["layer"]][e["part"]][e["key"]] for e in self.state])


def _sdpa_translation(opset: int):
    """A rank-generic ONNX translation of ``aten.scaled_dot_product_attention`` (inference only).

    Same math as PyTorch's math backend: ``softmax((q sqrt(s)) (k sqrt(s))^T + mask) v`` with
    ``s = 1/sqrt(d)``; a boolean mask is True where a key may be attended.
    """
    import onnx
    from onnxscript import onnx_opset

    op = getattr(onnx_opset, f"opset{opset}")

    def sdpa(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
             scale: float | None = None, enable_gqa: bool = False):
        if is_causal or enable_gqa:
            raise NotImplementedError("ONNX export of causal or grouped-query attention is not needed for "
                                      "incremental decoding and not implemented")
        rank = len(query.shape)
        factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        root = op.CastLike(op.Constant(value_float=math.sqrt(factor)), query)
        key_t = op.Transpose(op.Mul(key, root), perm=[*range(rank - 2), rank - 1, rank - 2])
        scores = op.MatMul(op.Mul(query, root), key_t)  # [..., L, S]
        if attn_mask is not None:
            if attn_mask.dtype == onnx.TensorProto.BOOL:
                scores = op.Where(attn_mask, scores, op.CastLike(op.Constant(value_float=-math.inf), query))
            else:
                scores = op.Add(scores, attn_mask)
        return op.MatMul(op.Softmax(scores, axis=-1), value)

    return sdpa


def _export_graph(module: nn.Module, args: tuple, dynamic_shapes: tuple, input_names: list[str],
                  output_names: list[str], path: Path, opset: int) -> None:
    registry_log = logging.getLogger("torch.onnx._internal.exporter._registration")  # "torchvision is not installed"
    level = registry_log.level
    registry_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*axis name.*will not be used")
            warnings.filterwarnings("ignore", category=FutureWarning)
            program = torch.onnx.export(
                module.eval(), args, dynamo=True, dynamic_shapes=dynamic_shapes, opset_version=opset,
                input_names=input_names, output_names=output_names, external_data=False, verbose=False,
                custom_translation_table={torch.ops.aten.scaled_dot_product_attention.default: _sdpa_translation(opset)},
            )
    finally:
        registry_log.setLevel(level)
    program.save(str(path))


def _io(session: Any) -> dict[str, list[dict]]:
    """Names, element types and symbolic shapes of an onnxruntime session's inputs and outputs."""
    row = lambda v: {"name": v.name, "type": v.type, "shape": list(v.shape)}
    return {"inputs": [row(v) for v in session.get_inputs()], "outputs": [row(v) for v in session.get_outputs()]}


@torch.no_grad()
def _write_graphs(model: SuperTransformer, arch: Arch, folder: Path, opset: int) -> dict[str, Any]:
    from torch.export import Dim

    entries = cache_layout(model, arch)
    cross = [e for e in entries if e["source"] == "encoder"]
    state = [e for e in entries if e["source"] == "step"]
    dims = {"batch": Dim("batch", min=1), "src_len": Dim("src_len", min=1, max=model.max_positions),
            "past_len": Dim("past_len", min=0, max=model.max_positions - 1)}
    for k in set(arch.attended_layers) - {1}:  # HAT: the keys/values of k encoder outputs of src_len each
        dims[f"{k}*src_len"] = k * dims["src_len"]
    memory_len = dims[f"{max(arch.attended_layers)}*src_len" if max(arch.attended_layers) > 1 else "src_len"]
    axes = lambda shape: {i: dims[d] for i, d in enumerate(shape) if isinstance(d, str)}

    # Example inputs: batch 3, source length 7, past length 2 (distinct, none 0 or 1).
    src = sample_src(model, 3, 7)
    memory, src_pad = model.encode(src, arch)
    snap = run_cache(model, arch, src, 2)[-1]
    tensor = lambda e: snap[e["layer"]][e["part"]][e["key"]]
    encoder = EncoderGraph(model, arch, cross, cross_kv_fn(model, arch, cross, src))
    _export_graph(encoder, (src,), ({0: dims["batch"], 1: dims["src_len"]},), ["src"],
                  ["memory", "src_pad", *[e["output"] for e in cross]], folder / "encoder.onnx", opset)
    tokens = torch.full((3, 1), BOS_ID, dtype=torch.long)
    _export_graph(
        _DecoderStepGraph(model, arch, cross, state),
        (tokens, memory, src_pad, tuple(tensor(e) for e in cross), tuple(tensor(e) for e in state)),
        ({0: dims["batch"]}, {0: dims["batch"], 1: memory_len}, {0: dims["batch"], 1: dims["src_len"]},
         tuple(axes(e["shape"]) for e in cross), tuple(axes(e["shape"]) for e in state)),
        ["tokens", "memory", "src_pad", *[e["input"] for e in cross], *[e["input"] for e in state]],
        ["logits", *[e["output"] for e in state]], folder / "decoder_step.onnx", opset)
    return {"cache": entries}


def _manifest(model: SuperTransformer, arch: Arch, folder: Path, opset: int, beam_size: int,
              cache: list[dict]) -> dict[str, Any]:
    import onnxruntime as ort

    defaults = {n: p.default for n, p in inspect.signature(beam_search).parameters.items()
                if n in ("len_penalty", "max_len_a", "max_len_b")}
    graphs = {}
    for name in ("encoder", "decoder_step"):
        session = ort.InferenceSession(str(folder / f"{name}.onnx"), providers=["CPUExecutionProvider"])
        graphs[name] = {"file": f"{name}.onnx", **_io(session)}
    return {
        "format_version": _FORMAT_VERSION, "opset": opset, "torch_version": torch.__version__,
        "arch": arch.to_dict(), "arch_summary": arch.summary(),
        "vocab_size": model.vocab_size, "pad_id": model.pad_id, "bos_id": BOS_ID, "eos_id": EOS_ID,
        "max_positions": model.max_positions, "max_src_tokens": model.max_positions // 2,
        "beam_size": beam_size, **defaults, "spm_model": "spm.model", "logits": "raw (apply log-softmax)",
        **graphs, "cache": cache,
    }


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def export_onnx(source: str | Path | SuperTransformer, out_dir: str | Path, *, spm_model: str | Path | None = None,
                arch: Arch | None = None, beam_size: int | None = None, opset: int = MIN_OPSET,
                force: bool = False) -> Path:
    """Write an ONNX folder (see the module docstring) for an exported sub-Transformer.

    The folder is written as a temporary sibling and swapped into place (:func:`nas.atomic.output_dir`), so an
    interrupted export leaves the earlier folder whole. ``out_dir`` may be new, empty or an earlier export
    (it holds ``export.json``; ``out_dir`` may be ``source`` itself: the export then gains the ONNX files);
    any other folder is replaced only with ``force``, and the current folder, its ancestors and the home
    folder never.

    Args:
        source: a folder written by ``nas export`` (``nas.export.export_arch``), or a model
            (an extracted sub-Transformer, or a supernet together with ``arch``).
        out_dir: the folder to write.
        spm_model: the SentencePiece model; required with a model ``source``.
        arch: the sub-Transformer to export (a model ``source`` is cropped to it with ``extract``);
            default the folder's ``arch.json``, or the model's widest.
        beam_size: the default beam size of ``translate_onnx.py``; default the folder's, else 4.
        opset: the ONNX opset (>= 18).
        force: replace an ``out_dir`` that holds files and is not an export.
    Returns:
        ``out_dir``, absolute.
    Raises:
        FileNotFoundError: a file of the export, or ``spm_model``, is missing (names it).
        ValueError: ``opset`` below 18, a model ``source`` without ``spm_model``, or ``arch`` beyond
            the model (names the choice).
        OutputPathError: ``out_dir`` may not be replaced (names it and a few of its entries).
    """
    if opset < MIN_OPSET:
        raise ValueError(f"opset={opset} is below {MIN_OPSET}, the lowest the torch.export-based ONNX exporter writes")
    with output_dir(out_dir, marker=PROVENANCE, force=force) as tmp:
        model, arch, beam_size = _stage_source(source, tmp, spm_model, arch, beam_size)
        was_training = model.training
        model.eval()
        try:
            cache = _write_graphs(model, arch, tmp, opset)["cache"]
        finally:
            model.train(was_training)
        manifest = _manifest(model, arch, tmp, opset, beam_size, cache)
        atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=2))
        atomic_write_text(tmp / "translate_onnx.py", TRANSLATE_SCRIPT)
    return Path(out_dir).resolve()


def _stage_source(source: str | Path | SuperTransformer, tmp: Path, spm_model: str | Path | None,
                  arch: Arch | None, beam_size: int | None) -> tuple[SuperTransformer, Arch, int]:
    """Write the PyTorch export files into ``tmp``; return the model, arch and beam size."""
    provenance: dict[str, Any] = {}
    if not isinstance(source, SuperTransformer):
        folder = Path(source)
        for name in _TORCH_FILES:
            if not (folder / name).is_file():
                raise FileNotFoundError(f"{folder / name} not found; export_onnx needs a folder written by `nas export`")
        provenance = json.loads((folder / PROVENANCE).read_text(encoding="utf-8"))
        arch = arch or Arch.from_dict(json.loads((folder / "arch.json").read_text(encoding="utf-8")))
        spm_model = spm_model or folder / "spm.model"
        source = load_model(folder, "model")
    elif spm_model is None:
        raise ValueError("export_onnx(model, ...) needs spm_model=, the SentencePiece model to ship")
    spm_model = Path(spm_model)
    if not spm_model.is_file():
        raise FileNotFoundError(f"SentencePiece model not found: {spm_model}")
    if arch is None:
        arch = source.full_arch
    else:  # ship only the sub-Transformer's weights
        source = extract(source, arch)
    beam_size = beam_size or int(provenance.get("beam_size", 4))
    save_model(source, tmp, "model")
    shutil.copyfile(spm_model, tmp / "spm.model")
    atomic_write_text(tmp / "arch.json", json.dumps(arch.to_dict(), indent=2))
    atomic_write_text(tmp / PROVENANCE, json.dumps({**provenance, "beam_size": beam_size}, indent=2))
    return source, arch, beam_size


def _encode_batch(tokenizer: Tokenizer, sentences: list[str], max_src_tokens: int, pad_id: int) -> torch.Tensor:
    """Source ids ``[b, s]`` as ``nas.eval.scores.translate`` builds them: truncated, EOS, PAD-padded."""
    ids = [x[: max_src_tokens - 1] + [EOS_ID] for x in tokenizer.encode(sentences)]
    src = torch.full((len(ids), max(map(len, ids))), pad_id, dtype=torch.long)
    for row, x in enumerate(ids):
        src[row, : len(x)] = torch.tensor(x)
    return src


@torch.no_grad()
def verify_onnx(out_dir: str | Path, sentences: list[str], *, steps: int = 8, threads: int = 1) -> float:
    """Max absolute difference of the next-token logits between PyTorch and onnxruntime.

    Encodes ``sentences`` as one padded batch with both, then runs ``steps`` decoding steps
    fed with PyTorch's greedy tokens; each side keeps its own cache (onnxruntime starts
    from zero state with past length 0, as ``translate_onnx.py`` does).

    Raises:
        FileNotFoundError: ``out_dir`` is not an ONNX folder (names the missing file).
        ValueError: no sentences, or ``steps < 1``.
    """
    import onnxruntime as ort

    if not sentences or steps < 1:
        raise ValueError(f"verify_onnx needs sentences and steps >= 1 (got {len(sentences)} sentences, steps={steps})")
    folder = Path(out_dir)
    if not (folder / MANIFEST).is_file():
        raise FileNotFoundError(f"{folder / MANIFEST} not found; write the folder with export_onnx")
    meta = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    model = load_model(folder, "model")
    arch = Arch.from_dict(meta["arch"])
    src = _encode_batch(Tokenizer(folder / meta["spm_model"]), sentences, meta["max_src_tokens"], meta["pad_id"])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    session = lambda name: ort.InferenceSession(str(folder / meta[name]["file"]), opts, providers=["CPUExecutionProvider"])
    encoder, decoder = session("encoder"), session("decoder_step")
    enc_names = [o["name"] for o in meta["encoder"]["outputs"]]
    enc = dict(zip(enc_names, encoder.run(enc_names, {"src": src.numpy()})))
    memory, src_pad = model.encode(src, arch)
    diff = float(np.abs(enc["memory"] - memory.numpy()).max())
    state_entries = [e for e in meta["cache"] if e["source"] == "step"]
    n = src.size(0)
    state = {e["input"]: np.zeros([n if d == "batch" else 0 if d == "past_len" else d for d in e["shape"]], np.float32)
             for e in state_entries}
    cross = {e["input"]: enc[e["output"]] for e in meta["cache"] if e["source"] == "encoder"}
    cache: list = [{} for _ in model.decoder]
    tokens = torch.full((n, 1), meta["bos_id"], dtype=torch.long)
    outputs = ["logits", *[e["output"] for e in state_entries]]
    for step in range(steps):
        logits = model.decode_step(tokens, step, memory, src_pad, arch, cache)
        feeds = {"tokens": tokens.numpy(), "memory": enc["memory"], "src_pad": enc["src_pad"], **cross, **state}
        got = decoder.run(outputs, feeds)
        diff = max(diff, float(np.abs(got[0] - logits.numpy()).max()))
        state = {e["input"]: t for e, t in zip(state_entries, got[1:])}
        tokens = logits.argmax(-1, keepdim=True)
    return diff


def cpu_has_vnni() -> bool:
    """Whether this CPU has VNNI (``avx512_vnni`` or ``avx_vnni`` among ``/proc/cpuinfo``'s flags), the int8
    dot-product instructions onnxruntime's ``MatMulInteger`` uses when present; False where it cannot tell."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "avx512_vnni" in flags or "avx_vnni" in flags


def quantize_onnx(out_dir: str | Path, *, per_channel: bool = False,
                  reduce_range: bool | None = None) -> dict[str, dict[str, int]]:
    """Quantize the matrix weights of an ONNX folder's two graphs to int8 (onnxruntime dynamic quantization).

    Each graph is first optimised by onnxruntime's basic level (constant folding), so the weights that the
    exporter reaches through ``Transpose``/``Reshape``/``Slice`` of the stacked parameters become plain
    initializers that ``quantize_dynamic`` can see; the graph's stored intermediate shapes are dropped, since
    the tied embedding's conflicts with the quantizer's shape inference. Then
    ``onnxruntime.quantization.quantize_dynamic`` (``QInt8`` weights, activations quantized per call)
    replaces each ``MatMul`` with a constant weight by ``MatMulInteger``; attention's two activation
    products stay fp32. ``onnx.json`` then points at the int8 graphs (so ``translate_onnx.py`` uses them)
    and keeps the fp32 ones as ``fp32_file``. Running it again re-quantizes from the fp32 graphs.

    torch's ``quantize_dynamic`` would change nothing here: it replaces ``nn.Linear`` modules, and the
    supernet stores stacked weight parameters.

    Args:
        out_dir: a folder written by :func:`export_onnx`.
        per_channel: one scale per output channel instead of one per matrix.
        reduce_range: weights quantized to 7 bits instead of 8 (onnxruntime's ``reduce_range``). None: on a CPU
            without VNNI (:func:`cpu_has_vnni`), where onnxruntime's u8s8 products of the AVX2 kernels can
            saturate: there, on a 2-core AVX2 EPYC, 8-bit weights put the int8 logits of a test model 13% (of
            the largest fp32 logit) off the fp32 ones, against under 10% on CPUs with VNNI
            (``tests/export/test_onnx.py``). Recorded in ``onnx.json``; quantize on the machine that serves.
    Returns:
        Per graph: ``{"matmuls": all MatMul nodes, "quantized": weight products made int8, "fp32_bytes",
        "int8_bytes"}``.
    Raises:
        FileNotFoundError: ``out_dir`` has no ``onnx.json`` (write it with :func:`export_onnx`).
    """
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic

    folder = Path(out_dir)
    if not (folder / MANIFEST).is_file():
        raise FileNotFoundError(f"{folder / MANIFEST} not found; write the ONNX folder first (nas export --onnx)")
    reduce_range = not cpu_has_vnni() if reduce_range is None else reduce_range
    meta = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    report: dict[str, dict[str, int]] = {}
    for name in ("encoder", "decoder_step"):
        fp32 = meta[name].get("fp32_file", meta[name]["file"])
        int8 = f"{name}.int8.onnx"
        with atomic_path(folder / f".{name}.folded.onnx") as folded, atomic_path(folder / int8) as tmp:
            options = ort.SessionOptions()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
            options.optimized_model_filepath = str(folded)
            ort.InferenceSession(str(folder / fp32), options, providers=["CPUExecutionProvider"])
            graph = onnx.load(str(folded))
            del graph.graph.value_info[:]
            _gemm_as_matmul(graph.graph)
            onnx.save(graph, str(folded))
            root = logging.getLogger()
            level = root.level
            root.setLevel(logging.ERROR)  # the quantizer logs "consider pre-processing" on the root logger
            try:
                quantize_dynamic(str(folded), str(tmp), weight_type=QuantType.QInt8, per_channel=per_channel,
                                 reduce_range=reduce_range, op_types_to_quantize=["MatMul"])  # not Gather: it breaks the tied embedding
            finally:
                root.setLevel(level)
            ops = [n.op_type for n in onnx.load(str(tmp)).graph.node]
        (folder / f".{name}.folded.onnx").unlink(missing_ok=True)
        report[name] = {"matmuls": ops.count("MatMul") + ops.count("MatMulInteger"),
                        "quantized": ops.count("MatMulInteger"),
                        "fp32_bytes": (folder / fp32).stat().st_size, "int8_bytes": (folder / int8).stat().st_size}
        meta[name] = {**meta[name], "file": int8, "fp32_file": fp32}
    meta["quantized"] = {"weights": "int8", "method": "onnxruntime quantize_dynamic (QInt8)",
                         "per_channel": per_channel, "reduce_range": reduce_range, "graphs": report}
    atomic_write_text(folder / MANIFEST, json.dumps(meta, indent=2))
    return report


def _gemm_as_matmul(graph: Any) -> None:
    """Rewrite each ``Gemm(A, B[, C])`` with a constant ``B`` (``alpha = beta = 1``, ``transA = 0``) as
    ``MatMul(A, B')`` (+ ``Add(C)``), ``B'`` a new initializer holding ``B`` or its transpose.

    onnxruntime's dynamic quantization makes ``MatMul`` int8 but has no integer ``Gemm``; the decoder's
    output product (the tied embedding, ``transB = 1``), the largest product of a step, is a ``Gemm``. Its own
    copy also keeps the embedding lookup (``Gather``) on the fp32 original: quantizing a weight the lookup
    shares rewrote it in place and broke the lookup."""
    from onnx import helper, numpy_helper

    inits = {i.name: i for i in graph.initializer}
    nodes = list(graph.node)
    del graph.node[:]
    for node in nodes:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (node.op_type != "Gemm" or node.input[1] not in inits or attrs.get("transA", 0)
                or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0):
            graph.node.append(node)
            continue
        weight = numpy_helper.to_array(inits[node.input[1]])
        weight = weight.T.copy() if attrs.get("transB", 0) else weight
        name = f"{node.input[1]}.matmul.{node.name}"
        graph.initializer.append(numpy_helper.from_array(weight, name))
        has_bias = len(node.input) > 2 and node.input[2]
        product = f"{node.output[0]}.matmul" if has_bias else node.output[0]
        graph.node.append(helper.make_node("MatMul", [node.input[0], name], [product], name=f"{node.name}.matmul"))
        if has_bias:
            graph.node.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]],
                                               name=f"{node.name}.bias"))
