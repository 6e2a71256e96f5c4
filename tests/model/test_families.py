"""Each family against a direct, loop-based transcription of its paper's equations (small seeded tensors)."""

import math

import pytest
import torch
import torch.nn.functional as F

from nas.model import Regularization
from nas.model.layers import EncoderLayer
from nas.space.arch import LayerArch

C, H = 16, 2


def _attention(x, w_in, b_in, w_out, b_out, heads, key_pad=None):
    """Plain multi-head attention, one head at a time (Vaswani et al. eq. 1-2)."""
    q, k, v = (x @ w_in[j].T + b_in[j] for j in range(3))  # [b, t, D]
    dh = q.size(-1) // heads
    outs = []
    for h in range(heads):
        sl = slice(h * dh, (h + 1) * dh)
        scores = q[..., sl] @ k[..., sl].transpose(-1, -2) / math.sqrt(dh)  # [b, t, s]
        if key_pad is not None:
            scores = scores.masked_fill(key_pad[:, None, :], float("-inf"))
        outs.append(torch.softmax(scores, -1) @ v[..., sl])
    return torch.cat(outs, -1) @ w_out.T + b_out


def _seq(width, ffn, branches, paths) -> LayerArch:
    return LayerArch(width, ffn, branches, paths, "sequential", ())


def _reference_encoder_layer(layer, x, dims, keep=None, key_pad=None):
    """MAT eq. 6-7 inside Multi-Path eq. 4-6, transcribed with loops over paths and branches.

    ``keep``: drop-branch keep masks, ``[1, b, B + 1]`` with one path (each branch inside the attention,
    MAT eq. 5, and the FFN, eq. 7), ``[P, b, 2]`` with several (each path's attention and FFN as a whole,
    after its PathNorm)."""
    width, ffn, nb, n_paths = dims[:4]
    a, f = layer.attn, layer.ffn

    def fuse(fusion, x, ys):
        if n_paths == 1:
            return x + ys[0]
        normed = [fusion.alpha[0, p] * F.layer_norm(y, (C,), fusion.pathnorm_weight[0, p], fusion.pathnorm_bias[0, p])
                  for p, y in enumerate(ys)]
        if keep is not None:
            normed = [keep[p, :, 0][:, None, None] * y for p, y in enumerate(normed)]
        return fusion.beta[0] * x + sum(normed)

    ys = []
    for p in range(n_paths):
        h = F.layer_norm(x, (C,), layer.attn_paths.ln_weight[0, p], layer.attn_paths.ln_bias[0, p])
        total = 0
        for i in range(nb):
            beta_i = 1.0 if keep is None or n_paths > 1 else keep[p, :, i][:, None, None]  # MAT eq. 5
            total = total + beta_i * _attention(h, a.w_in[0, p, i, :, :width], a.b_in[0, p, i, :, :width],
                                                a.w_out[0, p, i, :, :width], a.b_out[0, p, i], H, key_pad)
        ys.append(total / nb)  # MAT eq. 4/6
    x = fuse(layer.attn_paths, x, ys)
    ys = []
    for p in range(n_paths):
        h = F.layer_norm(x, (C,), layer.ffn_paths.ln_weight[0, p], layer.ffn_paths.ln_bias[0, p])
        y = F.relu(h @ f.w1[0, p, :ffn].T + f.b1[0, p, :ffn]) @ f.w2[0, p, :, :ffn].T + f.b2[0, p]
        ys.append(y)
    if n_paths == 1:
        return x + (ys[0] if keep is None else keep[0, :, nb][:, None, None] * ys[0])  # MAT eq. 7
    fusion = layer.ffn_paths
    normed = [fusion.alpha[0, p] * F.layer_norm(y, (C,), fusion.pathnorm_weight[0, p], fusion.pathnorm_bias[0, p])
              for p, y in enumerate(ys)]
    if keep is not None:
        normed = [keep[p, :, 1][:, None, None] * y for p, y in enumerate(normed)]
    return fusion.beta[0] * x + sum(normed)


def _layer(max_paths=3, max_branches=3, seed=0):
    torch.manual_seed(seed)
    layer = EncoderLayer(C, H, max_width=C, max_ffn_width=24, max_branches=max_branches,
                         max_paths=max_paths)
    with torch.no_grad():  # non-trivial norms and fusion weights
        for p in layer.parameters():
            if p.dim() <= 2 and p.numel() < 200:
                p.add_(0.1 * torch.randn_like(p))
    return layer


