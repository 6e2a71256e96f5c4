"""Encoder and decoder layers of the supernet: the unified layer of DESIGN.md, one implementation.

``Layer(x) = combine_u Unit_u(Bias_u(x))`` over MUTE units (:mod:`nas.model.units`), each unit
sequential (multi-path sublayers, :mod:`nas.model.paths`, around multi-branch attention,
:mod:`nas.model.attention`, and the FFN, :mod:`nas.model.ffn`) or Prime (attention, dynamic
convolution, :mod:`nas.model.conv`, and FFN in parallel). The decoder layer runs the same code
over a whole target and over one new position with a :class:`~nas.model.kv_cache.LayerCache`
(incremental decoding, also the exported ONNX decoder step).

With ``share_layouts=False`` a ``sequential+prime`` layer's Prime layout runs its own attention(s) and FFN
(``prime_*``); the encoder's relative positions (Shaw et al. 2018) are in every layer or only in layers that
run MUTE units (``relative_layers``).

Regularisation (dropout, attention dropout, drop-branch) is an argument of every call
(:class:`~nas.model.regularization.Regularization`, None = none).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nas.model.attention import MultiBranchAttention
from nas.model.conv import DynamicConv
from nas.model.ffn import ElasticFFN, path_ffn
from nas.model.kv_cache import LayerCache
from nas.model.ops import drop_mask, memoized
from nas.model.ops import dropout as drop
from nas.model.paths import PathFusion
from nas.model.regularization import Regularization
from nas.model.units import (apply_unit_bias, combine_units, doubly_normalize, permutation_penalty, unit_bias_kinds,
                             unit_weights)
from nas.space.arch import LayerArch

__all__ = ["EncoderLayer", "DecoderLayer", "RELATIVE_LAYERS"]

RELATIVE_LAYERS = ("units", "all")
"""Where an encoder has relative position tables (:class:`EncoderLayer`): layers with MUTE units, or every layer."""

_NONE = Regularization()


def _cut(scale: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    return None if scale is None else scale[..., start:stop]


def _keep(scale: torch.Tensor | None, column: int) -> torch.Tensor | None:
    return None if scale is None else scale[..., column]


def _drop_branch(rho: float, units: int, paths: int, bsz: int, branches: int, attentions: int,
                 device: torch.device) -> tuple[tuple, tuple]:
    """Drop-branch keep masks (MAT eq. 5 and 7) of one layer call with ``attentions`` attention sublayers.

    Returns ``(branch_scales, keeps)``: ``branch_scales[i] [G, b, B]`` drops the branches of attention
    ``i`` inside it (MAT eq. 5) and ``keeps[i] [G, b]`` drops sublayer ``i``'s whole output where
    :meth:`PathFusion.fuse` adds it (the FFN last, eq. 7); G = ``units * paths``, one draw per sentence.
    With several paths an attention is dropped as a whole per path, after its PathNorm, as the FFN is:
    inside PathNorm the ``1/(1 - rho)`` rescale would cancel and a dropped path would still add
    ``alpha * PathNorm``'s bias, so training's expectation would not be evaluation's. (MAT has no
    PathNorm and Multi-Path no drop-branch; this keeps eq. 5's expectation. Branches inside a path
    are then not dropped one by one.) Entries are None where nothing is dropped (``rho == 0``).
    """
    if paths == 1:
        scale = drop_mask((units, bsz, attentions * branches + 1), rho, device)  # branches..., FFN
        return (tuple(_cut(scale, i * branches, (i + 1) * branches) for i in range(attentions)),
                (*(None,) * attentions, _keep(scale, attentions * branches)))
    scale = drop_mask((units * paths, bsz, attentions + 1), rho, device)  # attentions..., FFN
    return (None,) * attentions, tuple(_keep(scale, i) for i in range(attentions + 1))


class _UnifiedLayer(nn.Module):
    """What encoder and decoder layers share: attention(s), FFN, path fusions, Prime parts and
    the MUTE units around them (DESIGN "The unified layer"):
    ``Layer(x) = combine_u Unit_u(Bias_u(x))`` where a unit is a sequential or a Prime layer.

    ``share_layouts``: whether the two layouts of a ``sequential+prime`` layer run the same attention(s)
    and FFN (True, the format before the option existed) or each its own (False: the Prime layout runs
    ``prime_<name>``, :meth:`module`). A layer builds only the modules its layouts run.
    """

    def __init__(self, model_dim: int, heads: int, max_width: int, max_ffn_width: int, max_branches: int,
                 max_paths: int, more_features: bool, layout: str, kernel_sizes: tuple[int, ...], max_units: int,
                 unit_bias_rate: float, sublayers: tuple[str, ...], causal: bool, head_dim: int | None = None,
                 relative: int = 0, share_layouts: bool = True) -> None:
        super().__init__()
        self.layouts = tuple(layout.split("+"))
        self.unit_bias_rate, self.share_layouts = unit_bias_rate, share_layouts
        sets = [""] if share_layouts else [prefix for prefix, name in (("", "sequential"), ("prime_", "prime"))
                                           if name in self.layouts]
        for prefix in sets:  # "": the sequential (or shared) modules; "prime_": the Prime layout's own
            for name in sublayers:  # relative positions in self-attention only (the first sublayer)
                self.add_module(prefix + name, MultiBranchAttention(
                    model_dim, max_width, max_branches, heads, max_paths, max_units, head_dim,
                    relative if name == sublayers[0] else 0))
            self.add_module(prefix + "ffn", ElasticFFN(model_dim, max_ffn_width, max_paths, max_units))
        if "sequential" in self.layouts:
            for name in (*sublayers, "ffn"):
                self.add_module(f"{name}_paths", PathFusion(model_dim, max_paths, more_features, max_units))
        if "prime" in self.layouts:
            self.prime_norm_weight = nn.Parameter(torch.ones(max_units, model_dim))
            self.prime_norm_bias = nn.Parameter(torch.zeros(max_units, model_dim))
            if kernel_sizes:
                self.conv = DynamicConv(model_dim, max_width, tuple(kernel_sizes), causal, max_units)
        if max_units > 1:
            self.unit_alpha = nn.Parameter(torch.ones(max_units))  # eq. 10 weights
            self.shuffle = nn.Parameter(0.9 * torch.eye(max_units) + 0.1 / max_units)  # AutoShuffle M (eq. 16)
            self.mask_embedding = nn.Parameter(torch.randn(model_dim) * model_dim ** -0.5)

    def module(self, name: str, layout: str) -> nn.Module:
        """The attention or FFN ``name`` (``attn``, ``self_attn``, ``cross_attn``, ``ffn``) that ``layout`` runs:
        ``prime_<name>`` for ``prime`` when the layer does not share its modules between layouts, else ``name``.

        Raises:
            AttributeError: the layer does not build it (``layout`` is not one of its layouts).
        """
        return getattr(self, f"prime_{name}" if layout == "prime" and not self.share_layouts else name)

    def check_layout(self, dims: LayerArch) -> None:
        """Raise ValueError unless ``dims.layout`` is built in this layer."""
        if dims.layout not in self.layouts:
            raise ValueError(f"layout {dims.layout!r} is not built in this layer (it has {'+'.join(self.layouts)})")

    def _unit_inputs(self, x: torch.Tensor, dims: LayerArch, lengths: torch.Tensor | None) -> torch.Tensor:
        """``x [b, t, C]`` -> per-unit inputs ``[U, b, t, C]``: ``Bias_u(x)`` in training with rate p_beta (sec. 3.2)."""
        if dims.units == 1:
            return x[None]
        if not (self.training and lengths is not None and self.unit_bias_rate > 0 and dims.unit_bias != "identity"):
            return x[None].expand(dims.units, -1, -1, -1)
        switch = torch.rand(x.size(0), device=x.device) < self.unit_bias_rate
        return torch.stack([apply_unit_bias(x, kind, lengths, self.mask_embedding[:x.size(-1)], switch)
                            for kind in unit_bias_kinds(dims.unit_bias, dims.units)])

    def _combine(self, outs: torch.Tensor, dims: LayerArch, memo: dict | None = None) -> torch.Tensor:
        """Units' outputs ``[U, b, t, C]`` -> ``[b, t, C]`` (:func:`~nas.model.units.combine_units`; the
        weights kept in ``memo`` when decoding incrementally)."""
        if dims.units == 1:
            return outs[0]
        weights = None if memo is None else memo.get("units")
        if weights is None:
            weights = unit_weights(self.unit_alpha, self.shuffle, dims.units, dims.unit_dependency)
            if memo is not None:
                memo["units"] = weights
        return combine_units(outs, *weights)

    def _prime_norm(self, total: torch.Tensor, memo: dict | None = None) -> torch.Tensor:
        """Per-unit LayerNorm of ``[U, b, t, C]`` (the "Add & Norm" of Unified Transformer eq. 4)."""
        units, c = total.size(0), total.size(-1)
        w, b = memoized(memo, "prime_norm", self._prime_affine, units, c)
        return F.layer_norm(total, (c,)) * w + b

    def _prime_affine(self, units: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.prime_norm_weight[:units, None, None, :c], self.prime_norm_bias[:units, None, None, :c]

    def _prime_ffn(self, ffn: Callable[..., torch.Tensor], total: torch.Tensor, xu: torch.Tensor, dims: LayerArch,
                   keep: torch.Tensor | None, p: float, memo: dict | None = None) -> torch.Tensor:
        """``total + dropout(FFN(x_u))`` with the Prime layout's ``ffn`` (module, or its bare ``forward`` in
        incremental decoding), the FFN dropped per sentence with ``keep [U, b]`` (MAT eq. 7)."""
        y = drop(ffn(xu, dims.ffn_width, dims.units, p, memo), p)
        return total + (y if keep is None else y * keep[:, :, None, None].to(y.dtype))

    def autoshuffle_penalty(self) -> torch.Tensor | None:
        """MUTE eq. 19 for this layer's AutoShuffle matrix (None without units)."""
        return permutation_penalty(self.shuffle) if hasattr(self, "shuffle") else None

    @torch.no_grad()
    def renormalize_autoshuffle_(self) -> None:
        """Project the AutoShuffle matrix back after an optimizer step (MUTE eq. 17-18)."""
        if hasattr(self, "shuffle"):
            self.shuffle.copy_(doubly_normalize(self.shuffle))


