"""The elastic position-wise FFN (Scalable Transformers eq. 2) of every (unit, path) group, and its
pre-norm multi-path form with the per-path layer norm folded into the first projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nas.model.ops import dropout as drop
from nas.model.ops import Packed, apply, memoized, pack
from nas.model.paths import PathFusion

__all__ = ["ElasticFFN", "path_ffn"]


class _Fold(torch.autograd.Function):
    """``(W1 g, b1 + W1 b)`` for ``LN_p(x) = x^ g_p + b_p`` (:meth:`ElasticFFN.fold`), the product written in
    the dtype the first projection runs in.

    ``w1 [U, P, F, C]``, ``b1 [U, P, F]``, ``g``/``b`` ``[U, P, C]`` -> ``[G, F, C]`` in ``dtype`` and ``[G, F]``
    (G = U P). Autograd through ``w1 * g``, its autocast copy and the ``einsum`` makes about seven passes over
    the weights a training step beyond the plain FFN's cast; here the forward's product is written once, in
    ``dtype`` (the cast the plain FFN makes anyway), and the backward makes three more.
    """

    @staticmethod
    def forward(ctx, w1, b1, g, b, dtype):  # noqa: D102 (the class docstring)
        units, n_paths, f, c = w1.shape
        w1f = (w1 * g[:, :, None, :]).to(dtype)
        with torch.autocast(w1.device.type, enabled=False):  # b1 + W1 b, in the weights' dtype
            # one addmv a group: a batched matrix-vector product (bmm, einsum) took 6-11x as long on CPU
            b1f = torch.stack([torch.addmv(b1i, w1i, bi) for b1i, w1i, bi in
                               zip(b1.reshape(-1, f), w1.reshape(-1, f, c), b.reshape(-1, c))])
        ctx.save_for_backward(w1, g, b)
        return w1f.view(-1, f, c), b1f

    @staticmethod
    def backward(ctx, grad_w1f, grad_b1f):  # noqa: D102
        w1, g, b = ctx.saved_tensors
        units, n_paths, f, c = w1.shape
        grad_w1f = grad_w1f.to(w1.dtype).contiguous().view(units, n_paths, f, c)
        grad_w1 = grad_w1f * g[:, :, None, :]  # d(W1 g)/dW1
        grad_g = (grad_w1f * w1).sum(2)  # sum_f dW1f[f, c] W1[f, c]
        if grad_b1f is None:
            return grad_w1, None, grad_g, None, None
        grad_b1f = grad_b1f.to(w1.dtype).view(-1, 1, f)
        grad_w1.view(-1, f, c).baddbmm_(grad_b1f.transpose(1, 2), b.reshape(-1, 1, c))  # d(W1 b)/dW1
        grad_b = torch.bmm(grad_b1f, w1.reshape(-1, f, c)).view(units, n_paths, c)
        return grad_w1, grad_b1f.view(units, n_paths, f), grad_g, grad_b, None


class _BatchedLinear(torch.autograd.Function):
    """``baddbmm(b, x, w^T)`` whose weight gradient comes out in the weight's own layout.

    ``x [G, N, I]``, or ``[N, I]`` read by every group, ``w [G, O, I]``, ``b [G, 1, O]`` -> ``[G, N, O]``.
    Autograd through ``baddbmm(b, x, w.transpose(1, 2))`` computes ``x^T dy`` as ``[G, I, O]`` and hands back
    its transposed view, so every later pass over the weight gradient (the fold's, the crop's, the cast to
    fp32) strides through memory, and ``bmm`` reads a stride-0 ``x^T`` slowly. Here ``dW = dy^T x`` is computed
    as ``[G, O, I]`` directly, as ``F.linear``'s backward does for one group. A shared input's gradient
    ``sum_g dy_g W_g`` is G products summed (what autograd computes through the stride-0 batch): as one product
    ``[N, G*O] x [G*O, I]`` it needed a transposed copy of ``dy``, and on an Intel Xeon with AMX, bf16, 2 threads,
    took 2.98 against 1.86 ms for ``G = 4, N = 1024, O = I = 512`` (a K of 2048 runs at half the rate of
    512 there); in fp32 the two took 8.35 and 8.16 ms. Under autocast the
    product runs in the autocast dtype and each gradient is returned in its input's dtype.
    """

    @staticmethod
    def forward(ctx, b, x, w):  # noqa: D102 (the class docstring)
        ctx.save_for_backward(x, w)
        ctx.dtypes = b.dtype, x.dtype, w.dtype
        xs = x.expand(w.size(0), *x.shape) if x.dim() == 2 else x
        return torch.baddbmm(b, xs, w.transpose(1, 2))

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        x, w = ctx.saved_tensors
        b_dtype, x_dtype, w_dtype = ctx.dtypes
        grad_b = grad_x = grad_w = None
        w = w.to(grad.dtype)
        if ctx.needs_input_grad[0]:
            grad_b = grad.sum(1, keepdim=True).to(b_dtype)  # as autograd through baddbmm: fp32 sums, rounded once
        if ctx.needs_input_grad[1]:
            if x.dim() == 2:  # sum_g dy_g W_g: G products, summed in fp32 and rounded once (as autograd's expand)
                grad_x = torch.bmm(grad, w).sum(0)
            else:
                grad_x = torch.bmm(grad, w)
            grad_x = grad_x.to(x_dtype)
        if ctx.needs_input_grad[2]:
            xs = x.to(grad.dtype)
            xs = xs.expand(w.size(0), *x.shape) if x.dim() == 2 else xs
            grad_w = torch.bmm(grad.transpose(1, 2), xs).to(w_dtype)
        return grad_b, grad_x, grad_w


def _batched_linear(b: torch.Tensor, x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """``baddbmm(b, x, w_t)`` for ``w_t = w.transpose(1, 2)``; ``x`` may be ``[N, I]``, read by every group (a
    stride-0 batch). With gradients through :class:`_BatchedLinear`, autocast as ``baddbmm``'s (every operand in
    the autocast dtype); without, ``baddbmm`` itself (what ``torch.export`` traces)."""
    if not torch.is_grad_enabled():
        return torch.baddbmm(b, x.expand(w_t.size(0), *x.shape) if x.dim() == 2 else x, w_t)
    w = w_t.transpose(1, 2)
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        b, x, w = b.to(dtype), x.to(dtype), w.to(dtype)
    with torch.autocast(x.device.type, enabled=False):
        return _BatchedLinear.apply(b, x, w)


class ElasticFFN(nn.Module):
    """Position-wise FFN ``ReLU(x W1^T + b1) W2^T + b2`` (Scalable Transformers eq. 2) per (unit, path) group.

    ``w1 [U, P, F, C]`` and ``w2 [U, P, C, F]``; a call on U units x P paths with ``ffn_width=F_l``
    on inputs of C_l channels uses ``w1[:U, :P, :F_l, :C_l]`` and ``w2[:U, :P, :C_l, :F_l]``.
    """

    def __init__(self, model_dim: int, max_ffn_width: int, max_paths: int = 1, max_units: int = 1) -> None:
        super().__init__()
        lead = (max_units, max_paths)
        self.w1 = nn.Parameter(torch.empty(*lead, max_ffn_width, model_dim))
        self.b1 = nn.Parameter(torch.zeros(*lead, max_ffn_width))
        self.w2 = nn.Parameter(torch.empty(*lead, model_dim, max_ffn_width))
        self.b2 = nn.Parameter(torch.zeros(*lead, model_dim))
        for w in (self.w1, self.w2):
            for group in w.data.flatten(0, 1):
                nn.init.xavier_uniform_(group)

    def forward(self, xs: torch.Tensor, ffn_width: int, units: int = 1, dropout: float = 0.0,
                memo: dict | None = None) -> torch.Tensor:
        """``[G, b, t, C] -> [G, b, t, C]`` with G = units x paths (unit-major); ``dropout`` on the hidden layer;
        ``memo`` (incremental decoding) keeps the cropped weights for the batch."""
        first, second = memoized(memo, "ffn_plain", self.crop, units, xs.size(0) // units, ffn_width, xs.size(-1))
        hidden = F.relu(apply(xs, first))  # [G, b, t, F_l]
        return apply(drop(hidden, dropout), second)

    def crop(self, units: int, n_paths: int, ffn_width: int, c: int) -> tuple[Packed, Packed]:
        """``w1[:U, :P, :F, :C]``, ``b1`` and ``w2[:U, :P, :C, :F]``, ``b2``, packed (:func:`~nas.model.ops.pack`)."""
        u, p = units, n_paths
        w1, b1 = self.w1[:u, :p, :ffn_width, :c].flatten(0, 1), self.b1[:u, :p, :ffn_width].flatten(0, 1)
        w2, b2 = self.w2[:u, :p, :c, :ffn_width].flatten(0, 1), self.b2[:u, :p, :c].flatten(0, 1)
        return pack(w1, b1), pack(w2, b2)

    def fold(self, ln_weight: torch.Tensor, ln_bias: torch.Tensor, ffn_width: int, c: int) -> tuple[torch.Tensor, ...]:
        """``(W1 g, b1 + W1 b, W2, b2)`` for ``LN_p(x) = x^ g_p + b_p``: ``[G, F, C]``, ``[G, F]``, ``[G, C, F]``, ``[G, C]``."""
        units, n_paths = ln_weight.size(0), ln_weight.size(1)
        w1, b1 = self.w1[:units, :n_paths, :ffn_width, :c], self.b1[:units, :n_paths, :ffn_width]  # [U, P, F, C]
        if torch.is_grad_enabled() and any(t.requires_grad for t in (w1, b1, ln_weight, ln_bias)):
            device = w1.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else w1.dtype
            w1f, b1f = _Fold.apply(w1, b1, ln_weight, ln_bias, dtype)
        else:
            w1f = (w1 * ln_weight[:, :, None, :]).flatten(0, 1)  # [G, F, C]
            b1f = (b1 + torch.einsum("upfc,upc->upf", w1, ln_bias)).flatten(0, 1)  # [G, F]
        w2 = self.w2[:units, :n_paths, :c, :ffn_width].flatten(0, 1)  # [G, C, F]
        b2 = self.b2[:units, :n_paths, :c].flatten(0, 1)  # [G, C]
        return w1f, b1f, w2, b2

    def folded(self, xn: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, ffn_width: int,
               dropout: float = 0.0, memo: dict | None = None) -> torch.Tensor:
        """The FFN of every path on ``LN_p(x) = x^ * g_p + b_p`` without materialising the P inputs.

        ``W1 (x^ g + b) = (W1 g) x^ + W1 b``: each path's layer-norm affine is folded into its first
        projection (:meth:`fold`), and the P paths' first projections run as one batched matmul reading the
        shared normalised input (a stride-0 batch: the P inputs are never materialised). With gradients, the
        fold and both products are autograd Functions (:class:`_Fold`, :class:`_BatchedLinear`): the weight
        gradients come out in the weights' layout and the fold's backward makes three passes over them.

        Args: ``xn [U, b, t, C]`` (``LN(x_u)`` without affine), ``ln_weight``/``ln_bias``
        ``[U, P, C]`` (Multi-Path eq. 5's per-path LN), ``dropout`` on the hidden layer, ``memo``
        (incremental decoding) keeps the folded weights. Returns ``[U*P, b, t, C]`` (unit-major),
        equal to ``forward(LN_p(x_u))``.
        """
        units, n_paths, c = ln_weight.size(0), ln_weight.size(1), xn.size(-1)
        _, bsz, t, _ = xn.shape
        groups = units * n_paths
        w1f, b1f, w2, b2 = memoized(memo, "ffn", self.fold, ln_weight, ln_bias, ffn_width, c)
        if torch.is_autocast_enabled(xn.device.type):  # cast once, before the paths share it
            xn = xn.to(torch.get_autocast_dtype(xn.device.type))
        flat = xn.reshape(units, bsz * t, c)
        # one unit: [N, C], read by the P paths (nothing copied; its gradient over the paths is one product)
        shared = flat[0] if units == 1 else flat[:, None].expand(units, n_paths, bsz * t, c).reshape(groups, bsz * t, c)
        hidden = drop(F.relu(_batched_linear(b1f[:, None, :], shared, w1f.transpose(1, 2))), dropout)  # [G, bt, F]
        return _batched_linear(b2[:, None, :], hidden, w2.transpose(1, 2)).view(groups, bsz, t, c)


def path_ffn(fusion: PathFusion, ffn: ElasticFFN, xu: torch.Tensor, ffn_width: int, n_paths: int,
             dropout: float = 0.0, memo: dict | None = None) -> torch.Tensor:
    """``FFN(LN_p(x_u))`` of every (unit, path) group, ``xu [U, b, t, C] -> [U*P, b, t, C]`` (Multi-Path eq. 5).

    The plain pre-norm FFN for one unit and one path; otherwise the per-path LN affine is folded
    into the first projection (:meth:`ElasticFFN.folded`, its weights kept in ``memo`` when given).
    """
    units, c = xu.size(0), xu.size(-1)
    if units == 1 and n_paths == 1:
        run = ffn if memo is None else ffn.forward  # incremental decoding skips Module.__call__ (DecoderLayer.forward)
        return run(fusion.paths_in(xu, 1, memo), ffn_width, 1, dropout, memo)
    return ffn.folded(F.layer_norm(xu, (c,)), *fusion.ln_affine(units, n_paths, c), ffn_width, dropout, memo)
