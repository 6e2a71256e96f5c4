"""Elastic building blocks of the supernet: every weight is cropped by explicit dimensions.

Cropping follows Scalable Transformers (sec. 3.1): a narrower layer uses the top-left
sub-matrix ``W[1:C, 1:D]`` and the first ``D`` entries of each bias. Branches follow the
Multi-branch Attentive Transformer (MAT): ``N_a`` independent multi-head attentions whose
outputs are averaged (eq. 4), each dropped with rate ``rho`` in training (drop-branch,
eq. 5-6), and drop-branch on the FFN (eq. 7). Paths follow the Multi-Path Transformer:
``n`` parallel pre-norm paths per sublayer, each ending in a PathNorm, fused as
``beta * x + sum_i alpha_i * Path_i(x)`` (eq. 4-6).

Units (MUTE), paths and branches of a sublayer run as ONE batched matrix product (their
weights are stacked: ``[units, paths, branches, ...]``), never as a Python loop over
modules. Activations inside a sublayer are laid out ``[G, b, t, ...]`` with G = units x
paths groups first (unit-major).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from nas.space.arch import DEPENDENCIES, UNIT_BIASES, LayerArch

__all__ = ["MultiBranchAttention", "ElasticFFN", "PathFusion", "DynamicConv", "EncoderLayer", "DecoderLayer",
           "apply_unit_bias", "unit_bias_kinds", "doubly_normalize", "permutation_penalty", "UNIT_BIASES", "DEPENDENCIES",
           "sinusoidal_positions", "drop_mask", "path_project", "path_ffn", "IncrementalLayer"]

Cache = dict[str, torch.Tensor]
# On CPU the math backend is faster than the flash kernel for MT-length sequences (its
# backward dominated training time: benchmarks/bench_train.py); elsewhere let torch choose.
_CPU_BACKENDS = [SDPBackend.MATH]
_ALL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]


def sinusoidal_positions(max_positions: int, dim: int) -> torch.Tensor:
    """Sinusoidal position table (Vaswani et al. 2017, sec. 3.5): ``[max_positions, dim]``.

    ``pe[p, 2i] = sin(p / 10000^(2i/dim))`` and ``pe[p, 2i+1] = cos(...)``.
    """
    pos = torch.arange(max_positions, dtype=torch.float32)[:, None]
    inv = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    pe = torch.zeros(max_positions, dim)
    pe[:, 0::2] = torch.sin(pos * inv)
    pe[:, 1::2] = torch.cos(pos * inv)
    return pe


def drop_mask(shape: tuple[int, ...], rho: float, device: torch.device) -> torch.Tensor | None:
    """Drop-branch keep mask ``I{U >= rho} / (1 - rho)`` (MAT eq. 5 and 7) of ``shape``.

    One draw per sentence and branch (or path). Returns None when ``rho == 0``.
    """
    if rho <= 0.0:
        return None
    keep = (torch.rand(shape, device=device) >= rho).float()
    return keep / (1.0 - rho)


def path_project(xs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Per-group linear map: ``xs [G, b, t, C]``, ``weight [G, K, C]``, ``bias [G, K]`` -> ``[G, b, t, K]``.

    One ``F.linear`` for a single group, else one ``baddbmm`` over all groups.
    """
    n_paths, bsz, t, c = xs.shape
    if n_paths == 1:
        return F.linear(xs, weight[0], None if bias is None else bias[0])
    flat = xs.reshape(n_paths, bsz * t, c)
    out = torch.bmm(flat, weight.transpose(1, 2)) if bias is None else torch.baddbmm(bias[:, None, :], flat, weight.transpose(1, 2))
    return out.view(n_paths, bsz, t, -1)


