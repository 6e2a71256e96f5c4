"""Multi-branch attention (MAT eq. 4-6), cropped by explicit widths (Scalable Transformers sec. 3.1),
for every (unit, path) group at once."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nas.model.kv_cache import KVCache
from nas.model.ops import Packed, apply, attend, attend_cached, memoized, pack, path_project

__all__ = ["MultiBranchAttention", "AttentionWeights"]


class AttentionWeights(NamedTuple):
    """One :class:`MultiBranchAttention` cropped to G = units x paths groups, B branches, width D, C channels,
    packed for :func:`~nas.model.ops.apply` (incremental decoding keeps it for a whole batch)."""

    proj: Packed
    """Self-attention: the query, key and value projections ``[G, B*3*D, C]`` (rows branch-major, then
    q/k/v, then D); cross-attention: the query projection ``[G, B*D, C]``."""
    kv: tuple[torch.Tensor, torch.Tensor] | None
    """Cross-attention: the key and value projections of every group as one matrix ``[G*B*2*D, C]`` and
    bias ``[G*B*2*D]`` (the memory is shared: one product); None for self-attention."""
    out: Packed
    """The output projection with the 1/B branch average folded in: ``[G, C, B*D]``, bias ``mean_i b_i [G, C]``."""
    w_out: torch.Tensor
    """``[G, C, B*D]`` output projection of the concatenated branches (drop-branch scales it per sentence)."""
    b_out: torch.Tensor
    """``[G, B, C]``."""
    heads: int
    """Heads per branch ``h`` at this width."""


class MultiBranchAttention(nn.Module):
    """``N_a`` branches of multi-head attention, averaged (MAT eq. 4 without the residual), per path.

    Weights are stacked over units, paths and branches: ``w_in [U, P, N_a, 3, D, C]`` (q, k, v)
    and ``w_out [U, P, N_a, C, D]``, where C is the model width and D the widest attention
    width. A call on U_l units x P_l paths with ``branches=B_l, width=D_l`` on inputs of C_l
    channels uses the leading block ``w_in[:U_l, :P_l, :B_l, :, :D_l, :C_l]`` (top-left crop
    ``W[1:C, 1:D]``, Scalable Transformers sec. 3.1; C_l < C for a type-1 sub-Transformer).
    The head width is fixed (``head_dim``, Scalable Transformers sec. 4.1: "attention head
    dimension is fixed to 64"): a width D_l has ``D_l / head_dim`` heads, the widest's leading
    heads (the crop ``[:D_l]`` keeps whole heads), each at temperature ``1/sqrt(head_dim)``.
    Every (path, branch) pair becomes that many extra attention heads of one attention call.
    With ``head_dim=None`` (models saved before it existed) the head count is fixed instead:
    ``heads`` heads of ``D_l / heads`` channels.

    With ``relative=k > 0`` self-attention adds relative position representations (Shaw et al. 2018,
    "Self-Attention with Relative Position Representations", eq. 3-4 with the clipping of eq. 5-6):
    ``e_ij = q_i (k_j + a^K_ij)^T / sqrt(d_h)`` and ``z_i = sum_j alpha_ij (v_j + a^V_ij)``, where
    ``a_ij = w_clip(j - i, k)`` is one of ``2k + 1`` learned vectors of ``d_h`` channels, shared by the heads,
    branches and paths of a MUTE unit (one table per unit). MUTE (sec. 4, "Model and Hyper-parameters") runs its
    units on relative positions because swap and disorder change nothing for a unit that sees positions only at
    its input. The absolute sinusoids at the embedding are kept (adapted: MUTE does not say whether it removed
    them; Shaw et al. found that combining both neither helps nor hurts translation quality).

    Args:
        model_dim: C, the model width (channels).
        max_width: D, the widest attention width (channels), divisible by ``head_dim`` (or ``heads``).
        max_branches: the most branches N_a.
        heads: attention heads per branch when ``head_dim`` is None.
        max_paths: the most paths (Multi-Path).
        max_units: the most MUTE units.

        head_dim: the width of one head (channels), or None (fixed head count).
        relative: Shaw et al.'s clipping distance k (positions), or 0: no relative positions.

    Raises:
        ValueError: ``max_width`` not divisible by ``head_dim`` (or ``heads``).
    """

    def __init__(self, model_dim: int, max_width: int, max_branches: int, heads: int, max_paths: int = 1,
                 max_units: int = 1, head_dim: int | None = None, relative: int = 0) -> None:
        super().__init__()
        if max_width % (head_dim or heads):
            what = f"head_dim={head_dim}" if head_dim else f"heads={heads}"
            raise ValueError(f"attention width {max_width} is not divisible by {what}")
        self.model_dim, self.max_width, self.max_branches, self.heads = model_dim, max_width, max_branches, heads
        self.head_dim = head_dim
        lead = (max_units, max_paths)  # MUTE units, Multi-Path paths
        self.w_in = nn.Parameter(torch.empty(*lead, max_branches, 3, max_width, model_dim))
        self.b_in = nn.Parameter(torch.zeros(*lead, max_branches, 3, max_width))
        self.w_out = nn.Parameter(torch.empty(*lead, max_branches, model_dim, max_width))
        self.b_out = nn.Parameter(torch.zeros(*lead, max_branches, model_dim))
        bound_in = math.sqrt(6.0 / (model_dim + 3 * max_width))  # xavier over the fused [3D, C] matrix
        nn.init.uniform_(self.w_in, -bound_in, bound_in)
        nn.init.uniform_(self.w_out, -1.0 / math.sqrt(max_width), 1.0 / math.sqrt(max_width))
        self.relative = relative
        if relative:  # Shaw et al. eq. 5-6: w^K, w^V [U, 2k+1, d_h]
            dh = head_dim or max_width // heads
            self.rel_k = nn.Parameter(torch.randn(max_units, 2 * relative + 1, dh) * dh ** -0.5)
            self.rel_v = nn.Parameter(torch.randn(max_units, 2 * relative + 1, dh) * dh ** -0.5)

    def heads_of(self, width: int) -> int:
        """Heads per branch of a ``width``-channel attention: ``width / head_dim`` (or the fixed ``heads``)."""
        return width // self.head_dim if self.head_dim else self.heads

    def crop(self, units: int, groups: int, branches: int, width: int, c: int, cross: bool = False,
             step: bool = False) -> AttentionWeights:
        """The weights of ``units`` x ``groups // units`` paths, ``branches``, ``width`` on ``c`` input channels
        (views, except where a crop must be copied to be flattened); ``cross``: for cross-attention;
        ``step``: for incremental decoding (:meth:`_cached`): the attention's ``1/sqrt(d_h)`` folded into the
        query projection (:func:`~nas.model.ops.attend_cached`) and the self-attention rows ordered
        (q/k/v, branch, D), so that each of q, k and v is one block of heads."""
        nb = branches
        crop = lambda p, *rest: p[:units, : groups // units][(slice(None), slice(None), *rest)].flatten(0, 1)
        w_in = crop(self.w_in, slice(nb), slice(None), slice(width), slice(c))  # [G, B, 3, D, C] (C cropped: type 1)
        b_in = crop(self.b_in, slice(nb), slice(None), slice(width))  # [G, B, 3, D]
        if step:
            scale = torch.tensor([(width // self.heads_of(width)) ** -0.5, 1.0, 1.0], dtype=w_in.dtype, device=w_in.device)
            w_in, b_in = w_in * scale[:, None, None], b_in * scale[:, None]
        w_out = crop(self.w_out, slice(nb), slice(c), slice(width)).permute(0, 2, 1, 3).reshape(groups, c, nb * width)
        b_out = crop(self.b_out, slice(nb), slice(c))  # [G, B, C]
        if cross:
            proj = pack(w_in[:, :, 0].reshape(groups, nb * width, c), b_in[:, :, 0].reshape(groups, -1))
            kv = (w_in[:, :, 1:].reshape(groups * nb * 2 * width, c), b_in[:, :, 1:].reshape(-1))
        elif step:  # rows (q/k/v, branch, D)
            proj, kv = pack(w_in.transpose(1, 2).reshape(groups, 3 * nb * width, c),
                            b_in.transpose(1, 2).reshape(groups, -1)), None
        else:
            proj, kv = pack(w_in.reshape(groups, nb * 3 * width, c), b_in.reshape(groups, -1)), None
        out = pack(w_out, b_out[:, 0]) if nb == 1 else pack(w_out / nb, b_out.mean(1))
        return AttentionWeights(proj, kv, out, w_out, b_out, self.heads_of(width))

    def memory_kv(self, memory: torch.Tensor, w: AttentionWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention keys and values of ``memory [b, s, C]`` for every group: each ``[G, b, B*h, s, dh]``
        (``w`` from :meth:`crop` with ``cross=True``).

        The memory is shared by the groups: one matmul for all of them."""
        bsz, s, _ = memory.shape
        kv = F.linear(memory, *w.kv)  # [b, s, G*B*2*D]
        groups, nb = w.b_out.size(0), w.b_out.size(1)
        kv = kv.view(bsz, s, groups, nb, 2, -1).permute(2, 0, 1, 3, 4, 5)  # [G, b, s, B, 2, D]
        k, v = kv.unbind(4)  # each [G, b, s, B, D]
        return self._heads(k), self._heads(v)  # [G, b, B*h, s, dh]

    def forward(
        self,
        xs: torch.Tensor,
        *,
        width: int,
        branches: int,
        memory: torch.Tensor | None = None,
        key_pad: torch.Tensor | None = None,
        causal: bool = False,
        branch_scale: torch.Tensor | None = None,
        cache: KVCache | None = None,
        values: list | None = None,
        units: int = 1,
        dropout: float = 0.0,
        relative: bool = True,
    ) -> torch.Tensor:
        """Attend each group's queries to themselves (``memory=None``) or to ``memory``.

        Args:
            xs: queries of every (unit, path) group ``[G, b, t, C]``, G = units * paths, unit-major.
            width: attention width D_l (channels, divisible by heads).
            branches: number of branches B_l.
            memory: keys/values source ``[b, s, C]`` for cross-attention (shared by all paths).
            key_pad: ``[b, s]`` bool, True where the key is padding.
            causal: mask future positions (decoder self-attention over a full sequence).
            branch_scale: drop-branch keep mask ``[G, b, B_l]`` (MAT eq. 5), or None.
            cache: incremental decoding (``xs`` holds the newest positions only): self-attention
                appends its keys/values, cross-attention computes the memory's once; the cropped
                weights are kept in ``cache.memo``.
            values: if given (self-attention), receives the value projection of branch 0 of
                every group, ``[G, b, t, D_l]``: Prime's Shared Projection ``V_C = V_A`` (Fig. 6).
            units: number of MUTE units U (the groups are U units x P paths).
            dropout: dropout rate on the attention probabilities.
            relative: False: leave the relative position tables (when built) out of this call, as an attention
                without them (an encoder layer running one unit under ``relative_layers="units"``).
        Returns:
            ``[G, b, t, C]``: per group ``1/B_l * sum_i beta_i * MHA_i`` (MAT eq. 4/6; residual added by the caller).
        """
        groups, bsz, t, c = xs.shape  # groups = units x paths
        nb = branches
        cross = memory is not None
        if cache is not None:
            w = memoized(cache.memo, "weights", self.crop, units, groups, nb, width, c, cross, True)
            o = self._cached(xs, w, memory, key_pad, cache, values)  # [G, b, 1, B*D]
        else:
            w = self.crop(units, groups, nb, width, c, cross)
            if not cross:
                q, k, v = apply(xs, w.proj).view(groups, bsz, t, nb, 3, width).unbind(4)  # each [G, b, t, B, D]
                if values is not None:
                    values.append(v[:, :, :, 0])  # [G, b, t, D]
                k, v = self._heads(k), self._heads(v)  # [G, b, B*h, t, dh]
            else:
                q = apply(xs, w.proj).view(groups, bsz, t, nb, width)
                k, v = self.memory_kv(memory, w)  # [G, b, B*h, s, dh]
            mask = None if key_pad is None else ~key_pad[None, :, None, None, :]  # [1, b, 1, 1, s], True = attend
            if self.relative and relative and not cross:
                o = self._relative(self._heads(q), k, v, mask, causal, units, dropout)
            else:
                o = attend(self._heads(q), k, v, mask, causal=causal, dropout_p=dropout)  # [G, b, B*h, t, dh]
            o = o.transpose(2, 3).reshape(groups, bsz, t, nb * width)  # [G, b, t, B*D]
        if branch_scale is None:  # the 1/B average folded into the (small) weight, not the activations
            return apply(o, w.out)
        scale = branch_scale / nb  # [G, b, B]
        o = (o.view(groups, bsz, t, nb, width) * scale[:, :, None, :, None].to(o.dtype)).view(groups, bsz, t, nb * width)
        b_out = torch.einsum("pbk,pkc->pbc", scale, w.b_out)[:, :, None, :]  # [G, b, 1, C]
        return path_project(o, w.w_out, None) + b_out

    def _cached(self, xs: torch.Tensor, w: AttentionWeights, memory: torch.Tensor | None,
                key_pad: torch.Tensor | None, cache: KVCache, values: list | None) -> torch.Tensor:
        """The newest ``t`` positions ``xs [G, b, t, C]`` -> the branches' outputs ``[G, b, t, B*D]`` (before the
        output projection), with ``w`` from :meth:`crop` with ``step=True``.

        The same attention as the full pass, laid out for few queries per row: the keys/values of
        self-attention are appended to ``cache`` and the new positions attend causally (each to
        the past and to the new positions up to itself); those of cross-attention are computed
        once. For one position (the usual step) the projected q/k/v rows are already heads
        (``[G, b, B*h, dh]``, views).

        Cross-attention's keys/values may hold one row per sentence while ``xs`` holds one per hypothesis
        (``cache.k [G, n, B*h, s, dh]`` with ``b = n * beams``, each sentence's beams consecutive; ``key_pad [n, s]``):
        then the beams of a sentence are the queries of one product by its keys (``[beams, dh] x [dh, s]``), which
        reads the memory once per sentence, not once per beam (the AOT-compiled step, :mod:`nas.export.aot`). The
        values are those of the per-row products; their sums may round differently in the last bit.
        """
        groups, bsz, t, _ = xs.shape
        per_branch = w.heads  # h at this width
        heads = w.b_out.size(1) * per_branch  # B*h
        causal = None
        if memory is None:
            if t == 1:
                qkv = apply(xs, w.proj).view(groups, bsz, 3, heads, -1)  # [G, b, 3, B*h, dh]
                q = qkv[:, :, 0]  # [G, b, B*h, dh]
                if values is not None:  # branch 0's values [G, b, 1, D]
                    values.append(qkv[:, :, 2, :per_branch].reshape(groups, bsz, 1, -1))
                kt, v = cache.step(qkv[:, :, 1:])  # [N, dh, T], [N, T, dh]
            else:
                qkv = apply(xs, w.proj).view(groups, bsz, t, 3, heads, -1).permute(3, 0, 1, 4, 2, 5)
                q, k, v = qkv.unbind(0)  # each [G, b, B*h, t, dh]
                if values is not None:
                    values.append(v[:, :, :per_branch].transpose(2, 3).reshape(groups, bsz, t, -1))
                past = cache.length
                k, v = cache.append(k, v)  # [G, b, B*h, T, dh]
                kt, v = k.flatten(0, 2).transpose(1, 2), v.flatten(0, 2)
                # query i (position past + i) sees keys 0 .. past + i
                later = torch.arange(past + t, device=xs.device)[None, :] > past + torch.arange(t, device=xs.device)[:, None]
                causal = torch.zeros(later.shape, dtype=q.dtype, device=xs.device).masked_fill(later, float("-inf"))
        else:
            q = apply(xs, w.proj).view(groups, bsz, t, heads, -1)  # [G, b, t, B*h, dh]
            if not cache.filled:
                k, v = self.memory_kv(memory, w)
                cache.set(k.contiguous(), v.contiguous())
            kt, v = memoized(cache.memo, "kv", _flat, cache)
            sentences = cache.k.size(1)
            if t == 1 and sentences != bsz:  # the memory once per sentence, its bsz // sentences rows consecutive
                beams = bsz // sentences  # the beams of a sentence attend together: [N, beams, dh] by its keys
                q = q.view(groups, sentences, beams, heads, -1).transpose(2, 3).reshape(-1, beams, q.size(-1))
                bias = None if key_pad is None else memoized(cache.memo, "bias", _additive, key_pad, cache.k)
                o = attend_cached(q, kt, v, bias)  # [G*sentences*B*h, beams, dh]
                return o.view(groups, sentences, heads, beams, -1).transpose(2, 3).reshape(groups, bsz, 1, -1)
            q = q.squeeze(2) if t == 1 else q.transpose(2, 3)  # [G, b, B*h, dh] or [G, b, B*h, t, dh]
        bias = None if key_pad is None else memoized(cache.memo, "bias", _additive, key_pad, cache.k)
        if causal is not None:
            bias = causal if bias is None else bias + causal
        o = attend_cached(q.reshape(-1, t, q.size(-1)), kt, v, bias)  # [N, t, dh]
        if t == 1:
            return o.view(groups, bsz, 1, -1)
        return o.view(groups, bsz, heads, t, -1).transpose(2, 3).reshape(groups, bsz, t, -1)

    def _relative(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                  units: int, dropout: float) -> torch.Tensor:
        """Self-attention with relative position representations (Shaw et al. 2018, eq. 3-6).

        ``q, k, v [G, b, H, t, dh]`` (G = units x paths, unit-major; H = branches x heads), ``mask`` as in
        :func:`~nas.model.ops.attend` -> ``[G, b, H, t, dh]``. Unit u's groups use table ``u``, cropped to
        ``dh`` channels."""
        groups, _, _, t, dh = q.shape
        ar = torch.arange(t, device=q.device)
        idx = (ar[None, :] - ar[:, None]).clamp(-self.relative, self.relative) + self.relative  # [t, t]: clip(j - i)
        per = groups // units
        rk = self.rel_k[:units, :, :dh].repeat_interleave(per, 0).to(q.dtype)  # [G, 2k+1, dh]
        rv = self.rel_v[:units, :, :dh].repeat_interleave(per, 0).to(q.dtype)
        rel = torch.einsum("gbhtd,grd->gbhtr", q, rk)  # q_i . w^K_r
        scores = q @ k.transpose(-1, -2) + rel.gather(-1, idx.expand(*rel.shape[:-1], t))  # eq. 4 numerator
        scores = scores * dh ** -0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        if causal:
            scores = scores.masked_fill(idx > self.relative, float("-inf"))  # j > i
        probs = F.dropout(torch.softmax(scores, -1), dropout, True) if dropout > 0.0 else torch.softmax(scores, -1)
        return probs @ v + torch.einsum("gbhts,gtsd->gbhtd", probs, rv[:, idx])  # eq. 3

    def _heads(self, z: torch.Tensor) -> torch.Tensor:
        """``[G, b, t, B, D] -> [G, b, B*h, t, D/h]``: branches become extra attention heads."""
        n_paths, bsz, t, nb, width = z.shape
        heads = self.heads_of(width)
        return z.reshape(n_paths, bsz, t, nb * heads, width // heads).transpose(2, 3)


def _flat(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached keys transposed ``[N, dh, s]`` and values ``[N, s, dh]`` (views, N = G*b*B*h)."""
    return cache.k.flatten(0, 2).transpose(1, 2), cache.v.flatten(0, 2)


def _additive(key_pad: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``key_pad [b, s]`` (True at padding) -> the additive mask ``[G*b*B*h, 1, s]`` of keys ``k [G, b, B*h, s, dh]``."""
    groups, bsz, heads, s, _ = k.shape
    add = torch.zeros(key_pad.shape, dtype=k.dtype, device=k.device).masked_fill(key_pad, float("-inf"))
    return add[None, :, None, None, :].expand(groups, bsz, heads, 1, s).reshape(groups * bsz * heads, 1, s)
