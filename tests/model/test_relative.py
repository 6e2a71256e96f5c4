"""Relative position representations for MUTE units (MUTE sec. 4; Shaw et al. 2018, eq. 3-6).

A unit that sees positions only at its input is permutation-equivariant, so a swap or disorder bias
would only permute its output rows. With relative positions in the encoder's self-attention (what
``nas`` builds for a supernet with units) it is not. The attention is checked against a loop
transcription of Shaw et al.'s equations.
"""

from __future__ import annotations

import math

import torch

from nas.builders import build_supernet, supernet_config
from nas.model import SuperTransformer
from nas.model.attention import MultiBranchAttention
from nas.model.supernet import extract
from nas.space import parse_spec
from nas.space.arch import Arch, LayerArch, StackArch
from tests.conftest import MULTI30K, tiny_spec_dict


def _mute_spec(tmp_path, **supernet):
    raw = tiny_spec_dict(MULTI30K, tmp_path)
    raw["supernet"] = {**raw["supernet"], "units": 2, **supernet}
    raw["space"] = {**raw["space"], "units": {"values": [1, 2], "per_layer": True}}
    return parse_spec(raw)


def _shaw(x, attn, unit, heads, hd, k, pad):
    """Loop transcription of Shaw et al. eq. 3-6 for branch 0 of path 0 of ``unit``: ``x [t, C]`` -> ``[t, C]``."""
    w, b = attn.w_in[unit, 0, 0], attn.b_in[unit, 0, 0]  # [3, D, C], [3, D]
    t = x.size(0)
    zs = []
    for h in range(heads):
        rows = slice(h * hd, (h + 1) * hd)
        q, kk, v = (x @ w[i, rows].T + b[i, rows] for i in range(3))
        z = torch.zeros(t, hd)
        for i in range(t):
            e = []
            for j in range(t):
                r = max(-k, min(k, j - i)) + k  # clip(j - i, k), eq. 5-6
                e.append(float(q[i] @ (kk[j] + attn.rel_k[unit, r, :hd])) / math.sqrt(hd))  # eq. 4
            e = torch.tensor(e).masked_fill(pad, float("-inf"))
            alpha = torch.softmax(e, 0)
            for j in range(t):
                r = max(-k, min(k, j - i)) + k
                z[i] += alpha[j] * (v[j] + attn.rel_v[unit, r, :hd])  # eq. 3
        zs.append(z)
    return torch.cat(zs, 1) @ attn.w_out[unit, 0, 0, :, :heads * hd].T + attn.b_out[unit, 0, 0]


def test_relative_attention_matches_a_loop_transcription_of_shaw_et_al():
    torch.manual_seed(0)
    hd, c, k = 4, 12, 2
    attn = MultiBranchAttention(c, 8, 1, heads=2, max_units=2, head_dim=hd, relative=k).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.1 * torch.randn_like(p))
        x = torch.randn(2, 7, c)  # 2 sentences of 7 positions (distances up to 6 > k: clipping is exercised)
        pad = torch.zeros(2, 7, dtype=torch.bool)
        pad[1, 5:] = True
        got = attn(torch.stack([x, x]), width=8, branches=1, units=2, key_pad=pad)  # [2 units, b, t, C]
        for unit in (0, 1):
            for row in (0, 1):
                want = _shaw(x[row], attn, unit, 2, hd, k, pad[row])
                assert torch.allclose(got[unit, row], want, atol=1e-5), (unit, row)


def test_a_swapped_unit_is_not_a_row_permutation_of_the_unbiased_unit(tmp_path):
    """MUTE sec. 3.2's swap bias must give a unit another view of the sentence: ``f(P x) != P f(x)``."""
    spec = _mute_spec(tmp_path)
    torch.manual_seed(0)
    model = build_supernet(spec, 50).eval()
    layer = model.encoder[0]
    dims = LayerArch(32, 64, 1, 1, "sequential", (), 2)  # relative_layers "units": relative positions with units
    x = torch.randn(1, 6, 32)
    perm = torch.tensor([0, 2, 1, 3, 4, 5])  # swap positions 1 and 2
    with torch.no_grad():
        swapped = layer(x[:, perm], dims, None)
        permuted = layer(x, dims, None)[:, perm]
    assert (swapped - permuted).abs().max() > 1e-3


def test_relative_positions_default_to_the_units_and_old_configs_keep_absolute_ones(tmp_path):
    spec = _mute_spec(tmp_path)
    assert supernet_config(spec, 50)["relative_positions"] == 16
    assert supernet_config(_mute_spec(tmp_path, relative_positions=4), 50)["relative_positions"] == 4
    plain = parse_spec(tiny_spec_dict(MULTI30K, tmp_path))
    assert supernet_config(plain, 50)["relative_positions"] == 0
    model = build_supernet(plain, 50)
    assert "relative_positions" not in model.config()  # configs saved before it existed load unchanged
    assert not any("rel_" in name for name in model.state_dict())


def test_an_extracted_sub_transformer_keeps_its_relative_positions():
    torch.manual_seed(0)
    stack = StackArch((16, 16), (32, 32), units=(2, 2))
    model = SuperTransformer(40, 16, 2, Arch(stack, StackArch((16, 16), (32, 32))), head_dim=8,
                             relative_positions=3).eval()
    arch = Arch(StackArch((8, 16), (16, 32), units=(1, 2)), StackArch((16,), (32,)))
    src, tgt = torch.randint(3, 40, (2, 9)), torch.randint(3, 40, (2, 5))
    with torch.no_grad():
        sub = extract(model, arch).eval()
        assert torch.allclose(sub(src, tgt, arch), model(src, tgt, arch), atol=1e-5)
