"""The parameter count of a sub-Transformer, computed from its :class:`Arch` without torch.

:func:`arch_params` counts what :func:`nas.model.supernet.extract` builds for an arch: the standalone
``SuperTransformer`` whose maxima are that arch (``count_params(extract(supernet, arch))``), from the arch and
the supernet's fixed sizes (:class:`ModelSizes`). The spec layer uses it where it must compare archs by size
without building a model (:meth:`nas.space.SearchSpace.middle`); ``tests/space/test_params.py`` checks it
against the real model.

The word embedding (``vocab_size x embed_dim``, tied with the output layer) is the same in every
sub-Transformer of a supernet; with ``vocab_size=0`` (the default, as the spec layer does not know the
tokenizer's final vocabulary) it is left out, so counts differ from the model's by that constant and compare
the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from nas.space.arch import Arch, LayerArch

if TYPE_CHECKING:
    from nas.space.schema import SweepSpec

__all__ = ["ModelSizes", "arch_params", "relative_positions", "RELATIVE_DEFAULT"]

RELATIVE_DEFAULT = 16
"""Shaw et al.'s clipping distance k used when the supernet has MUTE units and ``supernet.relative_positions``
is not set (their ablation finds no gain beyond k >= 2; 16 covers most of a Multi30k sentence)."""


def relative_positions(spec: "SweepSpec", maxima: Arch) -> int:
    """``supernet.relative_positions``, else :data:`RELATIVE_DEFAULT` when an encoder layer has MUTE units, else 0."""
    if spec.supernet.relative_positions is not None:
        return spec.supernet.relative_positions
    return RELATIVE_DEFAULT if max(maxima.encoder.units) > 1 else 0


@dataclass(frozen=True)
class ModelSizes:
    """The supernet's fixed sizes that a sub-Transformer's parameter count depends on besides its arch
    (the constructor arguments of ``SuperTransformer`` of the same names)."""

    model_dim: int
    """C, the supernet's model width (channels); a type-1 arch's ``model_width`` replaces it in the layers."""
    heads: int
    """Heads per branch when ``head_dim`` is None (sets the relative positions' head width)."""
    head_dim: int | None = None
    """The fixed head width (channels), or None: ``width / heads``."""
    io_projection: bool = False
    """Scalable Transformers eq. 3's input/output projections."""
    relative_positions: int = 0
    """Shaw et al.'s clipping distance k of the encoder self-attention (0: none)."""
    relative_layers: str = "all"
    """Which encoder layers hold the relative tables: ``"units"``, those with units > 1; ``"all"``, every one
    (the format before the choice existed: what a config without the key means)."""
    share_layouts: bool = True
    """Whether the layouts of a ``sequential+prime`` layer share their attention(s) and FFN (False: counted
    once per layout; only a supernet's maxima have such layers, an extracted model's have one layout)."""
    more_features: bool = False
    """Multi-Path "more features" in sublayers with 3+ paths."""
    embed_dim: int | None = None
    """E, the word-embedding width (channels); default ``model_dim``."""
    vocab_size: int = 0
    """Tokens of the tied word embedding; 0 leaves the embedding (the same in every arch) out of the count."""

    @classmethod
    def from_spec(cls, spec: "SweepSpec", maxima: Arch) -> "ModelSizes":
        """The sizes of the supernet ``nas.builders.build_supernet(spec, vocab)`` builds (``maxima``: its
        :meth:`~nas.space.SearchSpace.supernet_maxima`), without the word embedding (``vocab_size=0``)."""
        sn = spec.supernet
        return cls(model_dim=sn.model_dim, heads=sn.heads, head_dim=sn.head_width, io_projection=spec.io_projection,
                   relative_positions=relative_positions(spec, maxima), relative_layers=sn.relative_layers,
                   share_layouts=sn.share_layouts, more_features=sn.more_features)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], with_embedding: bool = False) -> "ModelSizes":
        """The sizes of a model's ``SuperTransformer.config()``; ``with_embedding``: count its word embedding.
        A key the config lacks means what it meant before it existed (``relative_layers`` "all",
        ``share_layouts`` True)."""
        return cls(model_dim=config["model_dim"], heads=config["heads"], head_dim=config.get("head_dim"),
                   io_projection=bool(config.get("io_projection", False)),
                   relative_positions=config.get("relative_positions", 0),
                   relative_layers=config.get("relative_layers", "all"),
                   share_layouts=bool(config.get("share_layouts", True)),
                   more_features=bool(config.get("more_features", False)), embed_dim=config.get("embed_dim"),
                   vocab_size=config["vocab_size"] if with_embedding else 0)


