"""Elastic building blocks of the supernet: every weight is cropped by explicit dimensions.

Cropping follows Scalable Transformers (sec. 3.1): a narrower layer uses the top-left
sub-matrix ``W[1:C, 1:D]`` and the first ``D`` entries of each bias. Branches follow the
Multi-branch Attentive Transformer (MAT): ``N_a`` independent multi-head attentions whose
outputs are averaged (eq. 4), each dropped with rate ``rho`` in training (drop-branch,
eq. 5-6), and drop-branch on the FFN (eq. 7). Paths follow the Multi-Path Transformer:
``n`` parallel pre-norm paths per sublayer, each ending in a PathNorm, fused as
``beta * x + sum_i alpha_i * Path_i(x)`` (eq. 4-6).

Paths and branches of a sublayer run as ONE batched matrix product (their weights are
stacked: ``[paths, branches, ...]``), never as a Python loop over modules. Activations
inside a sublayer are laid out ``[P, b, t, ...]`` (paths first).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["MultiBranchAttention", "ElasticFFN", "PathFusion", "EncoderLayer", "DecoderLayer",
           "sinusoidal_positions", "drop_mask", "path_project"]

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
    """Per-path linear map: ``xs [P, b, t, C]``, ``weight [P, K, C]``, ``bias [P, K]`` -> ``[P, b, t, K]``.

    One ``F.linear`` for a single path, else one ``baddbmm`` over all paths.
    """
    n_paths, bsz, t, c = xs.shape
    if n_paths == 1:
        return F.linear(xs, weight[0], None if bias is None else bias[0])
    flat = xs.reshape(n_paths, bsz * t, c)
    out = torch.bmm(flat, weight.transpose(1, 2)) if bias is None else torch.baddbmm(bias[:, None, :], flat, weight.transpose(1, 2))
    return out.view(n_paths, bsz, t, -1)


class MultiBranchAttention(nn.Module):
    """``N_a`` branches of multi-head attention, averaged (MAT eq. 4 without the residual), per path.

    Weights are stacked over paths and branches: ``w_in [P, N_a, 3, D, C]`` (q, k, v) and
    ``w_out [P, N_a, C, D]``, where C is the model width and D the widest attention width.
    A call with ``paths=P_l, branches=B_l, width=D_l`` uses the leading block
    ``w_in[:P_l, :B_l, :, :D_l, :]`` (top-left crop, Scalable Transformers sec. 3.1).
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
                 max_paths: int = 1) -> None:
        super().__init__()
        if max_width % heads:
            raise ValueError(f"attention width {max_width} is not divisible by heads={heads}")
        self.model_dim, self.max_width, self.max_branches, self.heads = model_dim, max_width, max_branches, heads
        self.dropout = dropout
        self.w_in = nn.Parameter(torch.empty(max_paths, max_branches, 3, max_width, model_dim))
        self.b_in = nn.Parameter(torch.zeros(max_paths, max_branches, 3, max_width))
        self.w_out = nn.Parameter(torch.empty(max_paths, max_branches, model_dim, max_width))
        self.b_out = nn.Parameter(torch.zeros(max_paths, max_branches, model_dim))
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
    ) -> torch.Tensor:
        """Attend each path's queries to themselves (``memory=None``) or to ``memory``.

        Args:
            xs: per-path queries ``[P, b, t, C]`` (P paths are used).
            width: attention width D_l (channels, divisible by heads).
            branches: number of branches B_l.
            memory: keys/values source ``[b, s, C]`` for cross-attention (shared by all paths).
            key_pad: ``[b, s]`` bool, True where the key is padding.
            causal: mask future positions (decoder self-attention over a full sequence).
            branch_scale: drop-branch keep mask ``[P, b, B_l]`` (MAT eq. 5), or None.
            cache: incremental decoding state, updated in place: self-attention appends
                ``k``/``v`` ``[P, b, B_l*h, t_so_far, d_h]``; cross-attention stores ``ck``/``cv`` once.
        Returns:
            ``[P, b, t, C]``: per path ``1/B_l * sum_i beta_i * MHA_i`` (MAT eq. 4/6; residual added by the caller).
        """
        n_paths, bsz, t, c = xs.shape
        nb = branches
        w_in, b_in = self.w_in[:n_paths, :nb, :, :width], self.b_in[:n_paths, :nb, :, :width]  # [P, B, 3, D, C]
        if memory is None:
            qkv = path_project(xs, w_in.reshape(n_paths, nb * 3 * width, c), b_in.reshape(n_paths, -1))
            q, k, v = qkv.view(n_paths, bsz, t, nb, 3, width).unbind(4)  # each [P, b, t, B, D]
            k, v = self._heads(k), self._heads(v)  # [P, b, B*h, t, dh]
            if cache is not None:
                if "k" in cache:
                    k, v = torch.cat([cache["k"], k], 3), torch.cat([cache["v"], v], 3)
                cache["k"], cache["v"] = k, v
        else:
            q = path_project(xs, w_in[:, :, 0].reshape(n_paths, nb * width, c), b_in[:, :, 0].reshape(n_paths, -1))
            q = q.view(n_paths, bsz, t, nb, width)
            if cache is not None and "ck" in cache:
                k, v = cache["ck"], cache["cv"]
            else:
                s = memory.size(1)  # memory is shared by the paths: one matmul for all of them
                kv = F.linear(memory, w_in[:, :, 1:].reshape(n_paths * nb * 2 * width, c), b_in[:, :, 1:].reshape(-1))
                kv = kv.view(bsz, s, n_paths, nb, 2, width).permute(2, 0, 1, 3, 4, 5)  # [P, b, s, B, 2, D]
                k, v = kv.unbind(4)  # each [P, b, s, B, D]
                k, v = self._heads(k), self._heads(v)  # [P, b, B*h, s, dh]
                if cache is not None:
                    cache["ck"], cache["cv"] = k, v
        q = self._heads(q)  # [P, b, B*h, t, dh]
        mask = None if key_pad is None else ~key_pad[None, :, None, None, :]  # [1, b, 1, 1, s], True = attend
        with sdpa_kernel(_CPU_BACKENDS if q.device.type == "cpu" else _ALL_BACKENDS):
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                dropout_p=self.dropout if self.training else 0.0,
            )  # [P, b, B*h, t, dh]
        o = o.transpose(2, 3).reshape(n_paths, bsz, t, nb, width)  # [P, b, t, B, D]
        w_out = self.w_out[:n_paths, :nb, :, :width].permute(0, 2, 1, 3).reshape(n_paths, c, nb * width)  # [P, C, B*D]
        if branch_scale is None:  # the 1/B average folded into the (small) weight, not the activations
            w_out = w_out if nb == 1 else w_out / nb
            return path_project(o.reshape(n_paths, bsz, t, nb * width), w_out, self.b_out[:n_paths, :nb].mean(1))
        scale = branch_scale / nb  # [P, b, B]
        o = o * scale[:, :, None, :, None].to(o.dtype)
        b_out = torch.einsum("pbk,pkc->pbc", scale, self.b_out[:n_paths, :nb])[:, :, None, :]  # [P, b, 1, C]
        return path_project(o.reshape(n_paths, bsz, t, nb * width), w_out, None) + b_out

    def _heads(self, z: torch.Tensor) -> torch.Tensor:
        """``[P, b, t, B, D] -> [P, b, B*h, t, D/h]``: branches become extra attention heads."""
        n_paths, bsz, t, nb, width = z.shape
        return z.reshape(n_paths, bsz, t, nb * self.heads, width // self.heads).transpose(2, 3)


class ElasticFFN(nn.Module):
    """Position-wise FFN ``ReLU(x W1^T + b1) W2^T + b2`` (Scalable Transformers eq. 2) per path.

    ``w1 [P, F, C]`` and ``w2 [P, C, F]``; a call with ``ffn_width=F_l`` on P paths uses
    ``w1[:P, :F_l]`` and ``w2[:P, :, :F_l]``.
    """

    def __init__(self, model_dim: int, max_ffn_width: int, dropout: float = 0.0, max_paths: int = 1) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(max_paths, max_ffn_width, model_dim))
        self.b1 = nn.Parameter(torch.zeros(max_paths, max_ffn_width))
        self.w2 = nn.Parameter(torch.empty(max_paths, model_dim, max_ffn_width))
        self.b2 = nn.Parameter(torch.zeros(max_paths, model_dim))
        for p in range(max_paths):
            nn.init.xavier_uniform_(self.w1.data[p])
            nn.init.xavier_uniform_(self.w2.data[p])
        self.dropout = nn.Dropout(dropout)

    def forward(self, xs: torch.Tensor, ffn_width: int) -> torch.Tensor:
        """``[P, b, t, C] -> [P, b, t, C]``."""
        n_paths = xs.size(0)
        hidden = F.relu(path_project(xs, self.w1[:n_paths, :ffn_width], self.b1[:n_paths, :ffn_width]))  # [P, b, t, F_l]
        return path_project(self.dropout(hidden), self.w2[:n_paths, :, :ffn_width], self.b2[:n_paths])


