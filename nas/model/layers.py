"""Elastic building blocks of the supernet: every weight is cropped by explicit dimensions.

Cropping follows Scalable Transformers (sec. 3.1): a narrower layer uses the top-left
sub-matrix ``W[1:C, 1:D]`` and the first ``D`` entries of each bias. Branches follow the
Multi-branch Attentive Transformer (MAT): ``N_a`` independent multi-head attentions whose
outputs are averaged (eq. 4), each dropped with rate ``rho`` in training (drop-branch,
eq. 5-6), and drop-branch on the FFN (eq. 7). All branches of a layer run as ONE matrix
product (their weights are stacked), never as a Python loop over modules.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["MultiBranchAttention", "ElasticFFN", "EncoderLayer", "DecoderLayer", "sinusoidal_positions", "drop_mask"]

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


def drop_mask(batch: int, n: int, rho: float, device: torch.device) -> torch.Tensor | None:
    """Drop-branch keep mask ``I{U_i >= rho} / (1 - rho)`` (MAT eq. 5), shape ``[batch, n]``.

    One draw per sentence and branch. Returns None when ``rho == 0`` (nothing is dropped).
    """
    if rho <= 0.0:
        return None
    keep = (torch.rand(batch, n, device=device) >= rho).float()
    return keep / (1.0 - rho)


class MultiBranchAttention(nn.Module):
    """``N_a`` branches of multi-head attention, averaged (MAT eq. 4 without the residual).

    Weights are stacked over branches: ``w_in [N_a, 3, D, C]`` (q, k, v) and
    ``w_out [N_a, C, D]``, where C is the model width and D the widest attention width.
    A call with ``width=D_l, branches=B_l`` uses ``w_in[:B_l, :, :D_l, :]`` (top-left crop,
    Scalable Transformers sec. 3.1) and the first ``B_l`` branches. The head count is fixed,
    so the head width is ``D_l / heads``.

    Args:
        model_dim: C, the model width (channels).
        max_width: D, the widest attention width (channels), divisible by ``heads``.
        max_branches: the most branches N_a.
        heads: attention heads per branch.
        dropout: dropout on the attention probabilities (training only).
    """

    def __init__(self, model_dim: int, max_width: int, max_branches: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if max_width % heads:
            raise ValueError(f"attention width {max_width} is not divisible by heads={heads}")
        self.model_dim, self.max_width, self.max_branches, self.heads = model_dim, max_width, max_branches, heads
        self.dropout = dropout
        self.w_in = nn.Parameter(torch.empty(max_branches, 3, max_width, model_dim))
        self.b_in = nn.Parameter(torch.zeros(max_branches, 3, max_width))
        self.w_out = nn.Parameter(torch.empty(max_branches, model_dim, max_width))
        self.b_out = nn.Parameter(torch.zeros(max_branches, model_dim))
        bound_in = math.sqrt(6.0 / (model_dim + 3 * max_width))  # xavier over the fused [3D, C] matrix
        nn.init.uniform_(self.w_in, -bound_in, bound_in)
        nn.init.uniform_(self.w_out, -1.0 / math.sqrt(max_width), 1.0 / math.sqrt(max_width))

    def forward(
        self,
        x: torch.Tensor,
        *,
        width: int,
        branches: int,
        memory: torch.Tensor | None = None,
        key_pad: torch.Tensor | None = None,
        causal: bool = False,
        branch_scale: torch.Tensor | None = None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        """Attend ``x`` to itself (``memory=None``) or to ``memory`` (cross-attention).

        Args:
            x: queries ``[b, t, C]``.
            width: attention width D_l (channels, divisible by heads).
            branches: number of branches B_l.
            memory: keys/values source ``[b, s, C]`` for cross-attention.
            key_pad: ``[b, s]`` bool, True where the key is padding.
            causal: mask future positions (decoder self-attention over a full sequence).
            branch_scale: drop-branch keep mask ``[b, B_l]`` (MAT eq. 5), or None.
            cache: incremental decoding state, updated in place: self-attention appends
                ``k``/``v`` ``[b, B_l*h, t_so_far, d_h]``; cross-attention stores ``ck``/``cv`` once.
        Returns:
            ``[b, t, C]``: ``1/B_l * sum_i beta_i * MHA_i(x)`` (MAT eq. 4/6, residual added by the caller).
        """
        bsz, t, c = x.shape
        h, dh, nb = self.heads, width // self.heads, branches
        w_in, b_in = self.w_in[:nb, :, :width], self.b_in[:nb, :, :width]  # [B, 3, D, C], [B, 3, D]
        if memory is None:
            qkv = F.linear(x, w_in.reshape(nb * 3 * width, c), b_in.reshape(-1))  # [b, t, B*3*D]
            q, k, v = qkv.view(bsz, t, nb, 3, h * dh).unbind(3)  # each [b, t, B, D]
            k, v = self._heads(k), self._heads(v)  # [b, B*h, t, dh]
            if cache is not None:
                if "k" in cache:
                    k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
                cache["k"], cache["v"] = k, v
        else:
            q = F.linear(x, w_in[:, 0].reshape(nb * width, c), b_in[:, 0].reshape(-1)).view(bsz, t, nb, width)
            if cache is not None and "ck" in cache:
                k, v = cache["ck"], cache["cv"]
            else:
                s = memory.size(1)
                kv = F.linear(memory, w_in[:, 1:].reshape(nb * 2 * width, c), b_in[:, 1:].reshape(-1))
                k, v = kv.view(bsz, s, nb, 2, width).unbind(3)  # each [b, s, B, D]
                k, v = self._heads(k), self._heads(v)  # [b, B*h, s, dh]
                if cache is not None:
                    cache["ck"], cache["cv"] = k, v
        q = self._heads(q)  # [b, B*h, t, dh]
        mask = None if key_pad is None else ~key_pad[:, None, None, :]  # [b, 1, 1, s], True = attend
        with sdpa_kernel(_CPU_BACKENDS if q.device.type == "cpu" else _ALL_BACKENDS):
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                dropout_p=self.dropout if self.training else 0.0,
            )  # [b, B*h, t, dh]
        o = o.transpose(1, 2).reshape(bsz, t, nb, width)  # [b, t, B, D]
        w_out = self.w_out[:nb, :, :width].permute(1, 0, 2).reshape(c, nb * width)  # [C, B*D]
        if branch_scale is None:  # the 1/B average folded into the (small) weight, not the activations
            w_out = w_out if nb == 1 else w_out / nb
            return F.linear(o.reshape(bsz, t, nb * width), w_out, self.b_out[:nb].mean(0))
        scale = branch_scale / nb  # [b, B]
        o = o * scale[:, None, :, None].to(o.dtype)
        b_out = (scale @ self.b_out[:nb])[:, None, :]  # [b, 1, C]
        return F.linear(o.reshape(bsz, t, nb * width), w_out) + b_out

    def _heads(self, z: torch.Tensor) -> torch.Tensor:
        """``[b, t, B, D] -> [b, B*h, t, D/h]``: branches become extra attention heads."""
        bsz, t, nb, width = z.shape
        return z.reshape(bsz, t, nb * self.heads, width // self.heads).transpose(1, 2)


class ElasticFFN(nn.Module):
    """Position-wise FFN ``ReLU(x W1^T + b1) W2^T + b2`` (Scalable Transformers eq. 2) with an elastic inner width.

    ``w1 [F, C]`` and ``w2 [C, F]``; a call with ``ffn_width=F_l`` uses ``w1[:F_l]`` and ``w2[:, :F_l]``.
    """

    def __init__(self, model_dim: int, max_ffn_width: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(max_ffn_width, model_dim))
        self.b1 = nn.Parameter(torch.zeros(max_ffn_width))
        self.w2 = nn.Parameter(torch.empty(model_dim, max_ffn_width))
        self.b2 = nn.Parameter(torch.zeros(model_dim))
        nn.init.xavier_uniform_(self.w1)
        nn.init.xavier_uniform_(self.w2)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, ffn_width: int) -> torch.Tensor:
        """``[b, t, C] -> [b, t, C]``."""
        hidden = F.relu(F.linear(x, self.w1[:ffn_width], self.b1[:ffn_width]))  # [b, t, F_l]
        return F.linear(self.dropout(hidden), self.w2[:, :ffn_width], self.b2)


def _scaled(y: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """Apply a per-sentence drop-branch keep mask ``[b, 1]`` to ``y [b, t, C]`` (MAT eq. 7)."""
    return y if keep is None else y * keep[:, :, None].to(y.dtype)


class EncoderLayer(nn.Module):
    """Pre-norm encoder layer: ``x + mAttn(LN(x))`` then ``x + FFN(LN(x))`` (MAT eq. 6-7).

    With one branch, full widths and ``rho = 0`` it is exactly
    ``torch.nn.TransformerEncoderLayer(norm_first=True)`` (ReLU, LayerNorm eps 1e-5).
    """

    def __init__(self, model_dim: int, heads: int, max_width: int, max_ffn_width: int, max_branches: int,
                 dropout: float = 0.1, attention_dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(model_dim)
        self.attn = MultiBranchAttention(model_dim, max_width, max_branches, heads, attention_dropout)
        self.ln_ffn = nn.LayerNorm(model_dim)
        self.ffn = ElasticFFN(model_dim, max_ffn_width, dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, dims: tuple[int, int, int], src_pad: torch.Tensor | None,
                drop_branch: float = 0.0) -> torch.Tensor:
        """``x [b, s, C]``, ``dims = (width, ffn_width, branches)``, ``src_pad [b, s]`` -> ``[b, s, C]``."""
        width, ffn_width, branches = dims
        rho = drop_branch if self.training else 0.0
        scale = drop_mask(x.size(0), branches + 1, rho, x.device)  # last column: the FFN (eq. 7)
        x = x + self.dropout(self.attn(self.ln_attn(x), width=width, branches=branches, key_pad=src_pad,
                                       branch_scale=None if scale is None else scale[:, :branches]))
        y = self.dropout(self.ffn(self.ln_ffn(x), ffn_width))
        return x + _scaled(y, None if scale is None else scale[:, branches:])


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: causal self-attention, cross-attention, FFN (MAT eq. 6-7).

    The cross-attention uses the same width D_l and branch count B_l as the self-attention.
    With one branch, full widths and ``rho = 0`` it equals
    ``torch.nn.TransformerDecoderLayer(norm_first=True)``.
    """

    def __init__(self, model_dim: int, heads: int, max_width: int, max_ffn_width: int, max_branches: int,
                 dropout: float = 0.1, attention_dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_self = nn.LayerNorm(model_dim)
        self.self_attn = MultiBranchAttention(model_dim, max_width, max_branches, heads, attention_dropout)
        self.ln_cross = nn.LayerNorm(model_dim)
        self.cross_attn = MultiBranchAttention(model_dim, max_width, max_branches, heads, attention_dropout)
        self.ln_ffn = nn.LayerNorm(model_dim)
        self.ffn = ElasticFFN(model_dim, max_ffn_width, dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, dims: tuple[int, int, int],
                src_pad: torch.Tensor | None, drop_branch: float = 0.0, cache: Cache | None = None) -> torch.Tensor:
        """``x [b, t, C]``, ``memory [b, s, C]`` -> ``[b, t, C]``.

        With ``cache`` (incremental decoding), ``x`` holds only the newest position(s) and
        the self-attention attends to the cached keys; no causal mask is needed then.
        """
        width, ffn_width, nb = dims
        rho = drop_branch if self.training else 0.0
        scale = drop_mask(x.size(0), 2 * nb + 1, rho, x.device)  # self branches, cross branches, FFN
        s_self = None if scale is None else scale[:, :nb]
        s_cross = None if scale is None else scale[:, nb:2 * nb]
        x = x + self.dropout(self.self_attn(self.ln_self(x), width=width, branches=nb, causal=cache is None,
                                            branch_scale=s_self, cache=None if cache is None else cache.setdefault("self", {})))
        x = x + self.dropout(self.cross_attn(self.ln_cross(x), width=width, branches=nb, memory=memory, key_pad=src_pad,
                                             branch_scale=s_cross, cache=None if cache is None else cache.setdefault("cross", {})))
        y = self.dropout(self.ffn(self.ln_ffn(x), ffn_width))
        return x + _scaled(y, None if scale is None else scale[:, 2 * nb:])
