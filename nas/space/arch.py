"""The architecture of one sub-Transformer: an explicit, frozen, hashable value.

An :class:`Arch` is passed to the supernet on every call (``supernet(src, tgt, arch)``);
nothing about the architecture is stored on the modules. The same class also describes
the *maxima* of a supernet (every layer at its widest), so a standalone model extracted
for an arch is simply a model whose maxima are that arch.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

from nas.errors import ArchError

__all__ = ["Arch", "StackArch", "LayerArch", "DIMENSIONS", "INT_DIMENSIONS", "LAYOUTS", "UNIT_BIASES", "DEPENDENCIES"]

DIMENSIONS = ("width", "ffn_width", "branches", "paths", "layout", "kernels", "units", "unit_bias", "unit_dependency",
              "encoder_attention")
"""The per-layer choices of a stack, in StackArch field order."""
INT_DIMENSIONS = ("width", "ffn_width", "branches", "paths", "units", "encoder_attention")
"""Dimensions whose value may not exceed the supernet's."""
UNIT_BIASES = ("identity", "swap", "disorder", "mask", "mixed")
"""MUTE unit biases (sec. 3.2); ``mixed`` gives units 1, 2, 3, ... swap, disorder, mask in turn."""
DEPENDENCIES = ("independent", "sequential")
"""How MUTE units are combined: weighted sum (eq. 10/12) or sequential dependency (eq. 13-16)."""
LAYOUTS = ("sequential", "prime")
"""Layer layouts: pre-norm sublayers in sequence, or a Prime unit (Unified Transformer eq. 1, 4)."""
SUPPORTS_BOTH = "sequential+prime"
"""A supernet maxima layout: the layer can run either layout (never a sub-Transformer's choice)."""


class LayerArch(NamedTuple):
    """One layer's choices (see :class:`StackArch` for the meaning of each)."""

    width: int
    ffn_width: int
    branches: int
    paths: int
    layout: str
    kernels: tuple[int, ...]
    units: int = 1
    unit_bias: str = "identity"
    unit_dependency: str = "independent"
    encoder_attention: int = 1


