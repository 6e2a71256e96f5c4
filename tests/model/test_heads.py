"""Heads of a fixed width (Scalable Transformers sec. 4.1: "attention head dimension is fixed to 64").

A width-D sub-attention is the widest attention's first ``D / head_dim`` heads, each computed
exactly as in the widest (same channels, same ``1/sqrt(head_dim)`` temperature), checked against a
loop transcription of multi-head attention (Vaswani et al. 2017, eq. 1 and sec. 3.2.2).
"""

from __future__ import annotations

import math

import pytest
import torch

from nas.model import SuperTransformer
from nas.model.attention import MultiBranchAttention
from nas.space.arch import Arch, StackArch


def _head(x: torch.Tensor, attn: MultiBranchAttention, h: int, hd: int) -> torch.Tensor:
    """Head ``h`` of branch 0 of the widest attention on ``x [t, C]``, alone: ``[t, hd]``."""
    rows = slice(h * hd, (h + 1) * hd)
    w, b = attn.w_in[0, 0, 0], attn.b_in[0, 0, 0]  # [3, D, C], [3, D]
    q, k, v = (x @ w[i, rows].T + b[i, rows] for i in range(3))
    out = torch.zeros(x.size(0), hd)
    for i in range(x.size(0)):
        scores = torch.tensor([float(q[i] @ k[j]) / math.sqrt(hd) for j in range(x.size(0))])
        out[i] = torch.softmax(scores, 0) @ v
    return out


@pytest.mark.parametrize("width", [8, 16, 24])
def test_a_cropped_attention_is_the_widest_first_heads_computed_alone(width):
    torch.manual_seed(0)
    hd, c = 8, 16
    attn = MultiBranchAttention(c, 24, 1, heads=3, head_dim=hd).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.1 * torch.randn_like(p))
        x = torch.randn(5, c)
        got = attn(x[None, None], width=width, branches=1)[0, 0]  # [t, C]
        heads = torch.cat([_head(x, attn, h, hd) for h in range(width // hd)], 1)  # [t, D]
        want = heads @ attn.w_out[0, 0, 0, :, :width].T + attn.b_out[0, 0, 0]
    assert torch.allclose(got, want, atol=1e-5)


def test_a_width_the_head_dim_does_not_divide_is_refused():
    arch = Arch(StackArch((16, 16), (32, 32)), StackArch((16, 16), (32, 32)))
    model = SuperTransformer(11, 16, 2, arch, head_dim=8)
    narrower = Arch(StackArch((12, 16), (32, 32)), StackArch((16, 16), (32, 32)))
    with pytest.raises(ValueError, match="not divisible by the head width head_dim=8"):
        model.check_arch(narrower)


def test_the_head_width_is_kept_by_extraction_and_old_configs_keep_the_fixed_head_count():
    arch = Arch(StackArch((16, 16), (32, 32)), StackArch((16, 16), (32, 32)))
    model = SuperTransformer(11, 16, 2, arch, head_dim=4)
    assert SuperTransformer.from_config(model.config()).head_dim == 4
    legacy = model.config()
    del legacy["head_dim"]  # written before head_dim existed: 2 heads at every width
    assert SuperTransformer.from_config(legacy).decoder[0].self_attn.heads_of(8) == 2
    assert model.decoder[0].self_attn.heads_of(8) == 2 and model.decoder[0].self_attn.heads_of(16) == 4