class EncoderLayer(_UnifiedLayer):
    """Encoder layer: ``combine_u Unit_u(Bias_u(x))`` over U MUTE units, each unit in one of two layouts.

    - ``sequential``: pre-norm self-attention then FFN, each sublayer
      ``beta x + sum_p alpha_p PathNorm_p(Func(LN_p(x)))`` (Multi-Path eq. 4-6), where Func is
      the branch-averaged attention (MAT eq. 6) or the FFN with drop-branch (MAT eq. 7). With
      one unit, one path, one branch, full widths and no regularisation it is exactly
      ``torch.nn.TransformerEncoderLayer(norm_first=True)`` (ReLU, LayerNorm eps 1e-5).
    - ``prime``: ``LN(x + Attn(x) + Conv_K(x) + FFN(x))`` (Unified Transformer eq. 4), the
      convolution sharing the attention's value projection; Prime-simple (eq. 1) when K is empty.
    - units (MUTE): per-unit input noise in training mode (sec. 3.2), combined by eq. 10 or with
      sequential dependency (eq. 13-16).
    - ``relative > 0``: the self-attention adds relative position representations (Shaw et al. 2018,
      eq. 3-6; :class:`~nas.model.attention.MultiBranchAttention`), as MUTE's encoders do (sec. 4), so
      that a unit's swap or disorder bias changes what it computes, not only the order of its output rows.
      Where (``relative_layers``): ``"all"``, in every call of the layer; ``"units"``, only where it runs
      MUTE units, the reason MUTE has them: the layer builds the tables only when ``max_units > 1`` and
      uses them only in calls with ``dims.units > 1`` (a one-unit call is the plain absolute-position layer).
      Adapted for a supernet: in MUTE every encoder layer has units (and relative positions); here a
      sub-Transformer's one-unit layer, with no unit bias to make visible, stays a plain Transformer layer.

    Args:
        layout: the layouts this layer supports: ``sequential``, ``prime`` or ``sequential+prime``.
        kernel_sizes: convolution kernel sizes it supports (Prime).
        max_units: the most MUTE units; unit_bias_rate: p_beta, the rate biases are switched on.
        relative: Shaw et al.'s clipping distance k (positions); 0: absolute positions only.
        relative_layers: ``"units"`` or ``"all"`` (above; "all" is the format before the choice existed).
        share_layouts: False: the Prime layout runs its own ``prime_attn`` and ``prime_ffn`` (its convolution
            the values of ``prime_attn``), the sequential layout ``attn`` and ``ffn``; True: both run ``attn``
            and ``ffn``. See :class:`~nas.model.supernet.SuperTransformer`.

    Raises:
        ValueError: ``relative_layers`` is neither ``"units"`` nor ``"all"``.
    """

    def __init__(self, model_dim: int, heads: int, max_width: int, max_ffn_width: int, max_branches: int,
                 max_paths: int = 1, more_features: bool = False, layout: str = "sequential",
                 kernel_sizes: tuple[int, ...] = (), max_units: int = 1, unit_bias_rate: float = 0.0,
                 head_dim: int | None = None, relative: int = 0, relative_layers: str = "all",
                 share_layouts: bool = True) -> None:
        if relative_layers not in RELATIVE_LAYERS:
            raise ValueError(f"relative_layers={relative_layers!r}: expected one of {RELATIVE_LAYERS}")
        built = relative if relative_layers == "all" or max_units > 1 else 0
        super().__init__(model_dim, heads, max_width, max_ffn_width, max_branches, max_paths, more_features, layout,
                         kernel_sizes, max_units, unit_bias_rate, ("attn",), causal=False, head_dim=head_dim,
                         relative=built, share_layouts=share_layouts)
        self.relative_layers = relative_layers

    def uses_relative(self, dims: LayerArch) -> bool:
        """Whether a call with ``dims`` adds the relative position tables (when the layer has them):
        always under ``relative_layers="all"``, with ``dims.units > 1`` under ``"units"``."""
        return self.relative_layers == "all" or dims.units > 1

    def forward(self, x: torch.Tensor, dims: LayerArch, src_pad: torch.Tensor | None,
                reg: Regularization | None = None) -> torch.Tensor:
        """``x [b, s, C]``, the layer's choices ``dims``, ``src_pad [b, s]`` -> ``[b, s, C]``; ``reg``: dropout,
        attention dropout and drop-branch of this call (None: none).

        Raises:
            ValueError: ``dims.layout`` is not built in this layer.
        """
        self.check_layout(dims)
        reg = reg or _NONE
        p, units, nb = reg.dropout, dims.units, dims.branches
        n_paths = dims.paths if dims.layout == "sequential" else 1
        lengths = None if src_pad is None else (~src_pad).sum(1)
        xu = self._unit_inputs(x, dims, lengths)  # [U, b, s, C]
        branch_scale, keeps = _drop_branch(reg.drop_branch, units, n_paths, x.size(0), nb, 1, x.device)
        attn = dict(width=dims.width, branches=nb, key_pad=src_pad, branch_scale=branch_scale[0], units=units,
                    dropout=reg.attention_dropout, relative=self.uses_relative(dims))
        if dims.layout == "prime":
            values: list = []
            total = xu + drop(self.module("attn", "prime")(xu, values=values, **attn), p)
            if dims.kernels:  # the convolution on the Prime attention's values (Shared Projection)
                total = total + drop(self.conv(xu, values[0], dims.kernels, src_pad), p)
            total = self._prime_ffn(self.module("ffn", "prime"), total, xu, dims, keeps[-1], p)
            return self._combine(self._prime_norm(total), dims)
        xu = self.attn_paths.fuse(xu, drop(self.attn(self.attn_paths.paths_in(xu, n_paths), **attn), p), keeps[0])
        ys = drop(path_ffn(self.ffn_paths, self.ffn, xu, dims.ffn_width, n_paths, p), p)
        return self._combine(self.ffn_paths.fuse(xu, ys, keeps[-1]), dims)