class MultiBranchAttention(nn.Module):
    """``N_a`` branches of multi-head attention, averaged (MAT eq. 4 without the residual), per path.

    Weights are stacked over units, paths and branches: ``w_in [U, P, N_a, 3, D, C]`` (q, k, v)
    and ``w_out [U, P, N_a, C, D]``, where C is the model width and D the widest attention
    width. A call on U_l units x P_l paths with ``branches=B_l, width=D_l`` on inputs of C_l
    channels uses the leading block ``w_in[:U_l, :P_l, :B_l, :, :D_l, :C_l]`` (top-left crop
    ``W[1:C, 1:D]``, Scalable Transformers sec. 3.1; C_l < C for a type-1 sub-Transformer).
    The head count is fixed, so the head width is ``D_l / heads``; every (path, branch)
    pair becomes ``heads`` extra attention heads of one ``scaled_dot_product_attention``.

    Args:
        model_dim: C, the model width (channels).
        max_width: D, the widest attention width (channels), divisible by ``heads``.
        max_branches: the most branches N_a.
        heads: attention heads per branch.
        dropout: dropout on the attention probabilities (training only).
        max_paths: the most paths (Multi-Path).
    """

    def __init__(self, model_dim: int, max_width: int, max_branches: int, heads: int, dropout: float = 0.0,
                 max_paths: int = 1, max_units: int = 1) -> None:
        super().__init__()
        if max_width % heads:
            raise ValueError(f"attention width {max_width} is not divisible by heads={heads}")
        self.model_dim, self.max_width, self.max_branches, self.heads = model_dim, max_width, max_branches, heads
        self.dropout = dropout
        lead = (max_units, max_paths)  # MUTE units, Multi-Path paths
        self.w_in = nn.Parameter(torch.empty(*lead, max_branches, 3, max_width, model_dim))
        self.b_in = nn.Parameter(torch.zeros(*lead, max_branches, 3, max_width))
        self.w_out = nn.Parameter(torch.empty(*lead, max_branches, model_dim, max_width))
        self.b_out = nn.Parameter(torch.zeros(*lead, max_branches, model_dim))
        bound_in = math.sqrt(6.0 / (model_dim + 3 * max_width))  # xavier over the fused [3D, C] matrix
        nn.init.uniform_(self.w_in, -bound_in, bound_in)
        nn.init.uniform_(self.w_out, -1.0 / math.sqrt(max_width), 1.0 / math.sqrt(max_width))

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
        cache: Cache | None = None,
        values: list | None = None,
        units: int = 1,
    ) -> torch.Tensor:
        """Attend each path's queries to themselves (``memory=None``) or to ``memory``.

        Args:
            xs: queries of every (unit, path) group ``[G, b, t, C]``, G = units * paths, unit-major.
            width: attention width D_l (channels, divisible by heads).
            branches: number of branches B_l.
            memory: keys/values source ``[b, s, C]`` for cross-attention (shared by all paths).
            key_pad: ``[b, s]`` bool, True where the key is padding.
            causal: mask future positions (decoder self-attention over a full sequence).
            branch_scale: drop-branch keep mask ``[P, b, B_l]`` (MAT eq. 5), or None.
            cache: incremental decoding state, updated in place: self-attention appends
                ``k``/``v`` ``[P, b, B_l*h, t_so_far, d_h]``; cross-attention stores ``ck``/``cv`` once.
            values: if given (self-attention), receives the value projection of branch 0 of
                every group, ``[G, b, t, D_l]``: Prime's Shared Projection ``V_C = V_A`` (Fig. 6).
            units: number of MUTE units U (the groups are U units x P paths).
        Returns:
            ``[G, b, t, C]``: per group ``1/B_l * sum_i beta_i * MHA_i`` (MAT eq. 4/6; residual added by the caller).
        """
        groups, bsz, t, c = xs.shape  # groups = units x paths
        nb = branches
        crop = lambda p, *rest: p[:units, : groups // units][(slice(None), slice(None), *rest)].flatten(0, 1)
        w_in = crop(self.w_in, slice(nb), slice(None), slice(width), slice(c))  # C cropped too (type 1)
        b_in = crop(self.b_in, slice(nb), slice(None), slice(width))
        if memory is None:
            qkv = path_project(xs, w_in.reshape(groups, nb * 3 * width, c), b_in.reshape(groups, -1))
            q, k, v = qkv.view(groups, bsz, t, nb, 3, width).unbind(4)  # each [G, b, t, B, D]
            if values is not None:
                values.append(v[:, :, :, 0])  # [G, b, t, D]
            k, v = self._heads(k), self._heads(v)  # [G, b, B*h, t, dh]
            if cache is not None:
                if "k" in cache:
                    k, v = torch.cat([cache["k"], k], 3), torch.cat([cache["v"], v], 3)
                cache["k"], cache["v"] = k, v
        else:
            q = path_project(xs, w_in[:, :, 0].reshape(groups, nb * width, c), b_in[:, :, 0].reshape(groups, -1))
            q = q.view(groups, bsz, t, nb, width)
            if cache is not None and "ck" in cache:
                k, v = cache["ck"], cache["cv"]
            else:
                s = memory.size(1)  # memory is shared by the paths: one matmul for all of them
                kv = F.linear(memory, w_in[:, :, 1:].reshape(groups * nb * 2 * width, c), b_in[:, :, 1:].reshape(-1))
                kv = kv.view(bsz, s, groups, nb, 2, width).permute(2, 0, 1, 3, 4, 5)  # [G, b, s, B, 2, D]
                k, v = kv.unbind(4)  # each [G, b, s, B, D]
                k, v = self._heads(k), self._heads(v)  # [G, b, B*h, s, dh]
                if cache is not None:
                    cache["ck"], cache["cv"] = k, v
        q = self._heads(q)  # [G, b, B*h, t, dh]
        mask = None if key_pad is None else ~key_pad[None, :, None, None, :]  # [1, b, 1, 1, s], True = attend
        with sdpa_kernel(_CPU_BACKENDS if q.device.type == "cpu" else _ALL_BACKENDS):
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                dropout_p=self.dropout if self.training else 0.0,
            )  # [G, b, B*h, t, dh]
        o = o.transpose(2, 3).reshape(groups, bsz, t, nb, width)  # [G, b, t, B, D]
        w_out = crop(self.w_out, slice(nb), slice(c), slice(width)).permute(0, 2, 1, 3).reshape(groups, c, nb * width)  # [G, C, B*D]
        b_out = crop(self.b_out, slice(nb), slice(c))  # [G, B, C]
        if branch_scale is None:  # the 1/B average folded into the (small) weight, not the activations
            w_out = w_out if nb == 1 else w_out / nb
            return path_project(o.reshape(groups, bsz, t, nb * width), w_out, b_out[:, 0] if nb == 1 else b_out.mean(1))
        scale = branch_scale / nb  # [G, b, B]
        o = o * scale[:, :, None, :, None].to(o.dtype)
        b_out = torch.einsum("pbk,pkc->pbc", scale, b_out)[:, :, None, :]  # [G, b, 1, C]
        return path_project(o.reshape(groups, bsz, t, nb * width), w_out, None) + b_out

    def _heads(self, z: torch.Tensor) -> torch.Tensor:
        """``[G, b, t, B, D] -> [G, b, B*h, t, D/h]``: branches become extra attention heads."""
        n_paths, bsz, t, nb, width = z.shape
        return z.reshape(n_paths, bsz, t, nb * self.heads, width // self.heads).transpose(2, 3)


class ElasticFFN(nn.Module):
    """Position-wise FFN ``ReLU(x W1^T + b1) W2^T + b2`` (Scalable Transformers eq. 2) per (unit, path) group.

    ``w1 [U, P, F, C]`` and ``w2 [U, P, C, F]``; a call on U units x P paths with ``ffn_width=F_l``
    on inputs of C_l channels uses ``w1[:U, :P, :F_l, :C_l]`` and ``w2[:U, :P, :C_l, :F_l]``.
    """

    def __init__(self, model_dim: int, max_ffn_width: int, dropout: float = 0.0, max_paths: int = 1,
                 max_units: int = 1) -> None:
        super().__init__()
        lead = (max_units, max_paths)
        self.w1 = nn.Parameter(torch.empty(*lead, max_ffn_width, model_dim))
        self.b1 = nn.Parameter(torch.zeros(*lead, max_ffn_width))
        self.w2 = nn.Parameter(torch.empty(*lead, model_dim, max_ffn_width))
        self.b2 = nn.Parameter(torch.zeros(*lead, model_dim))
        for w in (self.w1, self.w2):
            for group in w.data.flatten(0, 1):
                nn.init.xavier_uniform_(group)
        self.dropout = nn.Dropout(dropout)

    def forward(self, xs: torch.Tensor, ffn_width: int, units: int = 1) -> torch.Tensor:
        """``[G, b, t, C] -> [G, b, t, C]`` with G = units x paths (unit-major)."""
        u, p, c = units, xs.size(0) // units, xs.size(-1)
        w1, b1 = self.w1[:u, :p, :ffn_width, :c].flatten(0, 1), self.b1[:u, :p, :ffn_width].flatten(0, 1)
        w2, b2 = self.w2[:u, :p, :c, :ffn_width].flatten(0, 1), self.b2[:u, :p, :c].flatten(0, 1)
        hidden = F.relu(path_project(xs, w1, b1))  # [G, b, t, F_l]
        return path_project(self.dropout(hidden), w2, b2)

    def folded(self, xn: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, ffn_width: int) -> torch.Tensor:
        """The FFN of every path on ``LN_p(x) = x^ * g_p + b_p`` without materialising the P inputs.

        ``W1 (x^ g + b) = (W1 g) x^ + W1 b``: each path's layer-norm affine is folded into its first
        projection, and the P paths' first projections run as one batched matmul reading the
        shared normalised input (a stride-0 batch: the P inputs are never materialised).

        Args: ``xn [U, b, t, C]`` (``LN(x_u)`` without affine), ``ln_weight``/``ln_bias``
        ``[U, P, C]`` (Multi-Path eq. 5's per-path LN). Returns ``[U*P, b, t, C]`` (unit-major),
        equal to ``forward(LN_p(x_u))``.
        """
        units, n_paths, c = ln_weight.size(0), ln_weight.size(1), xn.size(-1)
        _, bsz, t, _ = xn.shape
        groups = units * n_paths
        w1, b1 = self.w1[:units, :n_paths, :ffn_width, :c], self.b1[:units, :n_paths, :ffn_width]  # [U, P, F, C]
        w1f = (w1 * ln_weight[:, :, None, :]).flatten(0, 1)  # [G, F, C]
        b1f = (b1 + torch.einsum("upfc,upc->upf", w1, ln_bias)).flatten(0, 1)  # [G, F]
        if torch.is_autocast_enabled(xn.device.type):  # cast once, before the paths share it
            xn = xn.to(torch.get_autocast_dtype(xn.device.type))
        shared = xn.reshape(units, 1, bsz * t, c).expand(units, n_paths, bsz * t, c)
        # one unit: the P paths read the same memory (a stride-0 batch), nothing is copied
        shared = shared[0] if units == 1 else shared.reshape(groups, bsz * t, c)
        hidden = self.dropout(F.relu(torch.baddbmm(b1f[:, None, :], shared, w1f.transpose(1, 2))))  # [G, bt, F]
        w2 = self.w2[:units, :n_paths, :c, :ffn_width].flatten(0, 1)  # [G, C, F]
        b2 = self.b2[:units, :n_paths, :c].flatten(0, 1)  # [G, C]
        return torch.baddbmm(b2[:, None, :], hidden, w2.transpose(1, 2)).view(groups, bsz, t, c)


class PathFusion(nn.Module):
    """The pre-norm wrapper of one sublayer with ``P`` paths, for each of ``U`` units (Multi-Path eq. 4-7).

    ``paths_in(x)`` gives each path of each unit its own layer norm ``LN_i(x_u)``;
    ``fuse(x, ys)`` returns, per unit, ``beta * x + sum_i alpha_i * PathNorm_i(ys_i)``, with
    alpha initialised to ``1/sqrt(2 n)`` (n = the most paths) and beta to 1 (sec. 3.3). With
    ``more_features`` and ``P >= 3``, the ``P`` averages of ``P - 1`` paths (eq. 7, sec. 3.2)
    are added too, each with its own PathNorm and weight. With one path there is no PathNorm
    and no weighting: ``x + ys_0``, the plain pre-norm residual.
    """

    def __init__(self, model_dim: int, max_paths: int = 1, more_features: bool = False, max_units: int = 1) -> None:
        super().__init__()
        self.model_dim = model_dim
        lead = (max_units, max_paths)
        self.ln_weight = nn.Parameter(torch.ones(*lead, model_dim))
        self.ln_bias = nn.Parameter(torch.zeros(*lead, model_dim))
        if max_paths > 1:
            self.pathnorm_weight = nn.Parameter(torch.ones(*lead, model_dim))
            self.pathnorm_bias = nn.Parameter(torch.zeros(*lead, model_dim))
            self.alpha = nn.Parameter(torch.full(lead, 1.0 / math.sqrt(2 * max_paths)))
            self.beta = nn.Parameter(torch.ones(max_units))
        self.more_features = more_features and max_paths >= 3
        if self.more_features:  # the new features' own PathNorms and weights (sec. 3.2)
            self.new_pathnorm_weight = nn.Parameter(torch.ones(*lead, model_dim))
            self.new_pathnorm_bias = nn.Parameter(torch.zeros(*lead, model_dim))
            self.new_alpha = nn.Parameter(torch.full(lead, 1.0 / math.sqrt(2 * max_paths)))

    def paths_in(self, x: torch.Tensor, n_paths: int) -> torch.Tensor:
        """``x [U, b, t, C]`` (per-unit streams) -> ``[U*P, b, t, C]``: ``LN_{u,i}(x_u)`` (eq. 5)."""
        units, c = x.size(0), x.size(-1)
        if n_paths == 1 and units == 1:
            return F.layer_norm(x, (c,), self.ln_weight[0, 0, :c], self.ln_bias[0, 0, :c])
        w, b = self.ln_weight[:units, :n_paths, :c], self.ln_bias[:units, :n_paths, :c]  # [U, P, C]
        normed = torch.addcmul(b[:, :, None, None], F.layer_norm(x, (c,)).unsqueeze(1), w[:, :, None, None])  # [U, P, b, t, C]
        return normed.flatten(0, 1)

    def ln_affine(self, units: int, n_paths: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-path layer-norm weight and bias ``[U, P, C]`` (for :meth:`ElasticFFN.folded`)."""
        return self.ln_weight[:units, :n_paths, :c], self.ln_bias[:units, :n_paths, :c]

    def fuse(self, x: torch.Tensor, ys: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``x [U, b, t, C]``, outputs ``ys [U*P, b, t, C]``, optional drop mask ``keep [U*P, b]`` -> ``[U, b, t, C]``.

        PathNorm runs in the outputs' dtype (bf16 under autocast; statistics accumulate in fp32
        inside the kernel): the P-fold activations are the sublayer's largest element-wise cost.
        """
        units = x.size(0)
        n_paths = ys.size(0) // units
        if keep is not None:
            keep = keep[:, :, None, None].to(ys.dtype)
        if n_paths == 1:
            return x + (ys if keep is None else ys * keep)
        with torch.autocast(x.device.type, enabled=False):
            return self._fuse_paths(x, ys, keep, units, n_paths)

    def _fuse_paths(self, x: torch.Tensor, ys: torch.Tensor, keep: torch.Tensor | None, units: int,
                    n_paths: int) -> torch.Tensor:
        c = x.size(-1)
        ys = ys.view(units, n_paths, *ys.shape[1:])  # [U, P, b, t, C]
        weight, bias = self.pathnorm_weight[:units, :n_paths, :c], self.pathnorm_bias[:units, :n_paths, :c]
        alpha = self.alpha[:units, :n_paths]
        if self.more_features and n_paths >= 3:
            new = (ys.sum(1, keepdim=True) - ys) / (n_paths - 1)  # AVG over the other n-1 paths (eq. 7)
            ys = torch.cat([ys, new], 1)  # [U, 2P, b, t, C]: raw features, then new features
            weight = torch.cat([weight, self.new_pathnorm_weight[:units, :n_paths, :c]], 1)
            bias = torch.cat([bias, self.new_pathnorm_bias[:units, :n_paths, :c]], 1)
            alpha = torch.cat([alpha, self.new_alpha[:units, :n_paths]], 1)
            keep = None if keep is None else keep.view(units, n_paths, *keep.shape[1:]).repeat(1, 2, 1, 1, 1).flatten(0, 1)
        # alpha_i * PathNorm_i(y) = LN(y) * (alpha_i * gamma_i) + alpha_i * beta_i: one fused pass
        weight, bias = (weight * alpha[..., None]).to(ys.dtype), (bias * alpha[..., None]).to(ys.dtype)
        ys = torch.addcmul(bias[:, :, None, None], F.layer_norm(ys, (c,)), weight[:, :, None, None])
        if keep is not None:
            ys = ys * keep.view(*ys.shape[:2], *keep.shape[1:])
        return torch.addcmul(ys.sum(1).to(x.dtype), self.beta[:units, None, None, None], x)


class DynamicConv(nn.Module):
    """Prime's convolution: dynamic depthwise convolutions mixed by a softmax gate (Unified Transformer eq. 5-7).

    For each kernel size k, position-dependent weights ``softmax(W_k x_i + b_k)`` over the k
    taps (eq. 6, one kernel shared by all channels, as in dynamic convolution) are applied to
    the values ``V_C [b, t, D]``, which are the attention's value projection (Shared
    Projection, Fig. 6). Several kernel sizes are mixed by ``softmax(alpha)`` over the chosen
    ones (eq. 7); all of them run as one combined kernel of the largest size over one
    ``unfold`` of V. The output projection ``W_2^C [C, D]`` is cropped to the width.

    Args:
        model_dim: C (channels).
        max_width: D, the widest value width (channels).
        kernel_sizes: the odd kernel sizes this layer supports.
        causal: decoder convolution (taps ``i-k+1 .. i``) instead of centred taps.
    """

    def __init__(self, model_dim: int, max_width: int, kernel_sizes: tuple[int, ...], causal: bool,
                 max_units: int = 1) -> None:
        super().__init__()
        self.causal = causal
        self.gen_weight = nn.ParameterDict({str(k): nn.Parameter(torch.zeros(max_units, k, model_dim)) for k in kernel_sizes})
        self.gen_bias = nn.ParameterDict({str(k): nn.Parameter(torch.zeros(max_units, k)) for k in kernel_sizes})
        self.gate = nn.ParameterDict({str(k): nn.Parameter(torch.zeros(max_units)) for k in kernel_sizes})
        for k in kernel_sizes:
            nn.init.normal_(self.gen_weight[str(k)], 0.0, model_dim ** -0.5)
        self.w_out = nn.Parameter(torch.empty(max_units, model_dim, max_width))
        self.b_out = nn.Parameter(torch.zeros(max_units, model_dim))
        for group in self.w_out.data:
            nn.init.xavier_uniform_(group)

    def kernel(self, x: torch.Tensor, kernels: tuple[int, ...]) -> torch.Tensor:
        """The gated, combined dynamic kernel ``[U, b, t, K]`` (K = the largest chosen size) from ``x [U, b, t, C]``."""
        units, big, c = x.size(0), max(kernels), x.size(-1)
        gate = torch.softmax(torch.stack([self.gate[str(k)][:units] for k in kernels], -1), -1)  # [U, n] eq. 7
        logits = path_project(x, torch.cat([self.gen_weight[str(k)][:units, :, :c] for k in kernels], 1),
                              torch.cat([self.gen_bias[str(k)][:units] for k in kernels], 1))  # [U, b, t, sum k]
        combined = x.new_zeros(*x.shape[:3], big, dtype=logits.dtype)
        for i, (k, part) in enumerate(zip(kernels, logits.split(list(kernels), dim=-1))):
            offset = big - k if self.causal else (big - k) // 2  # align the k taps inside the K window
            combined[..., offset:offset + k] += gate[:, i, None, None, None] * torch.softmax(part, -1)  # eq. 6
        return combined

    def forward(self, x: torch.Tensor, v: torch.Tensor, kernels: tuple[int, ...], pad: torch.Tensor | None = None,
                cache: Cache | None = None) -> torch.Tensor:
        """``x [U, b, t, C]`` (kernel input), ``v [U, b, t, D]`` (values) -> ``[U, b, t, C]``.

        ``pad [b, t]`` zeroes padded values; ``cache`` (causal, incremental) keeps the last
        ``K - 1`` values as ``"v" [U, b, K-1, D]``.
        """
        units, big, width = v.size(0), max(kernels), v.size(-1)
        if pad is not None:
            v = v.masked_fill(pad[None, :, :, None], 0.0)
        left = big - 1 if self.causal else (big - 1) // 2
        right = 0 if self.causal else (big - 1) // 2
        if cache is not None:
            past = cache.get("v")
            if past is None:
                past = v.new_zeros(units, v.size(1), big - 1, width)
            padded = torch.cat([past, v], 2)  # [U, b, K-1+t, D]
            cache["v"] = padded[:, :, padded.size(2) - (big - 1):]
        else:
            padded = F.pad(v, (0, 0, left, right))  # [U, b, left+t+right, D]
        windows = padded.unfold(2, big, 1)  # [U, b, t, D, K]
        out = torch.einsum("ubtk,ubtdk->ubtd", self.kernel(x, kernels).to(v.dtype), windows)
        c = x.size(-1)
        return path_project(out, self.w_out[:units, :c, :width], self.b_out[:units, :c])


def path_ffn(fusion: PathFusion, ffn: ElasticFFN, xu: torch.Tensor, ffn_width: int, n_paths: int) -> torch.Tensor:
    """``FFN(LN_p(x_u))`` of every (unit, path) group, ``xu [U, b, t, C] -> [U*P, b, t, C]`` (Multi-Path eq. 5).

    The plain pre-norm FFN for one unit and one path; otherwise the per-path LN affine is folded
    into the first projection (:meth:`ElasticFFN.folded`).
    """
    units, c = xu.size(0), xu.size(-1)
    if units == 1 and n_paths == 1:
        return ffn(fusion.paths_in(xu, 1), ffn_width, 1)
    return ffn.folded(F.layer_norm(xu, (c,)), *fusion.ln_affine(units, n_paths, c), ffn_width)


def _cut(scale: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    return None if scale is None else scale[..., start:stop]


def unit_bias_kinds(bias: str, units: int) -> list[str]:
    """The bias of each unit: unit 0 always sees the golden input, units 1.. get ``bias``."""
    cycle = ("swap", "disorder", "mask")
    return ["identity"] + [cycle[(u - 1) % 3] if bias == "mixed" else bias for u in range(1, units)]


def apply_unit_bias(x: torch.Tensor, kind: str, lengths: torch.Tensor, mask_embedding: torch.Tensor,
                    switch: torch.Tensor) -> torch.Tensor:
    """One MUTE noise operation per sentence (sec. 3.2), where ``switch [b]`` is True.

    - ``swap``: swap the embeddings at a random position and one up to 3 positions away;
    - ``disorder``: randomly permute a window of 3 consecutive positions;
    - ``mask``: replace one random position with the learned ``mask_embedding [C]``.
    Positions stay inside each sentence (``lengths [b]``, tokens). ``x [b, t, C]`` -> ``[b, t, C]``.
    """
    if kind == "identity":
        return x
    bsz, t, _ = x.shape
    rows = torch.arange(bsz, device=x.device)
    last = (lengths - 1).clamp(min=0)
    pos = torch.minimum((torch.rand(bsz, device=x.device) * lengths).long(), last)
    if kind == "mask":
        out = x.clone()
        out[rows, pos] = mask_embedding.to(x.dtype)
        return torch.where(switch[:, None, None], out, x)
    idx = torch.arange(t, device=x.device).repeat(bsz, 1)  # [b, t]
    if kind == "swap":
        step = torch.randint(1, 4, (bsz,), device=x.device) * (torch.randint(0, 2, (bsz,), device=x.device) * 2 - 1)
        other = torch.minimum((pos + step).clamp(min=0), last)
        idx[rows, pos], idx[rows, other] = other, pos
    elif kind == "disorder":
        start = torch.minimum(pos, (lengths - 3).clamp(min=0))
        perm = torch.argsort(torch.rand(bsz, 3, device=x.device), 1)
        window = start[:, None] + torch.arange(3, device=x.device)  # [b, 3]
        ok = (lengths >= 3)[:, None].expand(-1, 3)
        idx[rows[:, None].expand(-1, 3)[ok], window[ok]] = (start[:, None] + perm)[ok]
    else:
        raise ValueError(f"unknown unit bias {kind!r}; expected one of {', '.join(UNIT_BIASES)}")
    out = x.gather(1, idx[..., None].expand_as(x))
    return torch.where(switch[:, None, None], out, x)


def doubly_normalize(m: torch.Tensor) -> torch.Tensor:
    """AutoShuffle renormalization (MUTE eq. 17-18): clamp at 0, then normalize columns, then rows."""
    m = m.clamp(min=0.0)
    m = m / m.sum(0, keepdim=True).clamp(min=1e-9)
    return m / m.sum(1, keepdim=True).clamp(min=1e-9)


def permutation_penalty(m: torch.Tensor) -> torch.Tensor:
    """Lipschitz penalty pushing ``m`` towards a permutation matrix (MUTE eq. 19); 0 for a permutation."""
    a = m.abs()
    return (a.sum(1) - m.norm(dim=1)).sum() + (a.sum(0) - m.norm(dim=0)).sum()


def _keep(scale: torch.Tensor | None, column: int) -> torch.Tensor | None:
    return None if scale is None else scale[..., column]


class _UnifiedLayer(nn.Module):
    """What encoder and decoder layers share: attention(s), FFN, path fusions, Prime parts and
    the MUTE units around them (DESIGN "The unified layer"):
    ``Layer(x) = combine_u Unit_u(Bias_u(x))`` where a unit is a sequential or a Prime layer."""

    def __init__(self, model_dim: int, heads: int, max_width: int, max_ffn_width: int, max_branches: int,
                 dropout: float, attention_dropout: float, max_paths: int, more_features: bool, layout: str,
                 kernel_sizes: tuple[int, ...], max_units: int, unit_bias_rate: float,
                 sublayers: tuple[str, ...], causal: bool) -> None:
        super().__init__()
        self.layouts = tuple(layout.split("+"))
        self.unit_bias_rate = unit_bias_rate
        for name in sublayers:
            self.add_module(name, MultiBranchAttention(model_dim, max_width, max_branches, heads, attention_dropout,
                                                       max_paths, max_units))
        self.ffn = ElasticFFN(model_dim, max_ffn_width, dropout, max_paths, max_units)
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
        self.dropout = nn.Dropout(dropout)

    def _path_ffn(self, xu: torch.Tensor, ffn_width: int, n_paths: int) -> torch.Tensor:
        return path_ffn(self.ffn_paths, self.ffn, xu, ffn_width, n_paths)

    def _check_layout(self, dims: LayerArch) -> None:
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

    def _combine(self, outs: torch.Tensor, dims: LayerArch) -> torch.Tensor:
        """Units' outputs ``[U, b, t, C]`` -> ``[b, t, C]``: ``sum_u w_u F_u`` (eq. 10/12) or, with sequential
        dependency, ``sum_i w_i G^_i / i`` over the permuted, accumulated outputs (eq. 13-16).
        ``w = alpha / sum(alpha)`` over the chosen units, so every unit count keeps the residual scale."""
        units = dims.units
        if units == 1:
            return outs[0]
        w = self.unit_alpha[:units] / self.unit_alpha[:units].sum()
        if dims.unit_dependency == "sequential":
            m = doubly_normalize(self.shuffle[:units, :units])
            permuted = torch.einsum("ij,ibtc->jbtc", m.to(outs.dtype), outs)  # [G_1..G_I] = M^T [F_1..F_I]
            count = torch.arange(1, units + 1, device=outs.device, dtype=outs.dtype)
            outs = permuted.cumsum(0) / count[:, None, None, None]  # G^_i / i
        return torch.einsum("u,ubtc->btc", w.to(outs.dtype), outs)

    def _prime_norm(self, total: torch.Tensor) -> torch.Tensor:
        """Per-unit LayerNorm of ``[U, b, t, C]`` (the "Add & Norm" of Unified Transformer eq. 4)."""
        units, c = total.size(0), total.size(-1)
        return F.layer_norm(total, (c,)) * self.prime_norm_weight[:units, None, None, :c] \
            + self.prime_norm_bias[:units, None, None, :c]

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
      one unit, one path, one branch, full widths and ``rho = 0`` it is exactly
      ``torch.nn.TransformerEncoderLayer(norm_first=True)`` (ReLU, LayerNorm eps 1e-5).
    - ``prime``: ``LN(x + Attn(x) + Conv_K(x) + FFN(x))`` (Unified Transformer eq. 4), the
      convolution sharing the attention's value projection; Prime-simple (eq. 1) when K is empty.
    - units (MUTE): per-unit input noise in training (sec. 3.2), combined by eq. 10 or with
      sequential dependency (eq. 13-16).

    Args:
        layout: the layouts this layer supports: ``sequential``, ``prime`` or ``sequential+prime``.
        kernel_sizes: convolution kernel sizes it supports (Prime).
        max_units: the most MUTE units; unit_bias_rate: p_beta, the rate biases are switched on.
    """

    def __init__(self, model_dim: int, heads: int, max_width: int, max_ffn_width: int, max_branches: int,
                 dropout: float = 0.1, attention_dropout: float = 0.0, max_paths: int = 1,
                 more_features: bool = False, layout: str = "sequential", kernel_sizes: tuple[int, ...] = (),
                 max_units: int = 1, unit_bias_rate: float = 0.0) -> None:
        super().__init__(model_dim, heads, max_width, max_ffn_width, max_branches, dropout, attention_dropout,
                         max_paths, more_features, layout, kernel_sizes, max_units, unit_bias_rate, ("attn",),
                         causal=False)

    def forward(self, x: torch.Tensor, dims: LayerArch, src_pad: torch.Tensor | None,
                drop_branch: float = 0.0) -> torch.Tensor:
        """``x [b, s, C]``, the layer's choices ``dims``, ``src_pad [b, s]`` -> ``[b, s, C]``."""
        self._check_layout(dims)
        units, nb = dims.units, dims.branches
        n_paths = dims.paths if dims.layout == "sequential" else 1
        lengths = None if src_pad is None else (~src_pad).sum(1)
        xu = self._unit_inputs(x, dims, lengths)  # [U, b, s, C]
        rho = drop_branch if self.training else 0.0
        scale = drop_mask((units * n_paths, x.size(0), nb + 1), rho, x.device)  # per group: branches, FFN
        attn = dict(width=dims.width, branches=nb, key_pad=src_pad, branch_scale=_cut(scale, 0, nb), units=units)
        if dims.layout == "prime":
            values: list = []
            total = xu + self.dropout(self.attn(xu, values=values, **attn))
            if dims.kernels:
                total = total + self.dropout(self.conv(xu, values[0], dims.kernels, src_pad))
            keep = _keep(scale, nb)
            y = self.dropout(self.ffn(xu, dims.ffn_width, units))
            total = total + (y if keep is None else y * keep[:, :, None, None].to(y.dtype))
            return self._combine(self._prime_norm(total), dims)
        xu = self.attn_paths.fuse(xu, self.dropout(self.attn(self.attn_paths.paths_in(xu, n_paths), **attn)))
        ys = self.dropout(self._path_ffn(xu, dims.ffn_width, n_paths))
        return self._combine(self.ffn_paths.fuse(xu, ys, _keep(scale, nb)), dims)


class DecoderLayer(_UnifiedLayer):
    """Decoder layer: ``combine_u Unit_u(x)`` over U MUTE units, each unit in one of two layouts.

    - ``sequential``: causal self-attention, cross-attention and FFN, each a multi-path
      sublayer (Multi-Path eq. 4-6) with multi-branch attention (MAT eq. 6-7); the
      cross-attention uses the same width, branches and paths as the self-attention. With one
      unit, path and branch, full widths and ``rho = 0`` it equals
      ``torch.nn.TransformerDecoderLayer(norm_first=True)``.
    - ``prime``: ``LN(x + SelfAttn(x) + Cross(x, memory) + CausalConv_K(x) + FFN(x))``
      (Unified Transformer eq. 4 with the decoder's cross-attention in parallel, Fig. 1).
    - units: combined as in the encoder. Decoder units get no input noise: swapping or
      reordering target positions would show a unit the tokens it must predict.
    """

    def __init__(self, model_dim: int, heads: int, max_width: int, max_ffn_width: int, max_branches: int,
                 dropout: float = 0.1, attention_dropout: float = 0.0, max_paths: int = 1,
                 more_features: bool = False, layout: str = "sequential", kernel_sizes: tuple[int, ...] = (),
                 max_units: int = 1, unit_bias_rate: float = 0.0) -> None:
        super().__init__(model_dim, heads, max_width, max_ffn_width, max_branches, dropout, attention_dropout,
                         max_paths, more_features, layout, kernel_sizes, max_units, unit_bias_rate,
                         ("self_attn", "cross_attn"), causal=True)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, dims: LayerArch,
                src_pad: torch.Tensor | None, drop_branch: float = 0.0, cache: Cache | None = None) -> torch.Tensor:
        """``x [b, t, C]``, ``memory [b, s, C]`` -> ``[b, t, C]``.

        With ``cache`` (incremental decoding), ``x`` holds only the newest position(s) and
        the self-attention (and the causal convolution) continue from the cached state.
        """
        self._check_layout(dims)
        units, nb = dims.units, dims.branches
        n_paths = dims.paths if dims.layout == "sequential" else 1
        xu = self._unit_inputs(x, dims, None)  # [U, b, t, C]
        rho = drop_branch if self.training else 0.0
        scale = drop_mask((units * n_paths, x.size(0), 2 * nb + 1), rho, x.device)  # self, cross branches, FFN
        part = (lambda name: None) if cache is None else (lambda name: cache.setdefault(name, {}))
        self_kw = dict(width=dims.width, branches=nb, causal=cache is None, branch_scale=_cut(scale, 0, nb),
                       cache=part("self"), units=units)
        cross_kw = dict(width=dims.width, branches=nb, memory=memory, key_pad=src_pad,
                        branch_scale=_cut(scale, nb, 2 * nb), cache=part("cross"), units=units)
        if dims.layout == "prime":
            values: list = []
            total = xu + self.dropout(self.self_attn(xu, values=values, **self_kw))
            total = total + self.dropout(self.cross_attn(xu, **cross_kw))
            if dims.kernels:
                total = total + self.dropout(self.conv(xu, values[0], dims.kernels, cache=part("conv")))
            keep = _keep(scale, 2 * nb)
            y = self.dropout(self.ffn(xu, dims.ffn_width, units))
            total = total + (y if keep is None else y * keep[:, :, None, None].to(y.dtype))
            return self._combine(self._prime_norm(total), dims)
        xu = self.self_attn_paths.fuse(xu, self.dropout(self.self_attn(self.self_attn_paths.paths_in(xu, n_paths), **self_kw)))
        xu = self.cross_attn_paths.fuse(xu, self.dropout(self.cross_attn(self.cross_attn_paths.paths_in(xu, n_paths), **cross_kw)))
        ys = self.dropout(self._path_ffn(xu, dims.ffn_width, n_paths))
        return self._combine(self.ffn_paths.fuse(xu, ys, _keep(scale, 2 * nb)), dims)


# ---------------------------------------------------------------------------
# Incremental decoding: one decoder layer's weights cropped once, its state preallocated
# ---------------------------------------------------------------------------

Packed = tuple[torch.Tensor, torch.Tensor | None]


def _pack(weight: torch.Tensor, bias: torch.Tensor | None) -> Packed:
    """Per-group ``weight [G, K, C]``, ``bias [G, K]`` -> the form :func:`_apply` reads: ``[K, C]``/``[K]``
    (contiguous, for ``F.linear``) for one group, else ``weight^T [G, C, K]``/``bias [G, 1, K]`` (for ``baddbmm``)."""
    if weight.size(0) == 1:
        return weight[0].contiguous(), None if bias is None else bias[0].contiguous()
    return weight.transpose(1, 2), None if bias is None else bias[:, None, :]


def _apply(xs: torch.Tensor, packed: Packed) -> torch.Tensor:
    """The per-group linear map of :func:`path_project` on pre-packed weights: ``[G, n, t, C] -> [G, n, t, K]``."""
    weight, bias = packed
    if weight.dim() == 2:
        return F.linear(xs, weight, bias)
    groups, n, t, c = xs.shape
    flat = xs.reshape(groups, n * t, c)
    out = torch.bmm(flat, weight) if bias is None else torch.baddbmm(bias, flat, weight)
    return out.view(groups, n, t, -1)


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of one (pre-scaled) query per row: ``q [N, 1, dh]``, ``k, v [N, T, dh]``, additive
    ``mask [N, 1, T]`` -> ``[N, 1, dh]``, ``softmax(q k^T + mask) v`` (two ``bmm``: for one query
    the fused attention kernel's setup costs more than the products)."""
    kt = k.transpose(1, 2)  # [N, dh, T]
    scores = torch.bmm(q, kt) if mask is None else torch.baddbmm(mask, q, kt)  # [N, 1, T]
    return torch.bmm(torch.softmax(scores, -1), v)


class _AttentionStep:
    """One :class:`MultiBranchAttention` cropped to ``width``/``branches``/``units`` x ``paths`` groups
    for one-position steps; self-attention keys/values go into preallocated buffers."""

    def __init__(self, attn: MultiBranchAttention, units: int, groups: int, branches: int, width: int, c: int) -> None:
        nb, paths = branches, groups // units
        self.groups, self.nb, self.width, self.heads = groups, nb, width, attn.heads
        self.dh = width // attn.heads
        w_in = attn.w_in[:units, :paths, :nb, :, :width, :c].flatten(0, 1)  # [G, B, 3, D, C]
        b_in = attn.b_in[:units, :paths, :nb, :, :width].flatten(0, 1)  # [G, B, 3, D]
        self.w_in, self.b_in = w_in, b_in
        # the attention scale 1/sqrt(d_h) folded into the query projection
        scale = torch.tensor([self.dh ** -0.5, 1.0, 1.0], dtype=w_in.dtype, device=w_in.device)[:, None]  # [3, 1]
        w_in, b_in = w_in * scale[..., None], b_in * scale
        # rows reordered (q, k, v) x branch x D: each of q, k, v is one block of the projection
        self.qkv = _pack(w_in.transpose(1, 2).reshape(groups, 3 * nb * width, c), b_in.transpose(1, 2).reshape(groups, -1))
        self.q = _pack(w_in[:, :, 0].reshape(groups, nb * width, c), b_in[:, :, 0].reshape(groups, -1))
        w_out = attn.w_out[:units, :paths, :nb, :c, :width].flatten(0, 1)  # [G, B, C, D]
        w_out = w_out.permute(0, 2, 1, 3).reshape(groups, c, nb * width)  # [G, C, B*D]
        b_out = attn.b_out[:units, :paths, :nb, :c].flatten(0, 1)  # [G, B, C]
        self.out = _pack(w_out if nb == 1 else w_out / nb, b_out[:, 0] if nb == 1 else b_out.mean(1))

    def self_step(self, xs: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, pos: int,
                  values: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``xs [G, n, 1, C]`` at position ``pos``; ``k_buf, v_buf [G, n, B*h, T_max, dh]`` receive its key/value.
        Returns ``[G, n, 1, C]`` and, with ``values``, branch 0's values ``[G, n, 1, D]`` (Prime's ``V_C``)."""
        g, n = xs.size(0), xs.size(1)
        bd, bh, dh = self.nb * self.width, self.nb * self.heads, self.dh
        qkv = _apply(xs, self.qkv)  # [G, n, 1, 3*B*D]
        q, k, v = qkv[..., :bd], qkv[..., bd:2 * bd], qkv[..., 2 * bd:]  # each [G, n, 1, B*D]
        k_buf[:, :, :, pos] = k.view(g, n, bh, dh)
        v_buf[:, :, :, pos] = v.view(g, n, bh, dh)
        rows, t_max = g * n * bh, k_buf.size(3)
        o = _attend_one(q.reshape(rows, 1, dh), k_buf.view(rows, t_max, dh)[:, :pos + 1],
                        v_buf.view(rows, t_max, dh)[:, :pos + 1], None)  # [N, 1, dh]
        return _apply(o.view(g, n, 1, bd), self.out), (v[..., :self.width] if values else None)

    def cross_kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``memory [n, s, C]`` for every group: each ``[G, n, B*h, s, dh]``."""
        g, nb, width = self.groups, self.nb, self.width
        n, s, c = memory.shape
        kv = F.linear(memory, self.w_in[:, :, 1:].reshape(g * nb * 2 * width, c), self.b_in[:, :, 1:].reshape(-1))
        kv = kv.view(n, s, g, nb, 2, width).permute(2, 0, 1, 3, 4, 5)  # [G, n, s, B, 2, D]
        k, v = kv.unbind(4)  # each [G, n, s, B, D]
        heads = lambda z: z.reshape(g, n, s, nb * self.heads, self.dh).transpose(2, 3).contiguous()
        return heads(k), heads(v)  # [G, n, B*h, s, dh]

    def cross_step(self, xs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``xs [G, n, 1, C]`` attends to cached ``k, v [G, n, B*h, s, dh]`` (additive ``mask [N, 1, s]``) -> ``[G, n, 1, C]``."""
        g, n = xs.size(0), xs.size(1)
        rows, s, dh = g * n * self.nb * self.heads, k.size(3), self.dh
        q = _apply(xs, self.q)  # [G, n, 1, B*D]
        o = _attend_one(q.view(rows, 1, dh), k.view(rows, s, dh), v.view(rows, s, dh), mask)
        return _apply(o.view(g, n, 1, self.nb * self.width), self.out)


class IncrementalLayer:
    """A :class:`DecoderLayer` cropped to one layer arch ``dims`` at model width ``C``, with the
    state of incremental (key/value-cached) decoding for a batch of ``n`` rows.

    Every weight is cropped (and, for several groups, stacked and transposed) once here, not at
    each step; the self-attention keys/values go into preallocated ``[G, n, B*h, T_max, dh]``
    buffers (doubled when full); the cross-attention keys/values of ``memory`` are computed once;
    Prime's causal convolution keeps its last ``K - 1`` values. Each :meth:`step` then equals
    ``DecoderLayer.forward`` at the newest position (eval mode: no dropout, no drop-branch).

    Args:
        layer: the decoder layer.
        dims: its choices (width, FFN width, branches, paths, layout, kernels, units, dependency).
        memory: encoder output ``[n, s, C]``.
        src_pad: ``[n, s]`` bool, True at padding.
        max_len: expected target length (tokens), the initial buffer length.

    Raises:
        ValueError: ``dims.layout`` is not built in ``layer``.
    """

    def __init__(self, layer: "DecoderLayer", dims: LayerArch, memory: torch.Tensor, src_pad: torch.Tensor | None,
                 max_len: int = 64) -> None:
        layer._check_layout(dims)
        self.layer, self.dims = layer, dims
        c, n = memory.size(-1), memory.size(0)
        self.c, self.units = c, dims.units
        self.paths = paths = dims.paths if dims.layout == "sequential" else 1
        self.prime = dims.layout == "prime"
        groups = dims.units * paths
        self.self_attn = _AttentionStep(layer.self_attn, dims.units, groups, dims.branches, dims.width, c)
        self.cross_attn = _AttentionStep(layer.cross_attn, dims.units, groups, dims.branches, dims.width, c)
        shape = (groups, n, dims.branches * layer.self_attn.heads, max(max_len, 1), self.self_attn.dh)
        self.k = memory.new_zeros(shape)  # [G, n, B*h, T_max, dh]
        self.v = memory.new_zeros(shape)
        self.ck, self.cv = self.cross_attn.cross_kv(memory)  # [G, n, B*h, s, dh]
        self.pad = src_pad if src_pad is not None and bool(src_pad.any()) else None  # [n, s]
        self.mask = self._mask()
        self._prepare_ffn(layer, dims, c)
        if self.prime:
            self.norm_w = layer.prime_norm_weight[:dims.units, None, None, :c]  # [U, 1, 1, C]
            self.norm_b = layer.prime_norm_bias[:dims.units, None, None, :c]
            if dims.kernels:
                self._prepare_conv(layer.conv, dims, c, n, memory)
        else:
            self.ln = {name: self._path_ln(getattr(layer, f"{name}_paths"), dims.units, paths, c)
                       for name in ("self_attn", "cross_attn", "ffn")}
        if dims.units > 1:
            self.unit_w = layer.unit_alpha[:dims.units] / layer.unit_alpha[:dims.units].sum()  # [U]
            self.shuffle = doubly_normalize(layer.shuffle[:dims.units, :dims.units]) \
                if dims.unit_dependency == "sequential" else None

    @staticmethod
    def _path_ln(fusion: PathFusion, units: int, paths: int, c: int) -> Packed:
        if units == 1 and paths == 1:
            return fusion.ln_weight[0, 0, :c].contiguous(), fusion.ln_bias[0, 0, :c].contiguous()
        w, b = fusion.ln_affine(units, paths, c)  # [U, P, C]
        return w[:, :, None, None], b[:, :, None, None]  # [U, P, 1, 1, C]

    def _mask(self) -> torch.Tensor | None:
        """Additive cross-attention mask ``[N, 1, s]`` (-inf at padding), None without padding."""
        if self.pad is None:
            return None
        g, n, bh, s = self.ck.size(0), self.ck.size(1), self.ck.size(2), self.ck.size(3)
        add = torch.zeros(self.pad.shape, dtype=self.ck.dtype, device=self.ck.device).masked_fill(self.pad, float("-inf"))
        return add[None, :, None, None, :].expand(g, n, bh, 1, s).reshape(g * n * bh, 1, s)

    def _prepare_ffn(self, layer: "DecoderLayer", dims: LayerArch, c: int) -> None:
        ffn, u, f = layer.ffn, dims.units, dims.ffn_width
        p = self.paths
        self.folded = not self.prime and (u > 1 or p > 1)
        if self.folded:  # ElasticFFN.folded with the per-path LN affine folded in once
            w1, b1 = ffn.w1[:u, :p, :f, :c], ffn.b1[:u, :p, :f]  # [U, P, F, C]
            ln_w, ln_b = layer.ffn_paths.ln_affine(u, p, c)
            w1f = (w1 * ln_w[:, :, None, :]).flatten(0, 1)  # [G, F, C]
            b1f = (b1 + torch.einsum("upfc,upc->upf", w1, ln_b)).flatten(0, 1)  # [G, F]
            self.ffn1 = (w1f.transpose(1, 2), b1f[:, None, :])
        else:
            self.ffn1 = _pack(ffn.w1[:u, :p, :f, :c].flatten(0, 1), ffn.b1[:u, :p, :f].flatten(0, 1))
        self.ffn2 = _pack(ffn.w2[:u, :p, :c, :f].flatten(0, 1), ffn.b2[:u, :p, :c].flatten(0, 1))

    def _prepare_conv(self, conv: DynamicConv, dims: LayerArch, c: int, n: int, memory: torch.Tensor) -> None:
        u, kernels = dims.units, dims.kernels
        big = max(kernels)
        self.conv_gate = torch.softmax(torch.stack([conv.gate[str(k)][:u] for k in kernels], -1), -1)  # [U, n_k]
        self.conv_gen = _pack(torch.cat([conv.gen_weight[str(k)][:u, :, :c] for k in kernels], 1),
                              torch.cat([conv.gen_bias[str(k)][:u] for k in kernels], 1))  # [U, sum k, C]
        self.conv_out = _pack(conv.w_out[:u, :c, :dims.width], conv.b_out[:u, :c])
        self.conv_v = memory.new_zeros(u, n, big - 1, dims.width)  # the last K-1 values [U, n, K-1, D]

    def _conv_step(self, xu: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal dynamic convolution (Unified Transformer eq. 5-7) at the newest position:
        ``xu [U, n, 1, C]``, values ``v [U, n, 1, D]`` -> ``[U, n, 1, C]``."""
        kernels = self.dims.kernels
        big = max(kernels)
        logits = _apply(xu, self.conv_gen)  # [U, n, 1, sum k]
        if len(kernels) == 1:
            kernel = torch.softmax(logits, -1) * self.conv_gate[:, 0, None, None, None]  # [U, n, 1, K]
        else:
            kernel = xu.new_zeros(*xu.shape[:3], big, dtype=logits.dtype)
            for i, (k, part) in enumerate(zip(kernels, logits.split(list(kernels), dim=-1))):
                kernel[..., big - k:] += self.conv_gate[:, i, None, None, None] * torch.softmax(part, -1)  # eq. 6
        window = torch.cat([self.conv_v, v], 2)  # [U, n, K, D]
        self.conv_v = window[:, :, 1:]
        return _apply(torch.matmul(kernel.to(v.dtype), window), self.conv_out)  # [U, n, 1, D] -> C

    def _paths_in(self, xu: torch.Tensor, name: str) -> torch.Tensor:
        """``LN_{u,p}(x_u)``: ``[U, n, 1, C] -> [G, n, 1, C]`` (:meth:`PathFusion.paths_in`)."""
        w, b = self.ln[name]
        if w.dim() == 1:
            return F.layer_norm(xu, (self.c,), w, b)
        return torch.addcmul(b, F.layer_norm(xu, (self.c,)).unsqueeze(1), w).flatten(0, 1)

    def _fuse(self, xu: torch.Tensor, ys: torch.Tensor, name: str) -> torch.Tensor:
        return xu + ys if self.paths == 1 else getattr(self.layer, f"{name}_paths").fuse(xu, ys)

    def _ffn(self, xu: torch.Tensor) -> torch.Tensor:
        """The FFN of every group: ``[U, n, 1, C] -> [G, n, 1, C]`` (pre-norm unless Prime)."""
        if self.prime:
            return _apply(F.relu(_apply(xu, self.ffn1)), self.ffn2)
        if not self.folded:
            return _apply(F.relu(_apply(self._paths_in(xu, "ffn"), self.ffn1)), self.ffn2)
        u, n, t, c = xu.shape
        xn = F.layer_norm(xu, (c,))
        if torch.is_autocast_enabled(xn.device.type):
            xn = xn.to(torch.get_autocast_dtype(xn.device.type))
        groups = self.ffn1[0].size(0)
        shared = xn.reshape(u, 1, n * t, c).expand(u, groups // u, n * t, c)
        shared = shared[0] if u == 1 else shared.reshape(groups, n * t, c)
        hidden = F.relu(torch.baddbmm(self.ffn1[1], shared, self.ffn1[0]))  # [G, n, F]
        return torch.baddbmm(self.ffn2[1], hidden, self.ffn2[0]).view(groups, n, t, c)

    def _combine(self, outs: torch.Tensor) -> torch.Tensor:
        """Units' outputs ``[U, n, 1, C] -> [n, 1, C]`` (:meth:`_UnifiedLayer._combine`)."""
        if self.units == 1:
            return outs[0]
        if self.shuffle is not None:
            permuted = torch.einsum("ij,ibtc->jbtc", self.shuffle.to(outs.dtype), outs)
            count = torch.arange(1, self.units + 1, device=outs.device, dtype=outs.dtype)
            outs = permuted.cumsum(0) / count[:, None, None, None]
        return torch.einsum("u,ubtc->btc", self.unit_w.to(outs.dtype), outs)

    def step(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """``x [n, 1, C]``, the newest position ``pos`` (0-based) -> ``[n, 1, C]``."""
        if pos >= self.k.size(3):  # grow the key/value buffers (doubling)
            self.k, self.v = (torch.cat([b, torch.zeros_like(b)], 3) for b in (self.k, self.v))
        xu = x[None] if self.units == 1 else x[None].expand(self.units, -1, -1, -1)  # [U, n, 1, C]
        if self.prime:
            y, values = self.self_attn.self_step(xu, self.k, self.v, pos, values=True)
            total = xu + y + self.cross_attn.cross_step(xu, self.ck, self.cv, self.mask)
            if self.dims.kernels:
                total = total + self._conv_step(xu, values)
            total = total + self._ffn(xu)
            normed = F.layer_norm(total, (self.c,)) * self.norm_w + self.norm_b  # Unified Transformer eq. 4
            return self._combine(normed)
        y, _ = self.self_attn.self_step(self._paths_in(xu, "self_attn"), self.k, self.v, pos)
        xu = self._fuse(xu, y, "self_attn")
        xu = self._fuse(xu, self.cross_attn.cross_step(self._paths_in(xu, "cross_attn"), self.ck, self.cv, self.mask),
                        "cross_attn")
        return self._combine(self._fuse(xu, self._ffn(xu), "ffn"))

    def reorder(self, index: torch.Tensor, length: int, sentences: torch.Tensor | None = None) -> None:
        """Keep rows ``index [n']`` of the per-hypothesis state (keys/values of the first ``length``
        positions, the convolution window) and, when ``sentences [n']`` is given, of the
        cross-attention keys/values and mask (finished sentences leaving the batch)."""
        if index.numel() == self.k.size(1):  # same row count: reorder the filled prefix in place
            self.k[:, :, :, :length] = self.k[:, :, :, :length].index_select(1, index)
            self.v[:, :, :, :length] = self.v[:, :, :, :length].index_select(1, index)
        else:
            self.k, self.v = self.k.index_select(1, index), self.v.index_select(1, index)
        if self.prime and self.dims.kernels:
            self.conv_v = self.conv_v.index_select(1, index)
        if sentences is not None:
            self.ck, self.cv = self.ck.index_select(1, sentences), self.cv.index_select(1, sentences)
            if self.pad is not None:
                self.pad = self.pad.index_select(0, sentences)
                self.mask = self._mask()