@pytest.mark.parametrize("dims", [_seq(16, 24, 1, 1), _seq(8, 12, 2, 1), _seq(16, 12, 3, 2), _seq(8, 24, 2, 3)])
def test_encoder_layer_matches_loop_transcription_in_eval_mode(dims):
    layer = _layer().eval()
    x = torch.randn(2, 5, C)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, -2:] = True
    with torch.no_grad():
        got = layer(x, dims, pad)
        ref = _reference_encoder_layer(layer, x, dims, key_pad=pad)
    assert (got - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dims", [_seq(16, 24, 3, 1), _seq(8, 12, 2, 3)])
def test_encoder_layer_matches_loop_transcription_in_training_with_fixed_drop_branch(dims):
    layer = _layer().train()
    x = torch.randn(4, 5, C)
    rho = 0.4
    torch.manual_seed(7)
    got = layer(x, dims, None, reg=Regularization(drop_branch=rho))
    torch.manual_seed(7)
    cols = dims[2] + 1 if dims[3] == 1 else 2  # one path: branches + FFN; several: attention + FFN per path
    keep = (torch.rand(dims[3], 4, cols) >= rho).float() / (1 - rho)
    assert (keep == 0).any(), "the seed must drop something for the test to mean anything"
    ref = _reference_encoder_layer(layer, x, dims, keep)
    assert (got - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dims", [_seq(16, 24, 3, 1), _seq(8, 12, 2, 3)])
def test_in_training_the_expected_output_under_drop_branch_is_the_evaluation_output(dims):
    """MAT eq. 5: E[beta_i] = 1, so drop-branch must leave the attention sublayer's expectation unchanged,
    with paths too (a mask before PathNorm would cancel its 1/(1 - rho) and keep PathNorm's bias). The FFN
    computes zero here (its PathNorm bias stays), so the layer is linear in the attention sublayer's output
    and its expectation is exactly the evaluation output."""
    layer = _layer()
    x = torch.randn(2, 4, C)
    torch.manual_seed(3)  # fixed randomness
    with torch.no_grad():
        for w in (layer.ffn.w1, layer.ffn.b1, layer.ffn.w2, layer.ffn.b2):
            w.zero_()
        want = layer(x, dims, None)
        draws = 4000
        mean = sum(layer(x, dims, None, reg=Regularization(drop_branch=0.3)) for _ in range(draws)) / draws
    spread = (want - x).abs().mean()  # the layer's own change of x, the scale of the error
    assert (mean - want).abs().mean() <= 0.05 * spread


def test_path_weights_start_at_paper_values():
    layer = _layer(max_paths=4)
    assert torch.allclose(EncoderLayer(C, H, C, 24, 1, max_paths=4).attn_paths.alpha, torch.full((1, 4), 1 / math.sqrt(8)))
    assert EncoderLayer(C, H, C, 24, 1, max_paths=4).ffn_paths.beta[0].item() == 1.0
    assert not hasattr(EncoderLayer(C, H, C, 24, 1, max_paths=1).attn_paths, "alpha")  # one path: plain residual
    assert layer.attn_paths.ln_weight.shape == (1, 4, C)


def test_without_regularization_the_layer_is_deterministic_in_either_mode():
    """Regularisation applies exactly when passed: ``reg=None`` is deterministic in eval and train mode."""
    layer = _layer().eval()
    x = torch.randn(2, 4, C)
    dims = _seq(8, 12, 3, 3)
    with torch.no_grad():
        assert torch.equal(layer(x, dims, None), layer(x, dims, None))
        layer.train()
        assert torch.equal(layer(x, dims, None), layer(x, dims, None))
        reg = Regularization(drop_branch=0.5)
        assert not torch.equal(layer(x, dims, None, reg=reg), layer(x, dims, None, reg=reg))


@pytest.mark.parametrize("n_paths", [3, 4])
def test_more_features_add_the_averages_of_n_minus_1_paths(n_paths):
    """Multi-Path sec. 3.2, eq. 7: n new features AVG(paths without i), each with its own PathNorm and weight."""
    from nas.model.paths import PathFusion

    torch.manual_seed(n_paths)
    fusion = PathFusion(C, max_paths=4, more_features=True)
    with torch.no_grad():
        for p in fusion.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x, ys = torch.randn(2, 3, C), torch.randn(n_paths, 2, 3, C)
    expected = fusion.beta[0] * x
    for i in range(n_paths):
        expected = expected + fusion.alpha[0, i] * F.layer_norm(ys[i], (C,), fusion.pathnorm_weight[0, i], fusion.pathnorm_bias[0, i])
        others = [ys[k] for k in range(n_paths) if k != i]
        new = sum(others) / len(others)
        expected = expected + fusion.new_alpha[0, i] * F.layer_norm(new, (C,), fusion.new_pathnorm_weight[0, i],
                                                                  fusion.new_pathnorm_bias[0, i])
    with torch.no_grad():
        assert (fusion.fuse(x[None], ys)[0] - expected).abs().max().item() <= 1e-5


def test_two_paths_generate_no_new_features():
    from nas.model.paths import PathFusion

    fusion = PathFusion(C, max_paths=4, more_features=True)
    plain = PathFusion(C, max_paths=4, more_features=False)
    plain.load_state_dict({k: v for k, v in fusion.state_dict().items() if not k.startswith("new_")})
    x, ys = torch.randn(2, 3, C), torch.randn(2, 2, 3, C)
    assert torch.equal(fusion.fuse(x[None], ys), plain.fuse(x[None], ys))


# ---- Prime (Unified Transformer) -------------------------------------------------------------------


def _reference_dynamic_conv(conv, x, v, kernels, causal, pad=None):
    """Unified Transformer eq. 5-7 with loops over kernel sizes, positions and taps."""
    if pad is not None:
        v = v.masked_fill(pad[..., None], 0.0)
    bsz, t, width = v.shape
    gates = torch.softmax(torch.stack([conv.gate[str(k)][0] for k in kernels]), 0)  # eq. 7
    out = torch.zeros(bsz, t, width)
    for g, k in zip(gates, kernels):
        w = torch.softmax(x @ conv.gen_weight[str(k)][0].T + conv.gen_bias[str(k)][0], -1)  # eq. 6, [b, t, k]
        for i in range(t):
            for j in range(k):  # tap j reads position i + j - ceil((k+1)/2) + 1 (centred) or i - k + 1 + j (causal)
                pos = i - (k - 1) + j if causal else i + j - (k - 1) // 2
                if 0 <= pos < t:
                    out[:, i] += g * w[:, i, j, None] * v[:, pos]
    return out @ conv.w_out[0, :, :width].T + conv.b_out[0]


def _reference_prime_encoder_layer(layer, x, dims, pad):
    """LN(x + Attn(x) + Conv_K(x) + FFN(x)) (Unified Transformer eq. 4) with Shared Projection (Fig. 6)."""
    a, f = layer.attn, layer.ffn
    attn = sum(_attention(x, a.w_in[0, 0, i, :, :dims.width], a.b_in[0, 0, i, :, :dims.width], a.w_out[0, 0, i, :, :dims.width],
                          a.b_out[0, 0, i], H, pad) for i in range(dims.branches)) / dims.branches
    total = x + attn + F.relu(x @ f.w1[0, 0, :dims.ffn_width].T + f.b1[0, 0, :dims.ffn_width]) @ f.w2[0, 0, :, :dims.ffn_width].T + f.b2[0, 0]
    if dims.kernels:
        v = x @ a.w_in[0, 0, 0, 2, :dims.width].T + a.b_in[0, 0, 0, 2, :dims.width]  # V_C = V_A
        total = total + _reference_dynamic_conv(layer.conv, x, v, dims.kernels, causal=False, pad=pad)
    return F.layer_norm(total, (C,), layer.prime_norm_weight[0], layer.prime_norm_bias[0])


def _prime_layer(seed=0):
    torch.manual_seed(seed)
    layer = EncoderLayer(C, H, C, 24, 2, max_paths=2, layout="sequential+prime", kernel_sizes=(3, 5, 7))
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "gate" in name or "prime_norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return layer.eval()


@pytest.mark.parametrize("dims", [
    LayerArch(16, 24, 1, 1, "prime", ()),  # Prime-simple (eq. 1)
    LayerArch(8, 12, 2, 1, "prime", (3,)),
    LayerArch(16, 24, 2, 1, "prime", (3, 7)),
    LayerArch(8, 24, 1, 1, "prime", (3, 5, 7)),
])
def test_prime_encoder_layer_matches_loop_transcription(dims):
    layer = _prime_layer()
    x = torch.randn(2, 9, C)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[0, -3:] = True
    with torch.no_grad():
        got = layer(x, dims, pad)
        ref = _reference_prime_encoder_layer(layer, x, dims, pad)
    assert (got - ref).abs().max().item() <= 1e-5


def test_causal_dynamic_conv_matches_loop_transcription_and_ignores_the_future():
    from nas.model.conv import DynamicConv

    torch.manual_seed(2)
    conv = DynamicConv(C, 8, (3, 5), causal=True)
    with torch.no_grad():
        conv.gate["3"].fill_(0.7)
    x, v = torch.randn(2, 6, C), torch.randn(2, 6, 8)
    with torch.no_grad():
        got = conv(x[None], v[None], (3, 5))[0]
        assert (got - _reference_dynamic_conv(conv, x, v, (3, 5), causal=True)).abs().max().item() <= 1e-5
        v2 = v.clone()
        v2[:, 4:] += 1.0  # change the future: outputs up to position 3 must not move
        assert torch.allclose(conv(x[None], v2[None], (3, 5))[0, :, :4], got[:, :4], atol=1e-6)


def test_a_layout_the_layer_was_not_built_for_is_refused():
    layer = EncoderLayer(C, H, C, 24, 1, layout="sequential")
    with pytest.raises(ValueError, match="layout 'prime' is not built"):
        layer(torch.randn(1, 3, C), LayerArch(16, 24, 1, 1, "prime", ()), None)


# ---- MUTE units -----------------------------------------------------------------------------------

from nas.model.units import apply_unit_bias, doubly_normalize, permutation_penalty  # noqa: E402


def _reference_unit(layer, x, u, width, ffn, pad):
    """One sequential unit ``F_u`` with its own weights (MUTE eq. 8-9 in pre-norm form)."""
    a, f = layer.attn, layer.ffn
    h = F.layer_norm(x, (C,), layer.attn_paths.ln_weight[u, 0], layer.attn_paths.ln_bias[u, 0])
    x = x + _attention(h, a.w_in[u, 0, 0, :, :width], a.b_in[u, 0, 0, :, :width], a.w_out[u, 0, 0, :, :width],
                       a.b_out[u, 0, 0], H, pad)
    h = F.layer_norm(x, (C,), layer.ffn_paths.ln_weight[u, 0], layer.ffn_paths.ln_bias[u, 0])
    return x + F.relu(h @ f.w1[u, 0, :ffn].T + f.b1[u, 0, :ffn]) @ f.w2[u, 0, :, :ffn].T + f.b2[u, 0]


def _mute_layer(seed=0):
    torch.manual_seed(seed)
    layer = EncoderLayer(C, H, C, 24, 1, max_units=4, unit_bias_rate=1.0)
    with torch.no_grad():
        layer.unit_alpha.copy_(torch.tensor([0.5, 1.0, 1.5, 2.0]))
        layer.shuffle.add_(0.3 * torch.rand(4, 4))
    return layer.eval()


@pytest.mark.parametrize("units,dependency", [(2, "independent"), (3, "independent"), (3, "sequential"),
                                              (4, "sequential")])
def test_units_match_loop_transcription_of_eq_10_and_13_to_16(units, dependency):
    layer = _mute_layer()
    x = torch.randn(2, 5, C)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, -1] = True
    dims = LayerArch(16, 24, 1, 1, "sequential", (), units, "swap", dependency)
    with torch.no_grad():
        got = layer(x, dims, pad)
        outs = [_reference_unit(layer, x, u, 16, 24, pad) for u in range(units)]
        w = layer.unit_alpha[:units] / layer.unit_alpha[:units].sum()
        if dependency == "independent":
            ref = sum(w[u] * outs[u] for u in range(units))  # eq. 10
        else:
            m = layer.shuffle[:units, :units].clamp(min=0)
            m = m / m.sum(0, keepdim=True)
            m = m / m.sum(1, keepdim=True)  # eq. 17-18
            permuted = [sum(m[i, j] * outs[i] for i in range(units)) for j in range(units)]  # eq. 16
            acc, ref = 0, 0
            for i, g in enumerate(permuted, start=1):
                acc = acc + g  # eq. 14
                ref = ref + w[i - 1] * acc / i  # eq. 15
    assert (got - ref).abs().max().item() <= 1e-5


def test_unit_biases_are_training_only():
    layer = _mute_layer()
    x = torch.randn(3, 6, C)
    dims = LayerArch(16, 24, 1, 1, "sequential", (), 3, "mixed", "independent")
    with torch.no_grad():
        assert torch.equal(layer(x, dims, None), layer(x, dims, None))  # eval: golden inputs
        layer.train()
        pad = torch.zeros(3, 6, dtype=torch.bool)
        assert not torch.allclose(layer(x, dims, pad), layer.eval()(x, dims, pad))


@pytest.mark.parametrize("seed", range(5))
def test_swap_exchanges_two_positions_at_most_3_apart_inside_the_sentence(seed):
    torch.manual_seed(seed)
    x = torch.randn(6, 8, C)
    lengths = torch.tensor([8, 5, 2, 8, 4, 1])
    switch = torch.tensor([True, True, True, False, True, True])
    out = apply_unit_bias(x, "swap", lengths, torch.zeros(C), switch)
    for i in range(6):
        moved = (out[i] != x[i]).any(-1).nonzero().flatten().tolist()
        if not switch[i] or lengths[i] == 1:
            assert moved == []
            continue
        assert len(moved) in (0, 2)  # 0 when the clamped partner is the same position
        if moved:
            p, q = moved
            assert q - p <= 3 and q < lengths[i]
            assert torch.equal(out[i, p], x[i, q]) and torch.equal(out[i, q], x[i, p])


@pytest.mark.parametrize("seed", range(5))
def test_disorder_permutes_a_window_of_3_and_mask_replaces_one_position(seed):
    torch.manual_seed(seed)
    x = torch.randn(4, 7, C)
    lengths = torch.tensor([7, 3, 5, 2])
    on = torch.ones(4, dtype=torch.bool)
    out = apply_unit_bias(x, "disorder", lengths, torch.zeros(C), on)
    for i in range(4):
        moved = (out[i] != x[i]).any(-1).nonzero().flatten().tolist()
        assert all(p < lengths[i] for p in moved) and (not moved or moved[-1] - moved[0] <= 2)
        assert torch.allclose(out[i].sum(0), x[i].sum(0), atol=1e-5)  # a permutation: same multiset
    mask = torch.full((C,), 7.0)
    out = apply_unit_bias(x, "mask", lengths, mask, on)
    for i in range(4):
        masked = (out[i] == 7.0).all(-1).nonzero().flatten().tolist()
        assert len(masked) == 1 and masked[0] < lengths[i]
        assert (out[i] != x[i]).any(-1).sum() == 1


def test_autoshuffle_renormalization_and_penalty():
    m = torch.tensor([[0.7, -0.2, 0.5], [0.1, 0.9, 0.0], [0.3, 0.3, 0.6]])
    n = doubly_normalize(m)
    assert (n >= 0).all() and torch.allclose(n.sum(1), torch.ones(3))
    assert permutation_penalty(torch.eye(3)[[2, 0, 1]]).item() == pytest.approx(0.0, abs=1e-6)
    assert permutation_penalty(torch.full((3, 3), 1 / 3)).item() > 1.0


# ---- MAT proximal initialization ---------------------------------------------------------------------


def test_proximal_initialization_gives_every_branch_the_single_branch_model(tmp_path):
    """MAT sec. 3.3: N_a identical branches averaged equal the one-branch model they came from."""
    from safetensors.torch import save_file

    from nas.model import SuperTransformer
    from nas.space.arch import Arch, StackArch
    from trainers.proximal import load_proximal_source, proximal_initialize

    torch.manual_seed(0)
    one = Arch(StackArch((C, C), (24, 24), (1, 1)), StackArch((C,), (24,), (1,)))
    three = Arch(StackArch((C, C), (24, 24), (3, 3)), StackArch((C,), (24,), (3,)))
    single = SuperTransformer(40, C, H, one).eval()
    save_file({k: v.contiguous() for k, v in single.state_dict().items()}, str(tmp_path / "single.safetensors"))
    multi = SuperTransformer(40, C, H, three).eval()
    names = proximal_initialize(multi, load_proximal_source(tmp_path / "single.safetensors"))
    assert any(n.endswith("attn.w_in") for n in names) and "embed.weight" in names
    src, tgt = torch.randint(4, 40, (2, 6)), torch.randint(4, 40, (2, 5))
    with torch.no_grad():
        assert (multi(src, tgt, three) - single(src, tgt)).abs().max().item() <= 1e-5
    with pytest.raises(FileNotFoundError, match="train.proximal_init"):
        load_proximal_source(tmp_path / "missing.safetensors")