class DecoderLayer(_UnifiedLayer):
    """Decoder layer: ``combine_u Unit_u(x)`` over U MUTE units, each unit in one of two layouts.

    - ``sequential``: causal self-attention, cross-attention and FFN, each a multi-path
      sublayer (Multi-Path eq. 4-6) with multi-branch attention (MAT eq. 6-7); the
      cross-attention uses the same width, branches and paths as the self-attention. With one
      unit, path and branch, full widths and no regularisation it equals
      ``torch.nn.TransformerDecoderLayer(norm_first=True)``.
    - ``prime``: ``LN(x + SelfAttn(x) + Cross(x, memory) + CausalConv_K(x) + FFN(x))``
      (Unified Transformer eq. 4 with the decoder's cross-attention in parallel, Fig. 1).
    - units: combined as in the encoder. Decoder units get no input noise: swapping or
      reordering target positions would show a unit the tokens it must predict.
    - ``share_layouts=False``: the Prime layout runs its own ``prime_self_attn``, ``prime_cross_attn`` and
      ``prime_ffn`` (its causal convolution the values of ``prime_self_attn``); see the encoder layer.

    Full decoding and incremental decoding (``cache``) run this same code.
    """

    def __init__(self, model_dim: int, heads: int, max_width: int, max_ffn_width: int, max_branches: int,
                 max_paths: int = 1, more_features: bool = False, layout: str = "sequential",
                 kernel_sizes: tuple[int, ...] = (), max_units: int = 1, unit_bias_rate: float = 0.0,
                 head_dim: int | None = None, share_layouts: bool = True) -> None:
        super().__init__(model_dim, heads, max_width, max_ffn_width, max_branches, max_paths, more_features, layout,
                         kernel_sizes, max_units, unit_bias_rate, ("self_attn", "cross_attn"), causal=True,
                         head_dim=head_dim, share_layouts=share_layouts)

    def cross_kv(self, memory: torch.Tensor, dims: LayerArch) -> tuple[torch.Tensor, torch.Tensor]:
        """The cross-attention keys and values of ``memory [b, s, C]`` for ``dims``: each ``[G, b, B*h, s, dh]``
        (G = units x paths), what a :class:`~nas.model.kv_cache.LayerCache` holds in ``cross_attn``; from the
        cross-attention that ``dims.layout`` runs (:meth:`module`)."""
        groups = dims.units * (dims.paths if dims.layout == "sequential" else 1)
        cross_attn = self.module("cross_attn", dims.layout)
        w = cross_attn.crop(dims.units, groups, dims.branches, dims.width, memory.size(-1), cross=True)
        return cross_attn.memory_kv(memory, w)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, dims: LayerArch, src_pad: torch.Tensor | None,
                reg: Regularization | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        """``x [b, t, C]``, ``memory [b, s, C]``, ``src_pad [b, s]`` -> ``[b, t, C]``.

        ``memory`` is what the cross-attention attends to: with HAT's arbitrary encoder-decoder attention, the last
        k encoder outputs concatenated along the source length (``s = k * source length``) and ``src_pad`` repeated
        k times (:meth:`~nas.model.supernet.SuperTransformer.cross_sources`); the layer itself does not know k.

        With ``cache`` (incremental decoding), ``x`` holds only the newest position(s): the
        self-attention and the causal convolution continue from the cached state, the
        cross-attention reuses the memory's keys/values, and the cropped weights are reused.
        ``reg``: dropout, attention dropout and drop-branch of this call (None: none).

        Raises:
            ValueError: ``dims.layout`` is not built in this layer.
        """
        if cache is None or not cache.memo:  # a cached step after the first one: checked at the first
            self.check_layout(dims)
        units, nb = dims.units, dims.branches
        n_paths = dims.paths if dims.layout == "sequential" else 1
        xu = x[None] if units == 1 else self._unit_inputs(x, dims, None)  # [U, b, t, C]
        if cache is None:
            reg = reg or _NONE
            p, attn_p = reg.dropout, reg.attention_dropout
            branch_scale, keeps = _drop_branch(reg.drop_branch, units, n_paths, x.size(0), nb, 2, x.device)
        else:  # incremental decoding is inference: no regularisation
            p, attn_p, branch_scale, keeps = 0.0, 0.0, (None, None), (None, None, None)
        self_kw = dict(width=dims.width, branches=nb, causal=cache is None, branch_scale=branch_scale[0],
                       cache=None if cache is None else cache.self_attn, units=units, dropout=attn_p)
        cross_kw = dict(width=dims.width, branches=nb, memory=memory, key_pad=src_pad,
                        branch_scale=branch_scale[1], cache=None if cache is None else cache.cross_attn,
                        units=units, dropout=attn_p)
        memo = None if cache is None else cache.memo
        # Incremental decoding calls the sublayers' forward directly: Module.__call__'s hook checks cost
        # about 10 us a call, a tenth of a cached step (benchmarks/bench_decode.py); nothing hooks them. It also
        # keeps the sublayers in its memo: each Module.__getattr__ costs about 1 us, ~30 of them a step.
        self_attn, cross_attn, self_paths, cross_paths, ffn_paths, ffn = (  # those dims.layout runs
            self._sublayers(dims.layout) if memo is None
            else memoized(memo, "sublayers", self._sublayers, dims.layout, True))
        if dims.layout == "prime":
            values: list = []
            total = xu + drop(self_attn(xu, values=values, **self_kw), p)
            total = total + drop(cross_attn(xu, **cross_kw), p)
            if dims.kernels:
                conv = self.conv if cache is None else self.conv.forward
                total = total + drop(conv(xu, values[0], dims.kernels, cache=None if cache is None else cache.conv), p)
            ffn_call = ffn if memo is None else ffn.forward  # incremental decoding skips Module.__call__
            total = self._prime_ffn(ffn_call, total, xu, dims, keeps[-1], p, memo)
            return self._combine(self._prime_norm(total, memo), dims, memo)
        xu = self_paths.fuse(xu, drop(self_attn(self_paths.paths_in(xu, n_paths, memo), **self_kw), p), keeps[0])
        xu = cross_paths.fuse(xu, drop(cross_attn(cross_paths.paths_in(xu, n_paths, memo), **cross_kw), p), keeps[1])
        ys = drop(path_ffn(ffn_paths, ffn, xu, dims.ffn_width, n_paths, p, memo), p)
        return self._combine(ffn_paths.fuse(xu, ys, keeps[-1]), dims, memo)

    def _sublayers(self, layout: str, bare: bool = False) -> tuple:
        """(self-attention, cross-attention, their path fusions, the FFN's, the FFN) that ``layout`` runs
        (:meth:`module`); ``bare``: the attentions' ``forward`` (no ``Module.__call__``). A Prime-only layer has
        no path fusions (None)."""
        self_attn, cross_attn = (self.module(name, layout) for name in ("self_attn", "cross_attn"))
        attn = (self_attn.forward, cross_attn.forward) if bare else (self_attn, cross_attn)
        paths = tuple(getattr(self, f"{name}_paths", None) for name in ("self_attn", "cross_attn", "ffn"))
        return (*attn, *paths, self.module("ffn", layout))
