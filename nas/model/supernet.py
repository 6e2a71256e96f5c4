"""The weight-sharing encoder-decoder supernet and ``extract``.

``SuperTransformer`` is a pre-norm Transformer (shared source/target/output embeddings,
sinusoidal positions) whose every layer is elastic. Its constructor takes the *maxima*
as an :class:`~nas.space.arch.Arch`; every call takes the sub-Transformer's arch
explicitly. A standalone model for an arch is a ``SuperTransformer`` whose maxima are that
arch, holding only the cropped weights (:func:`extract`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nas.model.kv_cache import LayerCache
from nas.model.layers import RELATIVE_LAYERS, DecoderLayer, EncoderLayer
from nas.model.ops import dropout as drop
from nas.model.ops import sinusoidal_positions
from nas.model.regularization import Regularization
from nas.space.arch import Arch, StackArch

__all__ = ["SuperTransformer", "extract", "count_params", "check_arch"]

_STEP_OUTPUT: "weakref.WeakKeyDictionary[SuperTransformer, tuple]" = weakref.WeakKeyDictionary()
"""Per model, the transposed tied embedding of :meth:`SuperTransformer.step_logits` and the key it was copied under
(outside the module: no copy travels with a pickled or deep-copied model)."""

CacheDict = dict[str, dict[str, torch.Tensor]]
"""One decoder layer's decoding state as plain tensors (:meth:`~nas.model.kv_cache.LayerCache.to_dict`)."""


