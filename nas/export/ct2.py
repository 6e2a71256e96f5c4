"""An export folder as a CTranslate2 model: the engine MT engineers deploy with.

CTranslate2 runs the plain pre-norm Transformer (Vaswani et al. 2017 with the pre-norm residual of Wang et
al. 2019, what ``torch.nn.Transformer(norm_first=True)`` computes). A sub-Transformer is that model exactly
when every layer has one branch, one path and one unit, the ``sequential`` layout, and every layer of a
stack has the same attention width (CTranslate2 takes one head count per stack); FFN widths may differ per
layer, and every decoder layer attends to the last encoder layer only (HAT's ``encoder_attention`` 1).
``io_projection`` (Scalable Transformers eq. 3) and relative positions (MUTE's encoders) have no
CTranslate2 counterpart in a Transformer spec, so models with them are refused too; relative positions only
where every layer has them (``relative_layers`` "all"): under "units" they are used only by layers with
units > 1, which are refused anyway.
:func:`ctranslate2_problem` names the first choice that prevents the conversion.

The model is built with CTranslate2's Python spec API (``ctranslate2.specs.TransformerSpec``), weight by
weight, the way its fairseq converter does:

- self-attention: ``linear[0]`` the fused ``[3D, C]`` query/key/value projection, ``linear[1]`` the output;
- cross-attention: ``linear[0]`` the query, ``linear[1]`` the fused ``[2D, C]`` key/value, ``linear[2]`` the
  output; each with the sublayer's pre-norm layer norm;
- our interleaved sinusoids (``nas.model.ops.sinusoidal_positions``) as the position table (CTranslate2's own
  table concatenates sines and cosines), ``sqrt(E)`` embedding scale, and the tied output projection;
- one shared vocabulary: the SentencePiece pieces, with ``<unk>``, ``<s>`` and ``</s>`` at our ids; the
  source gets EOS appended (``add_source_eos``) and decoding starts from BOS, as :func:`nas.model.beam_search`.

``ctranslate2`` is an optional dependency (``pip install 'nas[serve]'``); importing this module does not
need it, the conversion and :class:`Ct2Translator` do.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

import sentencepiece as spm

from nas.data import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from nas.errors import NasError
from nas.atomic import output_dir
from nas.model.ops import sinusoidal_positions
from nas.model.supernet import SuperTransformer
from nas.space.arch import Arch, StackArch

__all__ = ["CT2_DIR", "Ct2Translator", "UnsupportedArchError", "build_spec", "ctranslate2_problem",
           "export_ctranslate2", "require_ctranslate2"]

CT2_DIR = "ctranslate2"
"""The folder, inside an export folder, that ``nas export --ctranslate2`` writes."""

_MANIFEST = "nas_ctranslate2.json"  # our own file in the CTranslate2 folder: what it was converted from


class UnsupportedArchError(NasError):
    """The sub-Transformer has a choice CTranslate2's Transformer spec cannot represent (the message names it)."""


def require_ctranslate2() -> Any:
    """Import ``ctranslate2``; a :class:`NasError` saying how to install it when it is missing."""
    try:
        import ctranslate2
    except ImportError as err:
        raise NasError("CTranslate2 is not installed; install the serving extra: pip install 'nas[serve]' "
                       "(or pip install ctranslate2)") from err
    return ctranslate2


def _stack_problem(name: str, stack: StackArch) -> str | None:
    for i, dims in enumerate(stack.layer_dims()):
        where = f"{name} layer {i}"
        if dims.layout != "sequential":
            return f"{where} uses the {dims.layout!r} layout (CTranslate2 runs sequential layers only)"
        for choice, value in (("branches", dims.branches), ("paths", dims.paths), ("units", dims.units)):
            if value != 1:
                return f"{where} has {choice}={value} (CTranslate2 runs 1 branch, 1 path and 1 unit per layer)"
    widths = sorted(set(stack.width))
    if len(widths) > 1:
        return (f"the {name} mixes attention widths {widths} (CTranslate2 takes one head count per stack; "
                f"choose one width for every {name} layer)")
    return None


