"""Multi-branch attention (MAT eq. 4-6), cropped by explicit widths (Scalable Transformers sec. 3.1),
for every (unit, path) group at once."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nas.model.kv_cache import KVCache
from nas.model.ops import attend, path_project

__all__ = ["MultiBranchAttention", "AttentionWeights"]


class AttentionWeights(NamedTuple):
    """One :class:`MultiBranchAttention` cropped to G = units x paths groups, B branches, width D, C channels."""

    w_in: torch.Tensor
    """``[G, B, 3, D, C]`` query, key and value projections."""
    b_in: torch.Tensor
    """``[G, B, 3, D]``."""
    w_out: torch.Tensor
    """``[G, C, B*D]`` output projection of the concatenated branches."""
    b_out: torch.Tensor
    """``[G, B, C]``."""


class MultiBranchAttention(nn.Module):
    """``N_a`` branches of multi-head attention, averaged (MAT eq. 4 without the residual), per path.

    Weights are stacked over units, paths and branches: ``w_in [U, P, N_a, 3, D, C]`` (q, k, v)
    and ``w_out [U, P, N_a, C, D]``, where C is the model width and D the widest attention
    width. A call on U_l units x P_l paths with ``branches=B_l, width=D_l`` on inputs of C_l
    channels uses the leading block ``w_in[:U_l, :P_l, :B_l, :, :D_l, :C_l]`` (top-left crop
    ``W[1:C, 1:D]``, Scalable Transformers sec. 3.1; C_l < C for a type-1 sub-Transformer).
    The head count is fixed, so the head width is ``D_l / heads``; every (path, branch)
    pair becomes ``heads`` extra attention heads of one attention call.

    Args:
        model_dim: C, the model width (channels).
        max_width: D, the widest attention width (channels), divisible by ``heads``.
        max_branches: the most branches N_a.
        heads: attention heads per branch.
        max_paths: the most paths (Multi-Path).
        max_units: the most MUTE units.

    Raises:
        ValueError: ``max_width`` not divisible by ``heads``.
    """

    def __init__(self, model_dim: int, max_width: int, max_branches: int, heads: int, max_paths: int = 1,
                 max_units: int = 1) -> None:
        super().__init__()
        if max_width % heads:
            raise ValueError(f"attention width {max_width} is not divisible by heads={heads}")
        self.model_dim, self.max_width, self.max_branches, self.heads = model_dim, max_width, max_branches, heads
        lead = (max_units, max_paths)  # MUTE units, Multi-Path paths
        self.w_in = nn.Parameter(torch.empty(*lead, max_branches, 3, max_width, model_dim))
        self.b_in = nn.Parameter(torch.zeros(*lead, max_branches, 3, max_width))
        self.w_out = nn.Parameter(torch.empty(*lead, max_branches, model_dim, max_width))
        self.b_out = nn.Parameter(torch.zeros(*lead, max_branches, model_dim))
        bound_in = math.sqrt(6.0 / (model_dim + 3 * max_width))  # xavier over the fused [3D, C] matrix
        nn.init.uniform_(self.w_in, -bound_in, bound_in)
        nn.init.uniform_(self.w_out, -1.0 / math.sqrt(max_width), 1.0 / math.sqrt(max_width))

    def crop(self, units: int, groups: int, branches: int, width: int, c: int) -> AttentionWeights:
        """The weights of ``units`` x ``groups // units`` paths, ``branches``, ``width`` on ``c`` input channels."""
        nb = branches
        crop = lambda p, *rest: p[:units, : groups // units][(slice(None), slice(None), *rest)].flatten(0, 1)
        w_in = crop(self.w_in, slice(nb), slice(None), slice(width), slice(c))  # [G, B, 3, D, C] (C cropped: type 1)
        b_in = crop(self.b_in, slice(nb), slice(None), slice(width))  # [G, B, 3, D]
        w_out = crop(self.w_out, slice(nb), slice(c), slice(width)).permute(0, 2, 1, 3).reshape(groups, c, nb * width)
        return AttentionWeights(w_in, b_in, w_out, crop(self.b_out, slice(nb), slice(c)))

    def memory_kv(self, memory: torch.Tensor, w: AttentionWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention keys and values of ``memory [b, s, C]`` for every group: each ``[G, b, B*h, s, dh]``.

        The memory is shared by the groups: one matmul for all of them."""
        groups, nb, _, width, c = w.w_in.shape
        bsz, s = memory.size(0), memory.size(1)
        kv = F.linear(memory, w.w_in[:, :, 1:].reshape(groups * nb * 2 * width, c), w.b_in[:, :, 1:].reshape(-1))
        kv = kv.view(bsz, s, groups, nb, 2, width).permute(2, 0, 1, 3, 4, 5)  # [G, b, s, B, 2, D]
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
        Returns:
            ``[G, b, t, C]``: per group ``1/B_l * sum_i beta_i * MHA_i`` (MAT eq. 4/6; residual added by the caller).
        """
        groups, bsz, t, c = xs.shape  # groups = units x paths
        nb = branches
        if cache is None:
            w = self.crop(units, groups, nb, width, c)
        else:
            w = cache.memo.get("weights")
            if w is None:
                w = cache.memo["weights"] = self.crop(units, groups, nb, width, c)
        if memory is None:
            qkv = path_project(xs, w.w_in.reshape(groups, nb * 3 * width, c), w.b_in.reshape(groups, -1))
            q, k, v = qkv.view(groups, bsz, t, nb, 3, width).unbind(4)  # each [G, b, t, B, D]
            if values is not None:
                values.append(v[:, :, :, 0])  # [G, b, t, D]
            k, v = self._heads(k), self._heads(v)  # [G, b, B*h, t, dh]
            if cache is not None:
                k, v = cache.append(k, v)  # [G, b, B*h, T, dh]
        else:
            q = path_project(xs, w.w_in[:, :, 0].reshape(groups, nb * width, c), w.b_in[:, :, 0].reshape(groups, -1))
            q = q.view(groups, bsz, t, nb, width)
            if cache is not None and cache.filled:
                k, v = cache.k, cache.v
            else:
                k, v = self.memory_kv(memory, w)  # [G, b, B*h, s, dh]
                if cache is not None:
                    cache.set(k, v)
        q = self._heads(q)  # [G, b, B*h, t, dh]
        mask = None if key_pad is None else ~key_pad[None, :, None, None, :]  # [1, b, 1, 1, s], True = attend
        o = attend(q, k, v, mask, causal=causal, dropout_p=dropout, matmul=cache is not None)  # [G, b, B*h, t, dh]
        o = o.transpose(2, 3).reshape(groups, bsz, t, nb, width)  # [G, b, t, B, D]
        if branch_scale is None:  # the 1/B average folded into the (small) weight, not the activations
            w_out = w.w_out if nb == 1 else w.w_out / nb
            return path_project(o.reshape(groups, bsz, t, nb * width), w_out, w.b_out[:, 0] if nb == 1 else w.b_out.mean(1))
        scale = branch_scale / nb  # [G, b, B]
        o = o * scale[:, :, None, :, None].to(o.dtype)
        b_out = torch.einsum("pbk,pkc->pbc", scale, w.b_out)[:, :, None, :]  # [G, b, 1, C]
        return path_project(o.reshape(groups, bsz, t, nb * width), w.w_out, None) + b_out

    def _heads(self, z: torch.Tensor) -> torch.Tensor:
        """``[G, b, t, B, D] -> [G, b, B*h, t, D/h]``: branches become extra attention heads."""
        n_paths, bsz, t, nb, width = z.shape
        return z.reshape(n_paths, bsz, t, nb * self.heads, width // self.heads).transpose(2, 3)