class SuperTransformer(nn.Module):
    """Encoder-decoder supernet; ``logits = model(src, tgt_in, arch)``.

    Args:
        vocab_size: joint source/target vocabulary (tokens).
        model_dim: C, the widest model width (channels); a type-1 sub-Transformer (``arch.model_width``)
            crops every layer, layer norm and projection to its own C (Scalable Transformers sec. 3.2).
        heads: attention heads per branch of a ``model_dim``-wide attention (the head count of every width
            when ``head_dim`` is None).
        max_arch: the widest choice per layer; its layer counts are the supernet's depth.
        dropout: the configured residual/FFN/embedding dropout rate (:meth:`regularization`).
        attention_dropout: the configured dropout on attention probabilities (:meth:`regularization`).
        drop_branch: the configured MAT drop-branch rate rho (eq. 5-7) (:meth:`regularization`).
        max_positions: longest sequence (tokens) the position table covers.
        pad_id: padding token id (its embedding row starts at zero).
        more_features: Multi-Path "more features" (sec. 3.2, eq. 7) in sublayers with 3+ paths.
        unit_bias_rate: MUTE p_beta, the rate at which unit biases are switched on in training (sec. 3.2).
        io_projection: the input/output projections of Scalable Transformers eq. 3, ``E' = W'_e E + b'_e``
            (``W'_e [C, E]``, cropped to its first C rows) after the embedding and ``O' = W'_o O + b'_o``
            (``W'_o [E, C]``, first C columns) before the tied output layer, so the word embeddings keep
            ``embed_dim`` channels at every model width. Both start as the identity.
        embed_dim: E, the word-embedding width (channels); default ``model_dim``. Only an extracted
            type-1 sub-Transformer has ``embed_dim > model_dim``.
        head_dim: the fixed width of one attention head (channels): an attention width D has
            ``D / head_dim`` heads per branch, the widest's leading heads, each at temperature
            ``1/sqrt(head_dim)`` (Scalable Transformers sec. 4.1). None: the legacy fixed head count
            (``heads`` heads of ``D / heads`` channels at every width), for models saved before it existed.
        relative_positions: the clipping distance k of the encoder self-attention's relative position
            representations (Shaw et al. 2018, eq. 3-6), as MUTE's encoders use (sec. 4); 0: none (absolute
            sinusoids only, as models saved before it existed).
        relative_layers: which encoder layers have those tables (:class:`~nas.model.layers.EncoderLayer`):
            ``"units"``, only layers with MUTE units (built where the layer's max units > 1, used in calls with
            ``units > 1``); ``"all"``, every layer in every call (the format before the choice existed, and the
            default, so that older configs load unchanged; ``nas.builders`` builds new supernets with the
            sweep's ``supernet.relative_layers``, "units" by default).
        share_layouts: whether a ``sequential+prime`` layer's two layouts share their attention(s) and FFN
            (True, the format before the choice existed). False: the Prime layout (Unified Transformer eq. 4)
            runs its own ``prime_attn``/``prime_ffn`` (decoder: ``prime_self_attn``, ``prime_cross_attn``,
            ``prime_ffn``), a layer building only what its layouts run, so that :func:`extract` finds a Prime
            layer's tensors under the same names. Motivation: sharing weights between dissimilar sub-networks
            hurts how well the supernet ranks them; splitting the supernet into sub-supernets by an operation
            choice (Few-shot NAS, Zhao et al., ICML 2021) or giving sub-networks their own weights through
            architecture-routed experts (Mixture-of-Supernets, Jawahar et al., Findings of ACL 2024) raises
            the rank correlation between supernet and standalone scores. Adapted: here the split is by each
            layer's layout only, within one supernet (not by separate sub-supernets or learned routing).

    Raises:
        ValueError: a width not divisible by ``head_dim`` (or ``heads``); ``embed_dim != model_dim`` without
            ``io_projection``; ``relative_layers`` not ``"units"`` or ``"all"``.
    """

    def __init__(self, vocab_size: int, model_dim: int, heads: int, max_arch: Arch, *, dropout: float = 0.1,
                 attention_dropout: float = 0.0, drop_branch: float = 0.0, max_positions: int = 1024,
                 pad_id: int = 0, more_features: bool = False, unit_bias_rate: float = 0.0,
                 io_projection: bool = False, embed_dim: int | None = None, head_dim: int | None = None,
                 relative_positions: int = 0, relative_layers: str = "all", share_layouts: bool = True) -> None:
        super().__init__()
        if relative_layers not in RELATIVE_LAYERS:
            raise ValueError(f"relative_layers={relative_layers!r}: expected one of {RELATIVE_LAYERS}")
        self.vocab_size, self.model_dim, self.heads, self.max_arch = vocab_size, model_dim, heads, max_arch
        self.head_dim, self.relative_positions, self.relative_layers = head_dim, relative_positions, relative_layers
        self.share_layouts = share_layouts
        self.dropout_rate, self.attention_dropout, self.drop_branch = dropout, attention_dropout, drop_branch
        self.max_positions, self.pad_id, self.more_features = max_positions, pad_id, more_features
        self.unit_bias_rate, self.io_projection = unit_bias_rate, io_projection
        self.embed_dim = embed = embed_dim or model_dim
        if embed != model_dim and not io_projection:
            raise ValueError(f"embed_dim={embed} differs from model_dim={model_dim}; that needs io_projection=True")
        self.embed = nn.Embedding(vocab_size, embed, padding_idx=pad_id)
        nn.init.normal_(self.embed.weight, 0.0, embed ** -0.5)
        with torch.no_grad():
            self.embed.weight[pad_id].zero_()
        self.register_buffer("positions", sinusoidal_positions(max_positions, embed), persistent=False)
        if io_projection:  # Scalable Transformers eq. 3, identity at initialisation
            self.proj_in = nn.Linear(embed, model_dim)
            self.proj_out = nn.Linear(model_dim, embed)
            with torch.no_grad():
                for proj in (self.proj_in, self.proj_out):
                    proj.weight.copy_(torch.eye(*proj.weight.shape))
                    proj.bias.zero_()
        kw = dict(more_features=more_features, unit_bias_rate=unit_bias_rate, head_dim=head_dim,
                  share_layouts=share_layouts)
        layer = lambda d: dict(max_width=d.width, max_ffn_width=d.ffn_width, max_branches=d.branches,
                               max_paths=d.paths, layout=d.layout, kernel_sizes=d.kernels, max_units=d.units, **kw)
        self.encoder = nn.ModuleList(EncoderLayer(model_dim, heads, **layer(d), relative=relative_positions,
                                                  relative_layers=relative_layers)
                                     for d in max_arch.encoder.layer_dims())
        self.decoder = nn.ModuleList(DecoderLayer(model_dim, heads, **layer(d)) for d in max_arch.decoder.layer_dims())
        self.encoder_norm = nn.LayerNorm(model_dim)
        self.decoder_norm = nn.LayerNorm(model_dim)

    def config(self) -> dict[str, Any]:
        """Constructor arguments as JSON-ready dict (``SuperTransformer.from_config`` inverts it).

        A choice added after the first format is written only where it differs from what a config without it
        means: ``embed_dim``, ``head_dim``, ``relative_positions`` (then always with ``relative_layers``: an
        older config with relative positions and no ``relative_layers`` means "all") and ``share_layouts``
        (only when False)."""
        return dict(vocab_size=self.vocab_size, model_dim=self.model_dim, heads=self.heads,
                    max_arch=self.max_arch.to_dict(), dropout=self.dropout_rate,
                    attention_dropout=self.attention_dropout, drop_branch=self.drop_branch,
                    max_positions=self.max_positions, pad_id=self.pad_id, more_features=self.more_features,
                    unit_bias_rate=self.unit_bias_rate, io_projection=self.io_projection,
                    **({"embed_dim": self.embed_dim} if self.embed_dim != self.model_dim else {}),
                    **({"head_dim": self.head_dim} if self.head_dim is not None else {}),
                    **({"relative_positions": self.relative_positions, "relative_layers": self.relative_layers}
                       if self.relative_positions else {}),
                    **({"share_layouts": False} if not self.share_layouts else {}))

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "SuperTransformer":
        cfg = dict(config)
        cfg["max_arch"] = Arch.from_dict(cfg["max_arch"])
        return cls(**cfg)

    @functools.cached_property
    def full_arch(self) -> Arch:
        """The widest runnable sub-Transformer: the maxima, each layer in its first supported layout."""
        def runnable(stack: StackArch) -> StackArch:
            layouts = tuple(layout.split("+")[0] for layout in stack.layout)
            kernels = tuple(ks if layout == "prime" else () for ks, layout in zip(stack.kernels, layouts))
            paths = tuple(p if layout == "sequential" else 1 for p, layout in zip(stack.paths, layouts))
            return dataclasses.replace(stack, layout=layouts, kernels=kernels, paths=paths)
        return Arch(runnable(self.max_arch.encoder), runnable(self.max_arch.decoder))

    def regularization(self, **overrides: float) -> Regularization:
        """The model's configured regularisation (``dropout``, ``attention_dropout``, ``drop_branch`` of
        :meth:`config`), with ``overrides`` (e.g. this step's scheduled ``drop_branch``), to pass as ``reg``.

        Regularisation applies exactly when passed to a call, in either ``train()`` or ``eval()`` mode.
        """
        return Regularization(**{"dropout": self.dropout_rate, "attention_dropout": self.attention_dropout,
                                 "drop_branch": self.drop_branch, **overrides})

    def check_arch(self, arch: Arch | None) -> Arch:
        """``arch`` (the widest when None), validated against this model's maxima.

        Raises:
            ValueError: a choice beyond the maxima (names it), a width not divisible by ``head_dim``, or a
                ``model_width`` the model cannot run (wider, or without ``io_projection``).
        """
        if arch is None:
            return self.full_arch
        return check_arch(arch, self.max_arch, self.model_dim, self.head_dim or self.heads, self.io_projection,
                          fixed_dim=self.head_dim is not None)

    def width_of(self, arch: Arch) -> int:
        """The model width C (channels) of ``arch``'s layers: ``arch.model_width``, else ``model_dim``."""
        return arch.model_width or self.model_dim

    def embed_tokens(self, tokens: torch.Tensor, width: int, offset: int = 0, p: float = 0.0) -> torch.Tensor:
        """``tokens [b, t]`` ids -> ``[b, t, C]``: ``sqrt(E) * E[x] + PE[offset:offset+t]`` (Vaswani et al. 2017 sec. 3.4-3.5), projected to the
        model width ``C = width`` by ``W'_e[1:C]`` (eq. 3) with ``io_projection``, then dropout ``p``."""
        t = tokens.size(1)
        if offset + t > self.max_positions:
            raise ValueError(f"sequence of {offset + t} tokens exceeds max_positions={self.max_positions}")
        embed = self.embed  # F.embedding, not the module's __call__: a cached decoding step calls this once
        x = F.embedding(tokens, embed.weight, embed.padding_idx) * math.sqrt(self.embed_dim) + self.positions[offset:offset + t]
        if self.io_projection:
            x = F.linear(x, self.proj_in.weight[:width], self.proj_in.bias[:width])
        return drop(x, p)

    def _norm(self, norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        """A final layer norm cropped to the input's width ``[..., C]``."""
        c = x.size(-1)
        return F.layer_norm(x, (c,), norm.weight[:c], norm.bias[:c], norm.eps)

    def output_features(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., C]`` -> ``[..., E]``: final norm and ``W'_o[:, 1:C]`` (eq. 3), what the tied output layer
        (``self.embed.weight [V, E]``) multiplies."""
        h = self._norm(self.decoder_norm, x)
        if self.io_projection:
            h = F.linear(h, self.proj_out.weight[:, :h.size(-1)], self.proj_out.bias)
        return h

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., C]`` -> ``[..., V]``: :meth:`output_features` and the tied embedding."""
        return F.linear(self.output_features(x), self.embed.weight)

    def step_logits(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`output_logits` of a decoder step's rows, ``[n, C]`` -> ``[n, V]``, multiplied by a transposed copy of the
        tied embedding ``[E, V]`` kept in its own memory. MKL multiplies a few rows by a ``[E, V]`` matrix faster than
        by ``F.linear``'s transposed view of ``[V, E]``. On a 2-core Xeon with 1 thread, 4 rows (batch 1, beam 4) by
        a 6,000-token vocabulary take 106 us instead of 197 us, and one row takes the same time. With this, our
        batch-1, beam-4 decoding takes 2.36x CTranslate2 fp32's time instead of 2.62x (``benchmarks/bench_serving.py
        --base-repo``, ``docs/benchmarks.md``).

        The copy is kept outside the module, with the storage and version of the embedding it was made from, so a
        training step, ``load_state_dict`` or ``.to()`` leads to a new one, and no copy travels with a pickled or
        deep-copied model. The products are added in another order than in :meth:`output_logits`, so a logit may
        differ from it in its last bits (within 1e-5 in ``tests/model/test_step_logits.py``). Under ``torch.compile``
        or ``torch.export`` this is :meth:`output_logits`."""
        if torch.compiler.is_compiling():
            return self.output_logits(x)
        h = self.output_features(x)
        weight = self.embed.weight
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        kept = _STEP_OUTPUT.get(self)
        if kept is None or kept[0] != key:
            with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable outside inference mode
                kept = _STEP_OUTPUT[self] = (key, weight.detach().t().contiguous())  # [E, V]
        return torch.mm(h, kept[1])

    def encode(self, src: torch.Tensor, arch: Arch | None = None,
               reg: Regularization | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode ``src [b, s]`` -> (``memory [b, K*s, C]``, ``src_pad [b, s]`` bool, True at padding).

        ``memory`` is what the decoder's cross-attentions read: the last K encoder layers' outputs concatenated
        along the source length, K the most any decoder layer of ``arch`` attends to (:attr:`Arch.attended_layers`,
        HAT sec. 3.1). As HAT's code does (``transformer_super.py``, ``encoder_out_all``), the last layer's output
        comes first and has the final layer norm; the earlier layers' follow, newest first, as their layers output
        them (the pre-norm residual stream, no layer norm). With K = 1 (every decoder layer attends to the last
        encoder layer only) it is the normed last output ``[b, s, C]`` alone.

        ``reg``: this call's regularisation (None: none). Raises ValueError as :meth:`check_arch`."""
        arch = self.check_arch(arch)
        src_pad = src.eq(self.pad_id)
        x = self.embed_tokens(src, self.width_of(arch), p=0.0 if reg is None else reg.dropout)
        depth, sources = arch.encoder.layers, max(arch.attended_layers)
        earlier = []  # the raw outputs of layers depth-K+1 .. depth-1
        for i, (layer, dims) in enumerate(zip(self.encoder, arch.encoder.layer_dims())):
            x = layer(x, dims, src_pad, reg)
            if depth - sources <= i < depth - 1:
                earlier.append(x)
        memory = self._norm(self.encoder_norm, x)
        if earlier:
            memory = torch.cat([memory, *reversed(earlier)], 1)  # [b, K*s, C]: layer L (normed), L-1, ..., L-K+1
        return memory, src_pad

    @staticmethod
    def cross_sources(memory: torch.Tensor, src_pad: torch.Tensor | None,
                      arch: Arch) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each decoder layer's cross-attention input: ``(memory[:, :k*s], src_pad repeated k times [b, k*s])``,
        k its :attr:`Arch.attended_layers` (HAT's ``encoder_padding_mask`` concatenated k times). ``memory
        [b, K*s, C]`` and ``src_pad [b, s]`` (or None: no padding) are :meth:`encode`'s for the same arch; with
        K = 1 every layer gets them as they are.

        Raises:
            ValueError: ``memory``'s length is not K times the source length (encoded for another arch).
        """
        ks = arch.attended_layers
        most = max(ks)
        s = memory.size(1) // most if src_pad is None else src_pad.size(1)
        if memory.size(1) != most * s:
            raise ValueError(f"memory has {memory.size(1)} positions, not {most} encoder outputs of {s} as the arch's "
                             f"encoder_attention {list(ks)} needs; pass the memory encode() gives for the same arch")
        if most == 1:
            return [(memory, src_pad)] * len(ks)
        per_k = {k: (memory[:, :k * s], None if src_pad is None else src_pad.repeat(1, k)) for k in set(ks)}
        return [per_k[k] for k in ks]

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, src_pad: torch.Tensor,
               arch: Arch | None = None, reg: Regularization | None = None, *, features: bool = False) -> torch.Tensor:
        """Teacher-forced decoding: ``tgt_in [b, t]``, :meth:`encode`'s ``memory [b, K*s, C]`` and ``src_pad
        [b, s]`` -> logits ``[b, t, V]`` (``features``: :meth:`output_features` ``[b, t, E]`` instead, for
        :func:`nas.model.losses.linear_label_smoothed_nll` with ``self.embed.weight``); ``reg`` as in
        :meth:`encode`."""
        arch = self.check_arch(arch)
        x = self.embed_tokens(tgt_in, self.width_of(arch), p=0.0 if reg is None else reg.dropout)
        sources = self.cross_sources(memory, src_pad, arch)
        for layer, dims, (mem, pad) in zip(self.decoder, arch.decoder.layer_dims(), sources):
            x = layer(x, mem, dims, pad, reg)
        return self.output_features(x) if features else self.output_logits(x)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, arch: Arch | None = None,
                reg: Regularization | None = None, *, features: bool = False) -> torch.Tensor:
        """``src [b, s]``, ``tgt_in [b, t]`` -> logits ``[b, t, V]`` of the sub-Transformer ``arch``
        (the widest when None), with the regularisation ``reg`` (None: none; in training pass
        ``model.regularization(...)``); ``features``: what the tied output layer multiplies, ``[b, t, E]``
        (:meth:`output_features`; a flag of ``forward``, not another method, so that a data-parallel wrapper's
        ``forward`` runs). Raises ValueError naming a choice beyond the supernet's maxima."""
        memory, src_pad = self.encode(src, arch, reg)
        return self.decode(tgt_in, memory, src_pad, arch, reg, features=features)

    def decode_step(self, tokens: torch.Tensor, step: int, memory: torch.Tensor, src_pad: torch.Tensor,
                    arch: Arch | None, cache: list[CacheDict], features: bool = False) -> torch.Tensor:
        """One incremental decoding step with a key/value cache held in plain dicts.

        The interface of the ONNX export (each step's state in, the grown state out: keys and
        values are concatenated). It runs ``DecoderLayer.forward`` with a
        :class:`~nas.model.kv_cache.LayerCache` built from the dicts, as
        :class:`nas.model.decode.IncrementalDecoder` does (which keeps the state and the cropped
        weights between steps, with preallocated keys and values) for :func:`~nas.model.decode.beam_search`.

        Args:
            tokens: the newest target token per row ``[n, 1]`` (position ``step``).
            memory, src_pad: from :meth:`encode`, ``[n, K*s, C]`` and ``[n, s]``.
            cache: one dict per decoder layer (start with ``[{} for _ in range(layers)]``),
                updated in place with self-attention keys/values and the cross-attention's
                projected memory.
            features: return :meth:`output_features` ``[n, E]`` instead of the logits (the caller multiplies
                them by the tied embedding in its own layout: ``nas.export.aot``).
        Returns:
            logits of the next token ``[n, V]``.
        """
        arch = self.check_arch(arch)
        x = self.embed_tokens(tokens, self.width_of(arch), offset=step)
        sources = self.cross_sources(memory, src_pad, arch)
        for layer, dims, parts, (mem, pad) in zip(self.decoder, arch.decoder.layer_dims(), cache, sources):
            state = LayerCache.from_dict(parts)
            x = layer(x, mem, dims, pad, cache=state)
            parts.clear()
            parts.update(state.to_dict())
        return self.output_features(x[:, -1]) if features else self.output_logits(x[:, -1])

    @staticmethod
    def reorder_cache(cache: list[CacheDict], index: torch.Tensor, parts: tuple[str, ...]) -> None:
        """Select rows ``index [n']`` of the cached ``parts`` in place.

        Beam search reorders the per-hypothesis state ("self" attention keys/values and the
        "conv" window) every step, and "cross" (equal across the beams of a sentence) only
        when finished sentences leave the batch. Every cached tensor has the batch at dim 1.
        """
        for layer in cache:
            for part in parts:
                tensors = layer.get(part, {})
                for key in tensors:
                    tensors[key] = tensors[key].index_select(1, index)

    def autoshuffle_penalty(self) -> torch.Tensor:
        """Sum of the MUTE permutation penalties (eq. 19) of every layer with units (0 without)."""
        terms = [p for layer in (*self.encoder, *self.decoder) if (p := layer.autoshuffle_penalty()) is not None]
        return torch.stack(terms).sum() if terms else torch.zeros(())

    def renormalize_autoshuffle_(self) -> None:
        """Apply MUTE eq. 17-18 to every AutoShuffle matrix; call after each optimizer step."""
        for layer in (*self.encoder, *self.decoder):
            layer.renormalize_autoshuffle_()


def count_params(model: nn.Module) -> int:
    """Number of parameters (the tied embedding counted once)."""
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def extract(supernet: SuperTransformer, arch: Arch) -> SuperTransformer:
    """A standalone model holding only the weights of ``arch``, cropped from ``supernet``.

    Every tensor of the standalone model is the leading (top-left) block of the supernet
    tensor of the same name: the first layers, branches and channels (Scalable
    Transformers sec. 3.1; MAT branches as a prefix). Its outputs equal
    ``supernet(src, tgt, arch)``. Each layer holds only what its layout runs: with
    ``share_layouts=False`` a Prime layer's ``prime_*`` modules, and under
    ``relative_layers="units"`` relative position tables only where the layer has units > 1.

    Raises:
        ValueError: ``arch`` exceeds the supernet's maxima (names the choice).
    """
    supernet.check_arch(arch)
    cfg = supernet.config()
    cfg["max_arch"] = dataclasses.replace(arch, model_width=None).to_dict()
    cfg["model_dim"] = supernet.width_of(arch)  # type 1: the layers' width; the embeddings keep embed_dim
    if supernet.io_projection:
        cfg["embed_dim"] = supernet.embed_dim
    sub = SuperTransformer.from_config(cfg)
    source = supernet.state_dict()
    cropped = {}
    for name, target in sub.state_dict().items():
        full = source[name]
        cropped[name] = full[tuple(slice(0, n) for n in target.shape)].clone()
    sub.load_state_dict(cropped)
    return sub.train(supernet.training)


@functools.lru_cache(maxsize=1024)
def check_arch(arch: Arch, max_arch: Arch, model_dim: int, heads: int, io_projection: bool,
               fixed_dim: bool = False) -> Arch:
    """``arch`` if a model with these maxima can run it (a pure function, its answers cached: archs are frozen).

    Args:
        arch: the sub-Transformer; max_arch: the model's maxima; model_dim: its widest C (channels);
        heads: the head width (``fixed_dim``) or the head count every width must be divisible by;
        io_projection: whether it has Scalable Transformers eq. 3's projections.
    Raises:
        ValueError: a choice beyond ``max_arch`` (names it), a width not divisible by ``heads``, or a
            ``model_width`` wider than ``model_dim`` or without ``io_projection``.
    """
    arch.check_within(max_arch)
    if arch.model_width is not None and arch.model_width != model_dim:
        if arch.model_width > model_dim:
            raise ValueError(f"arch.model_width={arch.model_width} exceeds the supernet's model_dim={model_dim}")
        if not io_projection:
            raise ValueError(f"arch.model_width={arch.model_width} needs a supernet with the input/output "
                             f"projections of Scalable Transformers eq. 3: set supernet.io_projection: true")
    for stack in (arch.encoder, arch.decoder):
        for i, w in enumerate(stack.width):
            if w % heads:
                what = f"the head width head_dim={heads}" if fixed_dim else f"heads={heads}"
                raise ValueError(f"arch width[{i}]={w} is not divisible by {what}")
    return arch