def ctranslate2_problem(arch: Arch, config: dict[str, Any]) -> str | None:
    """The first choice that CTranslate2 cannot represent, as one line; None when it can (see the module
    docstring for what it can).

    Args:
        arch: the sub-Transformer.
        config: the constructor config of the model that runs it (``SuperTransformer.config()``, the
            ``model.json`` of a supernet or an export); read for ``io_projection``, ``relative_positions`` and
            ``relative_layers`` (absent: "all", the format before it existed).
    """
    for name, stack in (("encoder", arch.encoder), ("decoder", arch.decoder)):
        problem = _stack_problem(name, stack)
        if problem:
            return problem
    for i, k in enumerate(arch.attended_layers):
        if k > 1:
            return (f"decoder layer {i} attends to the last {k} encoder layers (encoder_attention="
                    f"{arch.decoder.encoder_attention[i]}, HAT's "
                    f"arbitrary encoder-decoder attention); CTranslate2 attends to the last one only")
    if config.get("io_projection") or arch.model_width:
        return "the model has the input/output projections of Scalable Transformers eq. 3 (io_projection)"
    if config.get("relative_positions") and config.get("relative_layers", "all") == "all":
        return (f"the encoder uses relative position representations (relative_positions="
                f"{config['relative_positions']}) besides absolute sinusoids")
    return None


def _np(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().to(torch.float32).cpu().numpy())