def arch_params(arch: Arch, sizes: ModelSizes) -> int:
    """Parameters of ``arch``'s standalone model (``count_params(extract(supernet, arch))`` for a supernet of
    ``sizes``), the word embedding counted only when ``sizes.vocab_size`` > 0.

    Per layer of U units, P paths, B branches, attention width D, FFN width F on C channels: each attention
    ``U P B (4 D C + 3 D + C)`` (MAT eq. 4), the FFN ``U P (2 F C + F + C)``; a sequential layer's path
    fusions (Multi-Path eq. 5-7: per-path LN, PathNorm and weights), a Prime layer's per-unit LN and
    dynamic convolution (Unified Transformer eq. 4-7), MUTE's unit weights, AutoShuffle matrix and mask
    embedding, and the encoder's relative position tables (Shaw et al. eq. 5-6; under ``relative_layers="units"``
    only in layers with U > 1); then the final layer norms and the eq. 3 projections (Scalable Transformers).
    A layer of both layouts (``sequential+prime``: a supernet's maxima, ``count_params(supernet)``) counts
    both layouts' parts, and its attention(s) and FFN once per layout without ``share_layouts``.
    """
    c = arch.model_width or sizes.model_dim
    e = sizes.embed_dim or sizes.model_dim
    total = sizes.vocab_size * e + 2 * 2 * c  # tied word embedding; encoder_norm and decoder_norm
    if sizes.io_projection:
        total += (e * c + c) + (c * e + e)  # proj_in [C, E] + [C], proj_out [E, C] + [E]
    total += sum(_layer(d, c, sizes, attentions=1) for d in arch.encoder.layer_dims())
    total += sum(_layer(d, c, sizes, attentions=2) for d in arch.decoder.layer_dims())
    return total


def _layer(d: LayerArch, c: int, sizes: ModelSizes, attentions: int) -> int:
    """One layer (``nas.model.layers``) of ``attentions`` attention sublayers (encoder 1, decoder 2) on C channels."""
    u, p, b, w, f = d.units, d.paths, d.branches, d.width, d.ffn_width
    layouts = d.layout.split("+")
    total = attentions * u * p * b * (3 * w * c + 3 * w + c * w + c)  # w_in, b_in, w_out, b_out
    if attentions == 1 and sizes.relative_positions and (sizes.relative_layers == "all" or u > 1):
        head = sizes.head_dim or w // sizes.heads  # the encoder's self-attention: rel_k, rel_v [U, 2k+1, d_h]
        total += 2 * u * (2 * sizes.relative_positions + 1) * head
    total += u * p * (2 * f * c + f + c)  # FFN w1, b1, w2, b2
    if not sizes.share_layouts:  # each layout its own attention(s) and FFN
        total *= len(layouts)
    if "sequential" in layouts:
        total += (attentions + 1) * _path_fusion(u, p, c, sizes.more_features)
    if "prime" in layouts:  # per-unit LN, then the dynamic convolution when it has kernels
        total += 2 * u * c
        if d.kernels:
            total += sum(u * k * c + u * k + u for k in d.kernels)  # kernel generators and gates
            total += u * c * w + u * c  # output projection
    if u > 1:
        total += u + u * u + c  # unit_alpha, the AutoShuffle matrix, mask_embedding
    return total


def _path_fusion(u: int, p: int, c: int, more_features: bool) -> int:
    """One sublayer's ``PathFusion``: per-path LN, and with several paths PathNorms, alpha and beta."""
    total = 2 * u * p * c
    if p > 1:
        total += 2 * u * p * c + u * p + u
    if more_features and p >= 3:
        total += 2 * u * p * c + u * p
    return total
