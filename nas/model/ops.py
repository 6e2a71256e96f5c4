"""Grouped tensor primitives shared by every sublayer: the per-group linear map, drop-branch masks
and the attention kernel.

Activations of a sublayer are laid out ``[G, b, t, ...]`` with G = units x paths groups first
(unit-major); every group has its own weights, and all groups run as one batched matrix product.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["path_project", "drop_mask", "attend", "dropout", "sinusoidal_positions"]

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
    flat = xs.reshape(n_paths, bsz * t, c)  # [G, b*t, C]
    out = torch.bmm(flat, weight.transpose(1, 2)) if bias is None else torch.baddbmm(bias[:, None, :], flat, weight.transpose(1, 2))
    return out.view(n_paths, bsz, t, -1)  # [G, b, t, K]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           causal: bool = False, dropout_p: float = 0.0, matmul: bool = False) -> torch.Tensor:
    """Scaled dot-product attention ``softmax(q k^T / sqrt(d) + mask) v`` (Vaswani et al. 2017, eq. 1).

    Args:
        q: ``[..., t, d]`` queries; k, v: ``[..., s, d]`` keys and values (leading dims broadcast).
        mask: bool, True where a key may be attended, broadcastable to ``[..., t, s]``; or None.
        causal: mask future keys (``t == s``, full-sequence self-attention); ignored with ``mask``.
        dropout_p: dropout on the attention probabilities.
        matmul: run as two matrix products (cached decoding: one query per row, no ``causal``), for
            which the fused kernel's setup costs more than the products; otherwise
            ``scaled_dot_product_attention`` (the math backend on CPU).
    Returns:
        ``[..., t, d]``.
    """
    if matmul and dropout_p == 0.0:
        scores = torch.matmul(q * q.size(-1) ** -0.5, k.transpose(-2, -1))  # [..., 1, s]
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, -1), v)  # [..., 1, d]
    with sdpa_kernel(_CPU_BACKENDS if q.device.type == "cpu" else _ALL_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              dropout_p=dropout_p)


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Inverted dropout with rate ``p`` (Srivastava et al. 2014); ``x`` itself when ``p == 0`` (no random draw).

    The same draws as ``nn.Dropout(p)`` in training mode.
    """
    return F.dropout(x, p, True) if p > 0.0 else x