def _linear(spec: Any, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    spec.weight = _np(weight)
    if bias is not None:
        spec.bias = _np(bias)


def _norm(spec: Any, weight: torch.Tensor, bias: torch.Tensor) -> None:
    spec.gamma, spec.beta = _np(weight), _np(bias)


def _self_attention(spec: Any, attn: Any, paths: Any, width: int, c: int) -> None:
    """``w_in [1, 1, 1, 3, D, C]`` -> fused ``[3D, C]``; ``w_out [1, 1, 1, C, D]``; the sublayer's pre-norm."""
    _linear(spec.linear[0], attn.w_in[0, 0, 0, :, :width, :c].reshape(3 * width, c),
            attn.b_in[0, 0, 0, :, :width].reshape(-1))
    _linear(spec.linear[1], attn.w_out[0, 0, 0, :c, :width], attn.b_out[0, 0, 0, :c])
    _norm(spec.layer_norm, paths.ln_weight[0, 0, :c], paths.ln_bias[0, 0, :c])


def _cross_attention(spec: Any, attn: Any, paths: Any, width: int, c: int) -> None:
    w, b = attn.w_in[0, 0, 0, :, :width, :c], attn.b_in[0, 0, 0, :, :width]
    _linear(spec.linear[0], w[0], b[0])
    _linear(spec.linear[1], w[1:].reshape(2 * width, c), b[1:].reshape(-1))
    _linear(spec.linear[2], attn.w_out[0, 0, 0, :c, :width], attn.b_out[0, 0, 0, :c])
    _norm(spec.layer_norm, paths.ln_weight[0, 0, :c], paths.ln_bias[0, 0, :c])


def _ffn(spec: Any, ffn: Any, paths: Any, f: int, c: int) -> None:
    _linear(spec.linear_0, ffn.w1[0, 0, :f, :c], ffn.b1[0, 0, :f])
    _linear(spec.linear_1, ffn.w2[0, 0, :c, :f], ffn.b2[0, 0, :c])
    _norm(spec.layer_norm, paths.ln_weight[0, 0, :c], paths.ln_bias[0, 0, :c])


def _inputs(spec: Any, model: SuperTransformer) -> None:
    embeddings = spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings
    embeddings.weight = _np(model.embed.weight)
    spec.scale_embeddings = True  # sqrt(E) (Vaswani et al. sec. 3.4), as SuperTransformer.embed_tokens
    spec.position_encodings.encodings = _np(sinusoidal_positions(model.max_positions, model.embed_dim))


def build_spec(model: SuperTransformer, arch: Arch, pieces: list[str]) -> Any:
    """The ``ctranslate2.specs.TransformerSpec`` of ``arch`` cropped from ``model``, vocabulary ``pieces``.

    Raises:
        UnsupportedArchError: ``arch`` has a choice CTranslate2 cannot represent (:func:`ctranslate2_problem`).
        NasError: ``ctranslate2`` is not installed.
    """
    problem = ctranslate2_problem(arch, model.config())
    if problem:
        raise UnsupportedArchError(f"cannot convert to CTranslate2: {problem}")
    require_ctranslate2()
    from ctranslate2.specs import transformer_spec

    arch = model.check_arch(arch)
    c = model.model_dim
    enc_w, dec_w = arch.encoder.width[0], arch.decoder.width[0]
    enc_heads = model.encoder[0].attn.heads_of(enc_w)
    dec_heads = model.decoder[0].self_attn.heads_of(dec_w)
    encoder = transformer_spec.TransformerEncoderSpec(arch.encoder.layers, enc_heads, pre_norm=True,
                                                      head_dim=enc_w // enc_heads)
    decoder = transformer_spec.TransformerDecoderSpec(arch.decoder.layers, dec_heads, pre_norm=True,
                                                      head_dim=dec_w // dec_heads)
    spec = transformer_spec.TransformerSpec(encoder, decoder)
    with torch.no_grad():
        _inputs(encoder, model)
        _inputs(decoder, model)
        for layer_spec, layer, dims in zip(encoder.layer, model.encoder, arch.encoder.layer_dims()):
            _self_attention(layer_spec.self_attention, layer.attn, layer.attn_paths, dims.width, c)
            _ffn(layer_spec.ffn, layer.ffn, layer.ffn_paths, dims.ffn_width, c)
        for layer_spec, layer, dims in zip(decoder.layer, model.decoder, arch.decoder.layer_dims()):
            _self_attention(layer_spec.self_attention, layer.self_attn, layer.self_attn_paths, dims.width, c)
            _cross_attention(layer_spec.attention, layer.cross_attn, layer.cross_attn_paths, dims.width, c)
            _ffn(layer_spec.ffn, layer.ffn, layer.ffn_paths, dims.ffn_width, c)
        _norm(encoder.layer_norm, model.encoder_norm.weight[:c], model.encoder_norm.bias[:c])
        _norm(decoder.layer_norm, model.decoder_norm.weight[:c], model.decoder_norm.bias[:c])
        decoder.projection.weight = _np(model.embed.weight)  # tied output layer, no bias
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = (pieces[UNK_ID], pieces[BOS_ID],
                                                                         pieces[EOS_ID])
    spec.config.decoder_start_token = pieces[BOS_ID]
    spec.config.add_source_eos = True  # our sources end in EOS (nas.eval.scores.encode_sources)
    return spec


def export_ctranslate2(export_dir: str | Path, out: str | Path | None = None, *, quantization: str | None = None,
                       force: bool = False) -> Path:
    """Convert the export folder ``export_dir`` (written by ``nas export``) to a CTranslate2 model folder.

    ``out`` defaults to ``export_dir / "ctranslate2"``; it holds ``model.bin``, ``config.json``, the shared
    vocabulary, a copy of ``spm.model`` and ``nas_ctranslate2.json`` (the arch and the settings). It is written
    as a temporary sibling and swapped into place (:func:`nas.atomic.output_dir`); an earlier CTranslate2 folder is
    replaced, any other non-empty folder only with ``force``. ``quantization``: CTranslate2's weight type
    (``int8``, ``int8_float32``, ...; None keeps float32).

    Raises:
        FileNotFoundError: ``export_dir`` is not an export folder.
        UnsupportedArchError: the sub-Transformer has a choice CTranslate2 cannot represent (names it).
        NasError: ``ctranslate2`` is not installed.
        OutputPathError: ``out`` may not be replaced.
    """
    from nas.export.folder import load_export

    export_dir = Path(export_dir)
    exported = load_export(export_dir)
    model = exported.model.eval()
    sp = spm.SentencePieceProcessor(model_file=str(export_dir / "spm.model"))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    spec = build_spec(model, exported.arch, pieces)
    spec.validate()
    spec.optimize(quantization=quantization)
    out = Path(out) if out is not None else export_dir / CT2_DIR
    with output_dir(out, marker=_MANIFEST, force=force) as tmp:
        spec.save(str(tmp))
        shutil.copyfile(export_dir / "spm.model", tmp / "spm.model")
        (tmp / _MANIFEST).write_text(json.dumps({"arch": exported.arch.to_dict(), "beam_size": exported.beam_size,
                                                 "quantization": quantization,
                                                 "max_src_tokens": exported.max_src_tokens}, indent=2) + "\n")
    return out


@contextlib.contextmanager
def _keep_torch_threads() -> Iterator[None]:
    """Restore torch's intra-op thread count after a CTranslate2 call: CTranslate2 sets the OpenMP thread count
    of the process to its own ``intra_threads``, which torch then reads back (measured: 2 threads became 1), so
    a later PyTorch computation in the same process would run on CTranslate2's count, slower and with other
    rounding."""
    torch_module = sys.modules.get("torch")
    threads = torch_module.get_num_threads() if torch_module is not None else None
    try:
        yield
    finally:
        if threads is not None and torch_module.get_num_threads() != threads:
            torch_module.set_num_threads(threads)


class Ct2Translator:
    """Translate raw sentences with a CTranslate2 folder written by :func:`export_ctranslate2`.

    Sources are cut to the export's longest source (``max_src_tokens`` pieces) and decoded for at most
    ``1.5 * len + 10`` tokens, as :func:`nas.model.beam_search` (``max_len_a``, ``max_len_b``); scores are
    normalised by length (``length_penalty=1``).

    Args:
        folder: the CTranslate2 folder.
        threads: intra-op threads (CTranslate2's ``intra_threads``).
        compute_type: CTranslate2's compute type (``default``: the stored weight type).

    Raises:
        NasError: ``ctranslate2`` is not installed, or ``folder`` is not a CTranslate2 export (names the fix).
    """

    def __init__(self, folder: str | Path, threads: int = 1, compute_type: str = "default") -> None:
        ct2 = require_ctranslate2()
        folder = Path(folder)
        manifest = folder / _MANIFEST
        if not manifest.is_file():
            raise NasError(f"{folder} is not a CTranslate2 export of nas (no {_MANIFEST}); write one with "
                           f"`nas export --ctranslate2`")
        self.meta = json.loads(manifest.read_text(encoding="utf-8"))
        self.sp = spm.SentencePieceProcessor(model_file=str(folder / "spm.model"))
        self._never = [[self.sp.id_to_piece(PAD_ID)], [self.sp.id_to_piece(BOS_ID)]]
        with _keep_torch_threads():
            self.translator = ct2.Translator(str(folder), device="cpu", intra_threads=threads, inter_threads=1,
                                             compute_type=compute_type)

    def pieces(self, sentences: list[str]) -> list[list[str]]:
        """The SentencePiece pieces of each sentence, cut to the export's longest source."""
        limit = int(self.meta["max_src_tokens"])
        return [pieces[:limit] for pieces in self.sp.encode(list(sentences), out_type=str)]

    def translate_pieces(self, pieces: list[list[str]], beam_size: int | None = None, *, max_batch_size: int = 64,
                         min_length: int = 0, max_length: int | None = None) -> list[list[str]]:
        """Output pieces (no BOS/EOS) of each source's ``pieces`` (EOS is appended by the model's config).

        ``max_length`` (tokens, EOS not counted) defaults to what :func:`nas.model.beam_search` allows the
        longest source of the call, ``int(1.5 * (len + 1) + 10) - 1`` (CTranslate2 takes one bound per call,
        beam_search one per sentence); ``min_length`` forbids EOS before it. PAD and BOS are never emitted, as
        in beam_search.
        """
        beam = beam_size or int(self.meta.get("beam_size", 4))
        if max_length is None:
            max_length = int(1.5 * (max((len(p) for p in pieces), default=0) + 1) + 10) - 1
        with _keep_torch_threads():
            results = self.translator.translate_batch(pieces, beam_size=beam, max_batch_size=max_batch_size,
                                                      batch_type="examples", max_decoding_length=max_length,
                                                      min_decoding_length=min_length, length_penalty=1.0,
                                                      suppress_sequences=self._never)
        return [r.hypotheses[0] for r in results]

    def translate(self, sentences: list[str], beam_size: int | None = None, *, max_batch_size: int = 64) -> list[str]:
        """Detokenized translations of ``sentences``, in input order (an empty line gives "").

        Sources of equal length are translated together (at most ``max_batch_size`` a call), so each gets the
        length bound :func:`nas.model.beam_search` gives it; equal lengths also mean no padding.
        """
        out = [""] * len(sentences)
        keep = [i for i, s in enumerate(sentences) if s.strip()]
        pieces = dict(zip(keep, self.pieces([sentences[i] for i in keep])))
        groups: dict[int, list[int]] = {}
        for i in keep:
            groups.setdefault(len(pieces[i]), []).append(i)
        for rows in groups.values():
            for start in range(0, len(rows), max_batch_size):
                chunk = rows[start:start + max_batch_size]
                hyps = self.translate_pieces([pieces[i] for i in chunk], beam_size, max_batch_size=max_batch_size)
                for i, hyp in zip(chunk, hyps):
                    out[i] = self.sp.decode_pieces(hyp)
        return out