@dataclass(frozen=True)
class StackArch:
    """Per-layer choices of one stack (encoder or decoder); all tuples have len == layers.

    As a supernet's *maxima*, ``layout`` may be ``"sequential+prime"`` (both supported) and
    ``kernels`` lists the kernel sizes available in the layer.
    """

    width: tuple[int, ...]
    """Attention width D_l per layer (channels): q/k/v width of every branch; Scalable Transformers type 2."""
    ffn_width: tuple[int, ...]
    """Inner FFN width F_l per layer (channels)."""
    branches: tuple[int, ...] = field(default=())
    """Attention branches N_a per layer (MAT eq. 4); empty means one branch in every layer."""
    paths: tuple[int, ...] = field(default=())
    """Parallel paths per sublayer, per layer (Multi-Path eq. 4); empty means one path. Prime layers use one."""
    layout: tuple[str, ...] = field(default=())
    """``sequential`` (pre-norm sublayers) or ``prime`` (Unified Transformer eq. 4) per layer; empty: sequential."""
    kernels: tuple[tuple[int, ...], ...] = field(default=())
    """Dynamic-convolution kernel sizes of a Prime layer (eq. 6-7); ``()`` is Prime-simple. Empty: none."""
    units: tuple[int, ...] = field(default=())
    """MUTE units per layer (eq. 10); empty means one unit in every layer."""
    unit_bias: tuple[str, ...] = field(default=())
    """Input noise of units 1.. in training (MUTE sec. 3.2): identity, swap, disorder, mask or mixed."""
    unit_dependency: tuple[str, ...] = field(default=())
    """``independent`` (eq. 10) or ``sequential`` (eq. 13-16, with AutoShuffle) unit combination."""
    encoder_attention: tuple[int, ...] = field(default=())
    """Decoder layers: how many of the last encoder layers' outputs the cross-attention attends to (HAT sec. 3.1,
    arbitrary encoder-decoder attention; no parameters); empty means 1, the last only. Always 1 in an encoder."""

    def __post_init__(self) -> None:
        n = len(self.width)
        object.__setattr__(self, "width", tuple(int(w) for w in self.width))
        object.__setattr__(self, "ffn_width", tuple(int(f) for f in self.ffn_width))
        for name in ("branches", "paths"):
            object.__setattr__(self, name, tuple(int(b) for b in getattr(self, name)) or (1,) * n)
        object.__setattr__(self, "layout", tuple(str(x) for x in self.layout) or ("sequential",) * n)
        object.__setattr__(self, "kernels", tuple(tuple(sorted(int(k) for k in ks)) for ks in self.kernels) or ((),) * n)
        object.__setattr__(self, "units", tuple(int(u) for u in self.units) or (1,) * n)
        object.__setattr__(self, "unit_bias", tuple(str(b) for b in self.unit_bias) or ("identity",) * n)
        object.__setattr__(self, "unit_dependency", tuple(str(d) for d in self.unit_dependency) or ("independent",) * n)
        object.__setattr__(self, "encoder_attention", tuple(int(k) for k in self.encoder_attention) or (1,) * n)
        lengths = {name: len(getattr(self, name)) for name in DIMENSIONS}
        if len(set(lengths.values())) != 1:
            raise ArchError(f"StackArch tuples differ in length: {lengths}; give one value per layer")
        if not self.width:
            raise ArchError("StackArch needs at least one layer")
        for name in INT_DIMENSIONS:
            for i, v in enumerate(getattr(self, name)):
                if v < 1:
                    raise ArchError(f"{name}[{i}]={v} must be >= 1")
        for i, (bias, dep) in enumerate(zip(self.unit_bias, self.unit_dependency)):
            if bias not in UNIT_BIASES:
                raise ArchError(f"unit_bias[{i}]={bias!r}; expected one of {', '.join(UNIT_BIASES)}")
            if dep not in DEPENDENCIES:
                raise ArchError(f"unit_dependency[{i}]={dep!r}; expected one of {', '.join(DEPENDENCIES)}")
        for i, (layout, ks) in enumerate(zip(self.layout, self.kernels)):
            if layout not in (*LAYOUTS, SUPPORTS_BOTH):
                raise ArchError(f"layout[{i}]={layout!r}; expected one of {', '.join(LAYOUTS)}")
            if any(k < 1 or k % 2 == 0 for k in ks):
                raise ArchError(f"kernels[{i}]={list(ks)}: kernel sizes must be odd and >= 1")
            if ks and layout == "sequential":
                raise ArchError(f"kernels[{i}]={list(ks)} on a sequential layer; kernels need layout prime")
            if layout == "prime" and self.paths[i] > 1:
                raise ArchError(f"paths[{i}]={self.paths[i]} on a prime layer; a Prime unit has one path")

    @property
    def layers(self) -> int:
        """Number of layers in this stack."""
        return len(self.width)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the per-layer tuples; ``encoder_attention`` only when a layer's is not 1, so that an
        arch without the choice keeps the dict (and :attr:`Arch.arch_id`) it had before the choice existed."""
        d = {name: list(getattr(self, name)) for name in DIMENSIONS}
        d["kernels"] = [list(ks) for ks in self.kernels]
        if all(k == 1 for k in self.encoder_attention):
            del d["encoder_attention"]
        return d

    def layer_dims(self) -> list[LayerArch]:
        """The choices of each layer."""
        return [LayerArch(*values) for values in zip(*(getattr(self, name) for name in DIMENSIONS))]

    def summary(self) -> str:
        """One token per layer: ``width/ffn_width``, ``xN`` for N branches, ``pN`` for N paths, ``eN`` for
        cross-attention to the last N encoder layers, ``P`` for a Prime layer with its kernels (``P3,15``; ``P-``
        for Prime-simple), ``uN`` for N units with their bias and ``-seq`` for sequential dependency."""
        cells = []
        for d in self.layer_dims():
            cell = f"{d.width}/{d.ffn_width}" + (f"x{d.branches}" if d.branches > 1 else "")
            cell += f"p{d.paths}" if d.paths > 1 else ""
            cell += f"e{d.encoder_attention}" if d.encoder_attention > 1 else ""
            if d.layout == "prime":
                cell += "P" + (",".join(map(str, d.kernels)) or "-")
            if d.units > 1:
                cell += f"u{d.units}" + ("" if d.unit_bias == "identity" else f"-{d.unit_bias}")
                cell += "-seq" if d.unit_dependency == "sequential" else ""
            cells.append(cell)
        return " ".join(cells)


_EXAMPLE = ("e.g. 'enc[128/256 128/256] dec[128/256]' or "
            "'C64 enc[64/256x2 64/256P3,7] dec[64/256e2 64/256u2-swap-seq]'")
"""Valid :meth:`Arch.summary` strings, shown by every :meth:`Arch.parse` error."""
_MODEL_WIDTH = re.compile(r"\s*C(\d+)(?!\S)")
"""The optional model width token of a summary (``C64``), before ``enc[``."""
_STACK = {name: re.compile(rf"\s*{name}\s*\[([^\[\]]*)\]") for name in ("enc", "dec")}
"""A stack of a summary: ``enc[<cells>]`` or ``dec[<cells>]`` (group 1: the cells)."""
_CELL = re.compile(r"(?P<width>\d+)/(?P<ffn>\d+)(?:x(?P<branches>\d+))?(?:p(?P<paths>\d+))?"
                   r"(?:e(?P<encoder_attention>\d+))?(?:P(?P<kernels>-|\d+(?:,\d+)*))?"
                   r"(?:u(?P<units>\d+)(?:-(?P<bias>" + "|".join(UNIT_BIASES) + r"))?(?P<seq>-seq)?)?")
"""One layer of :meth:`StackArch.summary`."""
_CELL_FORM = ("'width/ffn_width' with optional xN (branches), pN (paths), eN (encoder layers attended), "
              "P<kernels> or P- (Prime), uN[-bias][-seq] (units)")


def _first_token(text: str) -> str:
    """The first whitespace-separated token of ``text`` (for error messages)."""
    return text.split()[0] if text.split() else ""


def _stack_problem(text: str, name: str) -> str:
    """Why ``text`` (the rest of a summary) does not start with the stack ``name`` (``enc`` or ``dec``)."""
    rest = text.strip()
    if not rest:
        return f"missing '{name}[...]' at the end"
    if not re.match(rf"{name}\s*\[", rest):
        return f"expected '{name}[...]' where {_first_token(rest)!r} is"
    inner = rest[rest.index("[") + 1:]
    opening = inner.find("[")  # before any ']' (else the stack would have matched)
    if opening < 0:
        return f"'{name}[' has no closing ']'"
    token = _first_token(inner[inner.rfind(" ", 0, opening) + 1:])
    return f"'{name}[' has no closing ']' before {token!r}"


def _cell_problem(cell: str, m: re.Match[str] | None) -> str | None:
    """Why the layer token ``cell`` (matched by :data:`_CELL`, or None) describes no layer; None when it does."""
    if m is None:
        return f"layer {cell!r} is not {_CELL_FORM}"
    for key, mark, meaning in (("width", "", "width"), ("ffn", "/", "ffn_width"), ("branches", "x", "branches"),
                               ("paths", "p", "paths"), ("encoder_attention", "e", "encoder_attention"),
                               ("units", "u", "units")):
        if m[key] is not None and int(m[key]) < 1:
            return f"layer {cell!r}: {mark}{m[key]} ({meaning}) must be >= 1"
    kernels = m["kernels"] if m["kernels"] not in (None, "-") else ""
    if any(int(k) % 2 == 0 for k in kernels.split(",") if k):
        return f"layer {cell!r}: P{kernels}: kernel sizes must be odd"
    if m["kernels"] is not None and int(m["paths"] or 1) > 1:
        return f"layer {cell!r}: p{m['paths']} on a Prime layer (P); a Prime unit has one path"
    return None


def _parse_stack(text: str, name: str, cells: str) -> StackArch:
    """The stack the space-separated layer tokens ``cells`` (of ``name[...]`` in the summary ``text``) describe."""
    layers = []
    for cell in cells.split():
        m = _CELL.fullmatch(cell)
        problem = _cell_problem(cell, m)
        if problem is not None:
            raise ArchError(f"arch {text!r}: {name}[...] {problem}; {_EXAMPLE}")
        layers.append(m)
    if not layers:
        raise ArchError(f"arch {text!r}: '{name}[]' has no layer; {_EXAMPLE}")
    return StackArch(
        width=[int(m["width"]) for m in layers], ffn_width=[int(m["ffn"]) for m in layers],
        branches=[int(m["branches"] or 1) for m in layers], paths=[int(m["paths"] or 1) for m in layers],
        layout=["prime" if m["kernels"] is not None else "sequential" for m in layers],
        kernels=[tuple(int(k) for k in m["kernels"].split(",")) if m["kernels"] not in (None, "-") else ()
                 for m in layers],
        units=[int(m["units"] or 1) for m in layers],
        unit_bias=[m["bias"] or "identity" for m in layers],
        unit_dependency=["sequential" if m["seq"] else "independent" for m in layers],
        encoder_attention=[int(m["encoder_attention"] or 1) for m in layers])


@dataclass(frozen=True)
class Arch:
    """A sub-Transformer: the encoder's and the decoder's per-layer choices.

    Layer counts are the tuple lengths: a sub-Transformer uses the first ``layers`` layers
    of the supernet's stack, the first ``branches`` branches of each layer and the top-left
    crop of each weight matrix (Scalable Transformers sec. 3.1, W[1:C, 1:D]).
    """

    encoder: StackArch
    decoder: StackArch
    model_width: int | None = None
    """C, the model width of every layer (type-1 Scalable Transformers, sec. 3.2): the residual stream,
    layer norms and the input/output projections of eq. 3 are cropped to it. None: the supernet's."""

    def __post_init__(self) -> None:
        if self.model_width is not None:
            object.__setattr__(self, "model_width", int(self.model_width))
            if self.model_width < 1:
                raise ArchError(f"model_width={self.model_width} must be >= 1")
        if any(k != 1 for k in self.encoder.encoder_attention):
            raise ArchError(f"arch.encoder.encoder_attention={list(self.encoder.encoder_attention)}: only decoder "
                            f"layers attend to encoder layers; leave it out of the encoder (or give 1 per layer)")

    @property
    def attended_layers(self) -> tuple[int, ...]:
        """Per decoder layer, how many encoder outputs its cross-attention reads: ``decoder.encoder_attention``
        clamped to the encoder's depth (HAT sec. 3.1; a choice above the depth attends to every encoder layer, as
        one equal to it does, so that the space can offer k independently of the sampled encoder depth)."""
        return tuple(min(k, self.encoder.layers) for k in self.decoder.encoder_attention)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready nested dict; inverse of :meth:`from_dict` (``model_width`` only when set)."""
        d = {"encoder": self.encoder.to_dict(), "decoder": self.decoder.to_dict()}
        if self.model_width is not None:
            d["model_width"] = self.model_width
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Arch":
        """Build from :meth:`to_dict` output. Raises ArchError naming a missing key."""
        try:
            return cls(encoder=StackArch(**d["encoder"]), decoder=StackArch(**d["decoder"]),
                       model_width=d.get("model_width"))
        except KeyError as e:
            raise ArchError(f"arch dict is missing key {e}; expected 'encoder' and 'decoder'") from e
        except TypeError as e:
            raise ArchError(f"arch dict has a bad stack: {e}; each stack needs width and ffn_width "
                             f"(branches and paths are optional)") from e

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Arch":
        return cls.from_dict(json.loads(text))

    @property
    def arch_id(self) -> str:
        """Stable 12-hex-digit hash of the architecture (same arch -> same id across runs)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:12]

    @classmethod
    def parse(cls, text: str) -> "Arch":
        """The arch a :meth:`summary` string describes (its exact inverse), or arch JSON (:meth:`from_json`,
        text starting with ``{``). Whitespace around the tokens is ignored.

        Example: ``Arch.parse("C64 enc[64/256 64/256x2] dec[64/512P3,15u2-swap-seq]")``.

        Args:
            text: ``[C<model_width>] enc[<layer> ...] dec[<layer> ...]``, one :meth:`StackArch.summary` token
                per layer, or the JSON of :meth:`to_json`.

        Raises:
            ArchError: malformed text or an impossible layer (one line quoting the bad token, with a valid
                string as example).
        """
        if not isinstance(text, str):
            raise ArchError(f"arch {text!r} is not a string; {_EXAMPLE}")
        text = text.strip()
        if text.startswith("{"):
            try:
                return cls.from_json(text)
            except json.JSONDecodeError as e:
                raise ArchError(f"arch JSON {text[:80]!r} is malformed: {e.msg} at character {e.pos}; "
                                f"expected Arch.to_json() output or a summary, {_EXAMPLE}") from None
            except (TypeError, ValueError) as e:  # ArchError (a missing key, a width < 1) or a width not a number
                raise ArchError(f"arch JSON {text[:80]!r}: {e}; expected Arch.to_json() output "
                                f"or a summary, {_EXAMPLE}") from None
        if not text:
            raise ArchError(f"arch '' is empty; {_EXAMPLE}")
        pos, model_width = 0, None
        if (m := _MODEL_WIDTH.match(text)) is not None:
            pos, model_width = m.end(), int(m.group(1))
            if model_width < 1:
                raise ArchError(f"arch {text!r}: model width 'C{m.group(1)}' must be >= 1; {_EXAMPLE}")
        stacks = []
        for name in ("enc", "dec"):
            if (m := _STACK[name].match(text, pos)) is None:
                raise ArchError(f"arch {text!r}: {_stack_problem(text[pos:], name)}; {_EXAMPLE}")
            stacks.append(_parse_stack(text, name, m.group(1)))
            pos = m.end()
        if text[pos:].strip():
            raise ArchError(f"arch {text!r}: unexpected {_first_token(text[pos:])!r} after 'dec[...]'; {_EXAMPLE}")
        return cls(stacks[0], stacks[1], model_width=model_width)

    def summary(self) -> str:
        """Readable one-liner, e.g. ``enc[128/512x2 64/256p2] dec[128/512]`` (``C64 enc[...]`` with a model width);
        :meth:`parse` reads it back."""
        prefix = "" if self.model_width is None else f"C{self.model_width} "
        return f"{prefix}enc[{self.encoder.summary()}] dec[{self.decoder.summary()}]"

    def check_within(self, maxima: "Arch") -> None:
        """Raise ArchError naming the first choice that exceeds ``maxima`` (the supernet's).

        Example message: ``arch.encoder.width[2]=512 exceeds the supernet's 256``.
        """
        for stack in ("encoder", "decoder"):
            sub, sup = getattr(self, stack), getattr(maxima, stack)
            if sub.layers > sup.layers:
                raise ArchError(f"arch.{stack} has {sub.layers} layers; the supernet has {sup.layers}")
            for name in INT_DIMENSIONS:
                for i, (v, vmax) in enumerate(zip(getattr(sub, name), getattr(sup, name))):
                    if v > vmax:
                        raise ArchError(f"arch.{stack}.{name}[{i}]={v} exceeds the supernet's {vmax}")
            for i, (d, m) in enumerate(zip(sub.layer_dims(), sup.layer_dims())):
                if d.layout not in m.layout.split("+"):
                    raise ArchError(f"arch.{stack}.layout[{i}]={d.layout!r} but the supernet's layer supports {m.layout!r}")
                if not set(d.kernels) <= set(m.kernels):
                    raise ArchError(f"arch.{stack}.kernels[{i}]={list(d.kernels)} not within the supernet's {list(m.kernels)}")
