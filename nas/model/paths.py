"""Multi-Path sublayers (Multi-Path Transformer eq. 4-7): per-path pre-norm inputs and the fusion
``beta * x + sum_i alpha_i * PathNorm_i(y_i)``, for every MUTE unit at once."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nas.model import fused
from nas.model.ops import memoized

__all__ = ["PathFusion"]

_EPS = 1e-5  # F.layer_norm's default, the eps of every layer norm here


class _PathNormSum(torch.autograd.Function):
    """``sum_i keep_i * LN(y_i; w_i, b_i)`` per unit, forward and backward in one layer-norm kernel per path.

    The weighted sum of Multi-Path eq. 6 with ``w_i = alpha_i gamma_i`` and ``b_i = alpha_i beta_i``:
    ``ys [U, P, b, t, C]``, ``weight``/``bias`` ``[U, P, C]`` (ys' dtype), ``keep [U, P, b]`` or None ->
    ``[U, b, t, C]`` in ``out_dtype``, summed in fp32. Autograd through the batched form (layer norm, affine,
    sum) makes about twelve passes over the P-fold activations; here the forward makes two and the backward
    one (``native_layer_norm_backward`` gives the input's, weight's and bias's gradients together), and only
    each path's mean and reciprocal deviation are kept. On CPU in bf16 or fp32, :mod:`nas.model.fused` does each way
    in one pass over the P paths (issue 41: 4.6 ms of PathNorm in a 23 ms 4-path FFN step). Used when gradients are
    needed; inference keeps the batched form (fewer ops a decoder step, and what ``torch.export`` traces).
    """

    @staticmethod
    def forward(ctx, ys, weight, bias, keep, out_dtype):  # noqa: D102 (the class docstring)
        units, n_paths, bsz, t, c = ys.shape
        ys = ys.contiguous()
        ctx.keep, ctx.fused = keep, fused.available(ys, out_dtype)
        if ctx.fused:  # one pass each way on CPU (nas.model.fused)
            out, mean, rstd = fused.pathnorm_forward(ys, weight, bias, keep, out_dtype, _EPS)
            ctx.save_for_backward(ys, weight, bias, mean, rstd)
            return out
        out = torch.empty(units, bsz, t, c, dtype=out_dtype, device=ys.device)
        stats = []
        for u in range(units):
            for p in range(n_paths):
                y, mean, rstd = torch.native_layer_norm(ys[u, p], (c,), weight[u, p], bias[u, p], _EPS)
                stats += [mean, rstd]
                if keep is not None:
                    y.mul_(keep[u, p, :, None, None])
                out[u].copy_(y) if p == 0 else out[u].add_(y)
        ctx.save_for_backward(ys, weight, bias, *stats)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        ys, weight, bias, *stats = ctx.saved_tensors
        keep = ctx.keep
        if ctx.fused:
            return *fused.pathnorm_backward(grad, ys, weight, keep, *stats), None, None
        units, n_paths, _, _, c = ys.shape
        grad = grad.to(ys.dtype)
        grad_ys, grad_w, grad_b = torch.empty_like(ys), torch.empty_like(weight), torch.empty_like(bias)
        for u in range(units):
            for p in range(n_paths):
                g = grad[u] if keep is None else grad[u] * keep[u, p, :, None, None]
                mean, rstd = stats[2 * (u * n_paths + p): 2 * (u * n_paths + p) + 2]
                torch.ops.aten.native_layer_norm_backward.out(
                    g, ys[u, p], (c,), mean, rstd, weight[u, p], bias[u, p], [True, True, True],
                    out0=grad_ys[u, p], out1=grad_w[u, p], out2=grad_b[u, p])
        return grad_ys, grad_w, grad_b, None, None


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

    def paths_in(self, x: torch.Tensor, n_paths: int, memo: dict | None = None) -> torch.Tensor:
        """``x [U, b, t, C]`` (per-unit streams) -> ``[U*P, b, t, C]``: ``LN_{u,i}(x_u)`` (eq. 5).

        ``memo`` (incremental decoding) keeps the cropped layer-norm affine for the batch."""
        c = x.size(-1)
        w, b = memoized(memo, self, self._affine, x.size(0), n_paths, c)
        if w.dim() == 1:
            return F.layer_norm(x, (c,), w, b)
        return torch.addcmul(b, F.layer_norm(x, (c,)).unsqueeze(1), w).flatten(0, 1)  # [U, P, b, t, C] -> [U*P, ...]

    def _affine(self, units: int, n_paths: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-path LN affine: ``[C]`` each for one unit and one path, else ``[U, P, 1, 1, C]``."""
        w, b = self.ln_affine(units, n_paths, c)
        if units == 1 and n_paths == 1:
            return w[0, 0], b[0, 0]
        return w[:, :, None, None], b[:, :, None, None]

    def ln_affine(self, units: int, n_paths: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-path layer-norm weight and bias ``[U, P, C]`` (for :meth:`ElasticFFN.folded`)."""
        return self.ln_weight[:units, :n_paths, :c], self.ln_bias[:units, :n_paths, :c]

    def fuse(self, x: torch.Tensor, ys: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``x [U, b, t, C]``, outputs ``ys [U*P, b, t, C]``, optional drop mask ``keep [U*P, b]`` -> ``[U, b, t, C]``.

        PathNorm runs in the outputs' dtype (bf16 under autocast; statistics accumulate in fp32
        inside the kernel): the P-fold activations are the sublayer's largest element-wise cost. With
        gradients, PathNorm and the weighted sum are one autograd Function (:class:`_PathNormSum`, the sum
        in fp32); without, the batched form (fewer ops a decoder step).
        """
        units = x.size(0)
        n_paths = ys.size(0) // units
        if n_paths == 1:
            return x + ys if keep is None else x + ys * keep[:, :, None, None].to(ys.dtype)
        if keep is not None:
            keep = keep[:, :, None, None].to(ys.dtype)
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
        if torch.is_grad_enabled() and (ys.requires_grad or weight.requires_grad):
            keep = None if keep is None else keep.view(*ys.shape[:2], ys.size(2))  # [U, P', b]
            summed = _PathNormSum.apply(ys, weight, bias, keep, x.dtype)  # [U, b, t, C]
            return torch.addcmul(summed, self.beta[:units, None, None, None], x)
        ys = torch.addcmul(bias[:, :, None, None], F.layer_norm(ys, (c,)), weight[:, :, None, None])
        if keep is not None:
            ys = ys * keep.view(*ys.shape[:2], *keep.shape[1:])
        return torch.addcmul(ys.sum(1).to(x.dtype), self.beta[:units, None, None, None], x)