class PathFusion(nn.Module):
    """The pre-norm wrapper of one sublayer with ``P`` paths (Multi-Path Transformer eq. 4-7).

    ``paths_in(x)`` gives each path its own layer norm ``LN_i(x)`` as ``[P, b, t, C]``;
    ``fuse(x, ys)`` returns ``beta * x + sum_i alpha_i * PathNorm_i(ys_i)``, with alpha
    initialised to ``1/sqrt(2 n)`` (n = the most paths) and beta to 1 (sec. 3.3). With
    ``more_features`` and ``P >= 3``, the ``P`` averages of ``P - 1`` paths (eq. 7, sec. 3.2)
    are added too, each with its own PathNorm and weight. With one path there is no PathNorm
    and no weighting: ``x + ys_0``, the plain pre-norm residual.
    """

    def __init__(self, model_dim: int, max_paths: int = 1, more_features: bool = False) -> None:
        super().__init__()
        self.model_dim = model_dim
        self.ln_weight = nn.Parameter(torch.ones(max_paths, model_dim))
        self.ln_bias = nn.Parameter(torch.zeros(max_paths, model_dim))
        if max_paths > 1:
            self.pathnorm_weight = nn.Parameter(torch.ones(max_paths, model_dim))
            self.pathnorm_bias = nn.Parameter(torch.zeros(max_paths, model_dim))
            self.alpha = nn.Parameter(torch.full((max_paths,), 1.0 / math.sqrt(2 * max_paths)))
            self.beta = nn.Parameter(torch.ones(()))
        self.more_features = more_features and max_paths >= 3
        if self.more_features:  # the new features' own PathNorms and weights (sec. 3.2)
            self.new_pathnorm_weight = nn.Parameter(torch.ones(max_paths, model_dim))
            self.new_pathnorm_bias = nn.Parameter(torch.zeros(max_paths, model_dim))
            self.new_alpha = nn.Parameter(torch.full((max_paths,), 1.0 / math.sqrt(2 * max_paths)))

    def paths_in(self, x: torch.Tensor, n_paths: int) -> torch.Tensor:
        """``x [b, t, C]`` -> ``[P, b, t, C]``: ``LN_i(x)`` for the first ``n_paths`` paths (eq. 5)."""
        c = self.model_dim
        if n_paths == 1:
            return F.layer_norm(x, (c,), self.ln_weight[0], self.ln_bias[0]).unsqueeze(0)
        return F.layer_norm(x, (c,)).unsqueeze(0) * self.ln_weight[:n_paths, None, None] + self.ln_bias[:n_paths, None, None]

    def fuse(self, x: torch.Tensor, ys: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``x [b, t, C]``, path outputs ``ys [P, b, t, C]``, optional drop mask ``keep [P, b]`` -> ``[b, t, C]``."""
        n_paths = ys.size(0)
        if n_paths == 1:
            return x + (ys[0] if keep is None else ys[0] * keep[0, :, None, None].to(ys.dtype))
        weight, bias, alpha = self.pathnorm_weight[:n_paths], self.pathnorm_bias[:n_paths], self.alpha[:n_paths]
        if self.more_features and n_paths >= 3:
            new = (ys.sum(0, keepdim=True) - ys) / (n_paths - 1)  # AVG over the other n-1 paths (eq. 7)
            ys = torch.cat([ys, new])  # [2P, b, t, C]: raw features, then new features
            weight = torch.cat([weight, self.new_pathnorm_weight[:n_paths]])
            bias = torch.cat([bias, self.new_pathnorm_bias[:n_paths]])
            alpha = torch.cat([alpha, self.new_alpha[:n_paths]])
            keep = None if keep is None else keep.repeat(2, 1)
        ys = F.layer_norm(ys, (self.model_dim,)) * weight[:, None, None] + bias[:, None, None]  # PathNorm
        ys = ys * alpha[:, None, None, None]
        if keep is not None:
            ys = ys * keep[:, :, None, None].to(ys.dtype)
        return self.beta * x + ys.sum(0)


def _cut(scale: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    return None if scale is None else scale[..., start:stop]


class EncoderLayer(nn.Module):
    """Pre-norm encoder layer: multi-path multi-branch self-attention, then a multi-path FFN.

    Each sublayer is ``beta x + sum_p alpha_p PathNorm_p(Func(LN_p(x)))`` (Multi-Path eq. 4-6)
    where Func is the branch-averaged attention (MAT eq. 6) or the FFN with drop-branch
    (MAT eq. 7). With one path, one branch, full widths and ``rho = 0`` it is exactly
    ``torch.nn.TransformerEncoderLayer(norm_first=True)`` (ReLU, LayerNorm eps 1e-5).
    """

    def __init__(self, model_dim: int, heads: int, max_width: int, max_ffn_width: int, max_branches: int,
                 dropout: float = 0.1, attention_dropout: float = 0.0, max_paths: int = 1,
                 more_features: bool = False) -> None:
        super().__init__()
        self.attn_paths = PathFusion(model_dim, max_paths, more_features)
        self.attn = MultiBranchAttention(model_dim, max_width, max_branches, heads, attention_dropout, max_paths)
        self.ffn_paths = PathFusion(model_dim, max_paths, more_features)
        self.ffn = ElasticFFN(model_dim, max_ffn_width, dropout, max_paths)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, dims: tuple[int, int, int, int], src_pad: torch.Tensor | None,
                drop_branch: float = 0.0) -> torch.Tensor:
        """``x [b, s, C]``, ``dims = (width, ffn_width, branches, paths)``, ``src_pad [b, s]`` -> ``[b, s, C]``."""
        width, ffn_width, nb, n_paths = dims
        rho = drop_branch if self.training else 0.0
        scale = drop_mask((n_paths, x.size(0), nb + 1), rho, x.device)  # per path: branches, then the FFN
        ys = self.attn(self.attn_paths.paths_in(x, n_paths), width=width, branches=nb, key_pad=src_pad,
                       branch_scale=_cut(scale, 0, nb))
        x = self.attn_paths.fuse(x, self.dropout(ys))
        ys = self.dropout(self.ffn(self.ffn_paths.paths_in(x, n_paths), ffn_width))
        return self.ffn_paths.fuse(x, ys, None if scale is None else scale[..., nb])


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: causal self-attention, cross-attention and FFN, each multi-path
    (Multi-Path eq. 4-6) with multi-branch attention (MAT eq. 6-7).

    The cross-attention uses the same width D_l, branch count B_l and path count P_l as the
    self-attention. With one path, one branch, full widths and ``rho = 0`` it equals
    ``torch.nn.TransformerDecoderLayer(norm_first=True)``.
    """

    def __init__(self, model_dim: int, heads: int, max_width: int, max_ffn_width: int, max_branches: int,
                 dropout: float = 0.1, attention_dropout: float = 0.0, max_paths: int = 1,
                 more_features: bool = False) -> None:
        super().__init__()
        self.self_paths = PathFusion(model_dim, max_paths, more_features)
        self.self_attn = MultiBranchAttention(model_dim, max_width, max_branches, heads, attention_dropout, max_paths)
        self.cross_paths = PathFusion(model_dim, max_paths, more_features)
        self.cross_attn = MultiBranchAttention(model_dim, max_width, max_branches, heads, attention_dropout, max_paths)
        self.ffn_paths = PathFusion(model_dim, max_paths, more_features)
        self.ffn = ElasticFFN(model_dim, max_ffn_width, dropout, max_paths)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, dims: tuple[int, int, int, int],
                src_pad: torch.Tensor | None, drop_branch: float = 0.0, cache: Cache | None = None) -> torch.Tensor:
        """``x [b, t, C]``, ``memory [b, s, C]`` -> ``[b, t, C]``.

        With ``cache`` (incremental decoding), ``x`` holds only the newest position(s) and
        the self-attention attends to the cached keys; no causal mask is needed then.
        """
        width, ffn_width, nb, n_paths = dims
        rho = drop_branch if self.training else 0.0
        scale = drop_mask((n_paths, x.size(0), 2 * nb + 1), rho, x.device)  # self, cross branches, FFN
        ys = self.self_attn(self.self_paths.paths_in(x, n_paths), width=width, branches=nb, causal=cache is None,
                            branch_scale=_cut(scale, 0, nb), cache=None if cache is None else cache.setdefault("self", {}))
        x = self.self_paths.fuse(x, self.dropout(ys))
        ys = self.cross_attn(self.cross_paths.paths_in(x, n_paths), width=width, branches=nb, memory=memory,
                             key_pad=src_pad, branch_scale=_cut(scale, nb, 2 * nb),
                             cache=None if cache is None else cache.setdefault("cross", {}))
        x = self.cross_paths.fuse(x, self.dropout(ys))
        ys = self.dropout(self.ffn(self.ffn_paths.paths_in(x, n_paths), ffn_width))
        return self.ffn_paths.fuse(x, ys, None if scale is None else scale[..., 2 * nb])
