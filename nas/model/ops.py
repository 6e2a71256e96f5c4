"""Grouped tensor primitives shared by every sublayer: the per-group linear map, drop-branch masks
and the attention kernel.

Activations of a sublayer are laid out ``[G, b, t, ...]`` with G = units x paths groups first
(unit-major); every group has its own weights, and all groups run as one batched matrix product.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["Packed", "pack", "apply", "path_project", "drop_mask", "attend", "attend_cached", "dropout",
           "keep_mask", "DROPOUT_LEVELS",
           "sinusoidal_positions", "memoized"]

Packed = tuple[torch.Tensor, "torch.Tensor | None"]
"""Per-group linear weights in the form :func:`apply` reads (:func:`pack`)."""

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


def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> Packed:
    """Per-group ``weight [G, K, C]``, ``bias [G, K]`` -> the form :func:`apply` reads: ``[K, C]``/``[K]``
    for one group (``F.linear``), else ``weight^T [G, C, K]``/``bias [G, 1, K]`` (``baddbmm``). Views only:
    incremental decoding keeps the packed form for a whole batch (:func:`memoized`)."""
    if weight.size(0) == 1:
        return weight[0], None if bias is None else bias[0]
    return weight.transpose(1, 2), None if bias is None else bias[:, None, :]


def apply(xs: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Per-group linear map on :func:`pack`-ed weights: ``xs [G, b, t, C]`` -> ``[G, b, t, K]``.

    One ``F.linear`` for a single group, else one ``baddbmm`` over all groups.
    """
    weight, bias = packed
    if weight.dim() == 2:
        return F.linear(xs, weight, bias)
    n_paths, bsz, t, c = xs.shape
    flat = xs.reshape(n_paths, bsz * t, c)  # [G, b*t, C]
    out = torch.bmm(flat, weight) if bias is None else torch.baddbmm(bias, flat, weight)
    return out.view(n_paths, bsz, t, -1)  # [G, b, t, K]


def path_project(xs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Per-group linear map: ``xs [G, b, t, C]``, ``weight [G, K, C]``, ``bias [G, K]`` -> ``[G, b, t, K]``
    (``apply(xs, pack(weight, bias))``)."""
    return apply(xs, pack(weight, bias))


def memoized(memo: dict | None, key: object, make, *args):
    """``make(*args)``, kept in ``memo[key]`` when a memo is given (incremental decoding: weights cropped and
    packed once per batch, reused by every step; training passes no memo, so gradients see every crop)."""
    if memo is None:
        return make(*args)
    value = memo.get(key)
    if value is None:
        value = memo[key] = make(*args)
    return value


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           causal: bool = False, dropout_p: float = 0.0) -> torch.Tensor:
    """Scaled dot-product attention ``softmax(q k^T / sqrt(d) + mask) v`` (Vaswani et al. 2017, eq. 1).

    Args:
        q: ``[..., t, d]`` queries; k, v: ``[..., s, d]`` keys and values (leading dims broadcast).
        mask: bool, True where a key may be attended, broadcastable to ``[..., t, s]``; or None.
        causal: mask future keys (``t == s``, full-sequence self-attention); ignored with ``mask``.
        dropout_p: dropout on the attention probabilities.
    Returns:
        ``[..., t, d]``, from ``scaled_dot_product_attention`` (the math backend on CPU).
    """
    with sdpa_kernel(_CPU_BACKENDS if q.device.type == "cpu" else _ALL_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              dropout_p=dropout_p)


def attend_cached(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`attend` for incremental decoding: every query may see every key (the keys are the past).

    Args:
        q: ``[N, t, d]``, already scaled by ``1/sqrt(d)`` (folded into the query projection), N = the
            product of the leading dims (groups, rows, heads).
        kt: the keys transposed ``[N, d, s]``; v: the values ``[N, s, d]``.
        bias: additive mask broadcastable to ``[N, t, s]`` (``-inf`` where a key is hidden: padding, or
            a later position), or None.
    Returns:
        ``[N, t, d]``: two ``bmm``, for which the fused kernel's setup costs more than the products
        (one query per row).
    """
    scores = torch.bmm(q, kt) if bias is None else torch.baddbmm(bias, q, kt)  # [N, t, s]
    return torch.bmm(torch.softmax(scores, -1), v)


DROPOUT_LEVELS = 65536
"""On the CPU a dropout draw is one of 65,536 levels (16 random bits): rates are rounded to a multiple of 1/65,536."""


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Inverted dropout with rate ``p`` (Srivastava et al. 2014): each element zeroed with probability ``p``, the rest
    scaled by ``1 / (1 - p)``; ``x`` itself when ``p == 0`` (no random draw).

    On a GPU, and for ``p >= 1``, this is ``F.dropout``. On the CPU the keep mask comes from 16 random bits per
    element (:func:`keep_mask`) instead of ``bernoulli_``: PyTorch's CPU ``bernoulli_`` draws a float per element
    and was 11% of a quickstart sandwich step on a 2-core AVX2 CPU (``torch.profiler``), the mask from 64-bit draws
    about a third of it; forward and backward of this dropout take about half of ``F.dropout``'s. It departs from
    ``nn.Dropout`` in two ways: other random draws from the same generator (a seed gives other masks than
    ``nn.Dropout`` would), and ``p`` rounded to a multiple of 1/65,536 (0.1 becomes 0.100006).

    Args:
        x: any shape.
        p: the dropout rate, in [0, 1].
    Returns:
        ``x``'s shape and dtype.
    """
    if p <= 0.0:
        return x
    if x.device.type != "cpu" or p >= 1.0:
        return F.dropout(x, p, True)
    return torch.where(keep_mask(x.shape, p, x.device), x, 0.0) * (1.0 / (1.0 - p))


def keep_mask(shape: Sequence[int], p: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """A ``bool`` tensor of ``shape``, each element False with probability ``round(p * 65536) / 65536``,
    independently: 16 bits of ``torch.randint``'s 64-bit draws from the default generator per element.

    Raises:
        ValueError: ``p`` outside [0, 1].
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout rate p={p} must be in [0, 1]")
    n = math.prod(shape)
    words = torch.randint(-2 ** 63, 2 ** 63 - 1, ((n + 3) // 4,), dtype=torch.int64, device=device)  # 4 draws each
    return words.view(torch.int16)[:n].view(tuple(shape)) >= round(p * DROPOUT_LEVELS) - DROPOUT_LEVELS // 2
