"""MUTE units (Multi-Unit Transformer): unit biases (sec. 3.2), the unit combination (eq. 10, or
eq. 13-16 with sequential dependency) and AutoShuffle (eq. 16-19)."""

from __future__ import annotations

import torch

from nas.space.arch import UNIT_BIASES

__all__ = ["unit_bias_kinds", "apply_unit_bias", "unit_weights", "combine_units", "doubly_normalize",
           "permutation_penalty"]


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


def unit_weights(alpha: torch.Tensor, shuffle: torch.Tensor, units: int,
                 dependency: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The combination weights of ``units`` units: ``w = alpha / sum(alpha)`` ``[U]`` (MUTE eq. 10) and, with
    ``dependency == "sequential"``, the renormalised AutoShuffle matrix ``M [U, U]`` (eq. 16-18), else None."""
    w = alpha[:units] / alpha[:units].sum()
    m = doubly_normalize(shuffle[:units, :units]) if dependency == "sequential" else None
    return w, m


def combine_units(outs: torch.Tensor, w: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """Units' outputs ``[U, b, t, C]`` -> ``[b, t, C]``: ``sum_u w_u F_u`` (MUTE eq. 10/12) or, with the
    AutoShuffle matrix ``m`` (sequential dependency), ``sum_i w_i G^_i / i`` over the permuted, accumulated
    outputs (eq. 13-16). ``w [U]`` sums to 1 (:func:`unit_weights`), so every unit count keeps the residual scale."""
    units = outs.size(0)
    if m is not None:
        permuted = torch.einsum("ij,ibtc->jbtc", m.to(outs.dtype), outs)  # [G_1..G_I] = M^T [F_1..F_I]
        count = torch.arange(1, units + 1, device=outs.device, dtype=outs.dtype)
        outs = permuted.cumsum(0) / count[:, None, None, None]  # G^_i / i
    return torch.einsum("u,ubtc->btc", w.to(outs.dtype), outs)
