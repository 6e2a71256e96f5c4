"""Prime's dynamic convolution (Unified Transformer eq. 5-7), causal in the decoder."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nas.model.kv_cache import ConvCache
from nas.model.ops import Packed, apply, memoized, pack

__all__ = ["DynamicConv"]


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

    def crop(self, units: int, kernels: tuple[int, ...], c: int, width: int) -> tuple[torch.Tensor, Packed, Packed]:
        """The gate ``softmax(alpha) [U, n]`` (eq. 7) over the chosen ``kernels``, the kernel generators of all of
        them as one packed projection ``[U, sum k, C]`` (eq. 6) and the output projection ``[U, C, D]``."""
        gate = torch.softmax(torch.stack([self.gate[str(k)][:units] for k in kernels], -1), -1)  # [U, n] eq. 7
        gen = pack(torch.cat([self.gen_weight[str(k)][:units, :, :c] for k in kernels], 1),
                   torch.cat([self.gen_bias[str(k)][:units] for k in kernels], 1))
        return gate, gen, pack(self.w_out[:units, :c, :width], self.b_out[:units, :c])

    def kernel(self, x: torch.Tensor, kernels: tuple[int, ...], gate: torch.Tensor, gen: Packed) -> torch.Tensor:
        """The gated, combined dynamic kernel ``[U, b, t, K]`` (K = the largest chosen size) from ``x [U, b, t, C]``
        (``gate``, ``gen`` from :meth:`crop`)."""
        big = max(kernels)
        logits = apply(x, gen)  # [U, b, t, sum k]
        combined = x.new_zeros(*x.shape[:3], big, dtype=logits.dtype)
        for i, (k, part) in enumerate(zip(kernels, logits.split(list(kernels), dim=-1))):
            offset = big - k if self.causal else (big - k) // 2  # align the k taps inside the K window
            combined[..., offset:offset + k] += gate[:, i, None, None, None] * torch.softmax(part, -1)  # eq. 6
        return combined

    def forward(self, x: torch.Tensor, v: torch.Tensor, kernels: tuple[int, ...], pad: torch.Tensor | None = None,
                cache: ConvCache | None = None) -> torch.Tensor:
        """``x [U, b, t, C]`` (kernel input), ``v [U, b, t, D]`` (values) -> ``[U, b, t, C]``.

        ``pad [b, t]`` zeroes padded values; ``cache`` (causal, incremental decoding: ``x`` and ``v``
        hold the newest positions) keeps the last ``K - 1`` values ``[U, b, K-1, D]`` and the cropped weights.
        """
        units, big, width, c = v.size(0), max(kernels), v.size(-1), x.size(-1)
        gate, gen, out_proj = memoized(None if cache is None else cache.memo, "weights", self.crop,
                                       units, kernels, c, width)
        if pad is not None:
            v = v.masked_fill(pad[None, :, :, None], 0.0)
        left = big - 1 if self.causal else (big - 1) // 2
        right = 0 if self.causal else (big - 1) // 2
        if cache is not None:
            padded = cache.extend(v, big)  # [U, b, K-1+t, D]
        else:
            padded = F.pad(v, (0, 0, left, right))  # [U, b, left+t+right, D]
        windows = padded.unfold(2, big, 1)  # [U, b, t, D, K]
        out = torch.einsum("ubtk,ubtdk->ubtd", self.kernel(x, kernels, gate, gen).to(v.dtype), windows)
        return apply(out, out_proj)
