"""The supernet against independent references: torch.nn.Transformer, extraction, cached decoding."""

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from nas.model import Regularization, SuperTransformer, beam_search, count_params, extract
from nas.space.arch import Arch, StackArch

V, C, H = 37, 16, 2


def _maxima(enc_layers=2, dec_layers=2, width=16, ffn=32, branches=3, paths=1, kernels=(), units=1) -> Arch:
    layout = "sequential+prime" if kernels else "sequential"
    stack = lambda n: StackArch((width,) * n, (ffn,) * n, (branches,) * n, (paths,) * n, (layout,) * n, (kernels,) * n,
                                (units,) * n)
    return Arch(stack(enc_layers), stack(dec_layers))


def _batch(seed=0, b=3, s=7, t=5):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, V, (b, s), generator=g)
    tgt = torch.randint(4, V, (b, t), generator=g)
    src[0, -2:] = 0  # padding in one sentence
    return src, tgt


def _random_arch(maxima: Arch, g: torch.Generator) -> Arch:
    def stack(m: StackArch) -> StackArch:
        n = int(torch.randint(1, m.layers + 1, (1,), generator=g))
        pick = lambda hi, step: tuple(int(torch.randint(1, hi // step + 1, (1,), generator=g)) * step for _ in range(n))
        layouts = tuple("prime" if "prime" in m.layout[0] and torch.rand(1, generator=g) < 0.5 else "sequential"
                        for _ in range(n))
        paths = tuple(p if lay == "sequential" else 1 for p, lay in zip(pick(m.paths[0], 1), layouts))
        kernels = tuple(tuple(k for k in m.kernels[0] if torch.rand(1, generator=g) < 0.6) if lay == "prime" else ()
                        for lay in layouts)
        units = pick(m.units[0], 1)
        biases = tuple(["identity", "swap", "disorder", "mask", "mixed"][int(torch.randint(5, (1,), generator=g))]
                       if u > 1 else "identity" for u in units)
        deps = tuple("sequential" if u > 1 and torch.rand(1, generator=g) < 0.5 else "independent" for u in units)
        return StackArch(pick(m.width[0], H * 2), pick(m.ffn_width[0], 4), pick(m.branches[0], 1), paths, layouts,
                         kernels, units, biases, deps)
    return Arch(stack(maxima.encoder), stack(maxima.decoder))


def _sinusoid(n, d):
    pe = torch.zeros(n, d)
    for p in range(n):
        for i in range(0, d, 2):
            pe[p, i] = math.sin(p / 10000 ** (i / d))
            pe[p, i + 1] = math.cos(p / 10000 ** (i / d))
    return pe


def _copy_into_reference(model: SuperTransformer, ref: nn.Transformer, c: int = C, f: int = 32) -> None:
    """Copy path 0, branch 0 of every supernet layer into torch.nn.Transformer's parameters,
    cropped to model width ``c`` (= attention width) and FFN width ``f`` by hand."""
    def mha(dst: nn.MultiheadAttention, src):
        dst.in_proj_weight.copy_(src.w_in[0, 0, 0, :, :c, :c].reshape(3 * c, c))
        dst.in_proj_bias.copy_(src.b_in[0, 0, 0, :, :c].reshape(-1))
        dst.out_proj.weight.copy_(src.w_out[0, 0, 0, :c, :c])
        dst.out_proj.bias.copy_(src.b_out[0, 0, 0, :c])

    def ffn(dst, src):
        dst.linear1.weight.copy_(src.w1[0, 0, :f, :c]); dst.linear1.bias.copy_(src.b1[0, 0, :f])
        dst.linear2.weight.copy_(src.w2[0, 0, :c, :f]); dst.linear2.bias.copy_(src.b2[0, 0, :c])

    def norm(dst: nn.LayerNorm, src):
        dst.weight.copy_(src.ln_weight[0, 0, :c]); dst.bias.copy_(src.ln_bias[0, 0, :c])

    with torch.no_grad():
        for r, m in zip(ref.encoder.layers, model.encoder):
            mha(r.self_attn, m.attn); ffn(r, m.ffn)
            norm(r.norm1, m.attn_paths); norm(r.norm2, m.ffn_paths)
        for r, m in zip(ref.decoder.layers, model.decoder):
            mha(r.self_attn, m.self_attn); mha(r.multihead_attn, m.cross_attn); ffn(r, m.ffn)
            norm(r.norm1, m.self_attn_paths); norm(r.norm2, m.cross_attn_paths); norm(r.norm3, m.ffn_paths)
        for dst, src in ((ref.encoder.norm, model.encoder_norm), (ref.decoder.norm, model.decoder_norm)):
            dst.weight.copy_(src.weight[:c]); dst.bias.copy_(src.bias[:c])


def test_degenerate_arch_matches_torch_transformer():
    torch.manual_seed(0)
    maxima = _maxima(width=C, ffn=32, branches=1)
    model = SuperTransformer(V, C, H, maxima, dropout=0.1, drop_branch=0.0).eval()
    ref = nn.Transformer(C, H, 2, 2, 32, dropout=0.0, norm_first=True, batch_first=True).eval()
    _copy_into_reference(model, ref)
    src, tgt = _batch()
    emb = lambda x: model.embed.weight[x] * math.sqrt(C) + _sinusoid(x.size(1), C)
    causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1))
    with torch.no_grad():
        hidden = ref(emb(src), emb(tgt), tgt_mask=causal, src_key_padding_mask=src.eq(0),
                     memory_key_padding_mask=src.eq(0), tgt_is_causal=True)
        expected = hidden @ model.embed.weight.T
        got = model(src, tgt, maxima)
    assert (got - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("c", [8, 12, 16])
def test_type1_sub_transformer_matches_torch_transformer_with_eq3_projections(c):
    """Type-1 Scalable Transformers (sec. 3.2, eq. 3): every layer at model width c is nn.Transformer(d_model=c)
    on ``E' = W'_e[1:c] E + b'_e[1:c]``, followed by ``O' = W'_o[:, 1:c] O + b'_o`` and the tied embedding."""
    torch.manual_seed(6)
    maxima = _maxima(width=C, ffn=32, branches=1)
    model = SuperTransformer(V, C, H, maxima, dropout=0.1, drop_branch=0.0, io_projection=True).eval()
    with torch.no_grad():  # leave the identity initialisation: the crop must matter
        for p in (model.proj_in.weight, model.proj_in.bias, model.proj_out.weight, model.proj_out.bias):
            p.add_(0.3 * torch.randn_like(p))
    f = 2 * c
    stack = StackArch((c, c), (f, f))
    arch = Arch(stack, stack, model_width=c)
    ref = nn.Transformer(c, H, 2, 2, f, dropout=0.0, norm_first=True, batch_first=True).eval()
    _copy_into_reference(model, ref, c, f)
    src, tgt = _batch()
    emb = lambda x: (model.embed.weight[x] * math.sqrt(C) + _sinusoid(x.size(1), C)) @ model.proj_in.weight[:c].T \
        + model.proj_in.bias[:c]
    causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1))
    with torch.no_grad():
        hidden = ref(emb(src), emb(tgt), tgt_mask=causal, src_key_padding_mask=src.eq(0),
                     memory_key_padding_mask=src.eq(0), tgt_is_causal=True)
        expected = (hidden @ model.proj_out.weight[:, :c].T + model.proj_out.bias) @ model.embed.weight.T
        got = model(src, tgt, arch)
        sub = extract(model, arch)
        standalone = sub(src, tgt)
    assert (got - expected).abs().max().item() <= 1e-5
    assert (standalone - expected).abs().max().item() <= 1e-5
    assert sub.model_dim == c and sub.embed_dim == C and sub.proj_in.weight.shape == (c, C)
    assert sub.encoder[0].attn.w_in.shape == (1, 1, 1, 3, c, c) and sub.encoder_norm.weight.shape == (c,)


def test_model_width_needs_io_projection_and_the_supernet_bound():
    model = SuperTransformer(V, C, H, _maxima(width=16))
    stack = StackArch((8,), (8,))
    with pytest.raises(ValueError, match="io_projection"):
        model(*_batch(), Arch(stack, stack, model_width=8))
    model = SuperTransformer(V, C, H, _maxima(width=16), io_projection=True)
    with pytest.raises(ValueError, match=r"model_width=32 exceeds the supernet's model_dim=16"):
        model(*_batch(), Arch(stack, stack, model_width=32))


def test_multi_branch_equals_average_of_single_branch_attentions():
    """MAT eq. 4: N_a branches = the mean of N_a independent MHAs (checked with nn.MultiheadAttention)."""
    torch.manual_seed(1)
    model = SuperTransformer(V, C, H, _maxima(branches=3)).eval()
    attn = model.encoder[0].attn
    x = torch.randn(2, 5, C)
    refs = []
    for i in range(2):
        mha = nn.MultiheadAttention(C, H, batch_first=True).eval()
        with torch.no_grad():
            mha.in_proj_weight.copy_(attn.w_in[0, 0, i].reshape(3 * C, C)); mha.in_proj_bias.copy_(attn.b_in[0, 0, i].reshape(-1))
            mha.out_proj.weight.copy_(attn.w_out[0, 0, i]); mha.out_proj.bias.copy_(attn.b_out[0, 0, i])
        refs.append(mha(x, x, x, need_weights=False)[0])
    with torch.no_grad():
        got = attn(x[None], width=C, branches=2)[0]
    assert (got - (refs[0] + refs[1]) / 2).abs().max().item() <= 1e-5


@pytest.mark.parametrize("seed", range(8))
def test_extract_equals_supernet_for_random_archs(seed):
    torch.manual_seed(seed)
    maxima = _maxima(enc_layers=3, dec_layers=2, width=16, ffn=32, branches=3, paths=4, kernels=(3, 5, 7), units=3)
    type1 = seed % 4 >= 2  # half the archs crop the model width too (type 1, eq. 3 projections)
    model = SuperTransformer(V, C, H, maxima, more_features=seed % 2 == 0, io_projection=type1).eval()
    with torch.no_grad():  # non-trivial unit weights and AutoShuffle matrices
        for name, p in model.named_parameters():
            if "unit_alpha" in name or "shuffle" in name or "proj_" in name:
                p.add_(0.3 * torch.rand_like(p))
    arch = _random_arch(maxima, torch.Generator().manual_seed(seed))
    if type1:
        arch = Arch(arch.encoder, arch.decoder, model_width=(4, 8, 12)[seed % 3])
    sub = extract(model, arch)
    src, tgt = _batch(seed)
    with torch.no_grad():
        diff = (sub(src, tgt) - model(src, tgt, arch)).abs().max().item()
    assert diff <= 1e-5
    assert count_params(sub) < count_params(model) or arch == maxima
    assert len(sub.encoder) == arch.encoder.layers and len(sub.decoder) == arch.decoder.layers


def test_extract_holds_only_cropped_weights():
    maxima = _maxima(width=16, ffn=32, branches=3, kernels=(3, 5, 7))
    model = SuperTransformer(V, C, H, maxima)
    arch = Arch(StackArch((8,), (12,), (2,), (), ("prime",), ((3, 7),)), StackArch((4, 16), (32, 8), (1, 3)))
    sub = extract(model, arch)
    assert sub.encoder[0].attn.w_in.shape == (1, 1, 2, 3, 8, C)
    assert sub.encoder[0].ffn.w1.shape == (1, 1, 12, C)
    assert sub.decoder[1].cross_attn.w_out.shape == (1, 1, 3, C, 16)
    assert torch.equal(sub.decoder[0].ffn.w2, model.decoder[0].ffn.w2[:1, :1, :, :32])
    assert torch.equal(sub.encoder[0].attn.w_in, model.encoder[0].attn.w_in[:1, :1, :2, :, :8])
    assert sorted(sub.encoder[0].conv.gen_weight) == ["3", "7"]  # only the chosen kernel cells
    assert not hasattr(sub.encoder[0], "attn_paths") and not hasattr(sub.decoder[0], "prime_norm_weight")
    assert torch.equal(sub.encoder[0].conv.w_out, model.encoder[0].conv.w_out[:, :, :8])


def test_arch_beyond_maxima_is_refused_with_the_choice_named():
    model = SuperTransformer(V, C, H, _maxima(width=16))
    bad = Arch(StackArch((32,), (8,), (1,)), StackArch((8,), (8,), (1,)))
    with pytest.raises(ValueError, match=r"encoder\.width\[0\]=32 exceeds"):
        model(*_batch(), bad)


def test_drop_branch_is_active_only_when_passed():
    """Regularisation is an argument of the call: none without ``reg`` (eval or train mode), the
    configured drop-branch with ``reg=model.regularization()``; the model's config is never touched."""
    torch.manual_seed(0)
    model = SuperTransformer(V, C, H, _maxima(branches=2), dropout=0.0, drop_branch=0.5)
    assert model.regularization() == Regularization(dropout=0.0, attention_dropout=0.0, drop_branch=0.5)
    assert model.regularization(drop_branch=0.1).drop_branch == 0.1 and model.drop_branch == 0.5
    src, tgt = _batch()
    model.eval()
    with torch.no_grad():
        a, b = model(src, tgt), model(src, tgt)
    assert torch.equal(a, b)
    model.train()
    with torch.no_grad():
        c, d = model(src, tgt, reg=model.regularization()), model(src, tgt, reg=model.regularization())
        e = model(src, tgt)
    assert not torch.allclose(c, d)
    assert torch.equal(a, e)
    assert model.config()["drop_branch"] == 0.5 and model.config()["dropout"] == 0.0


def test_regularization_rejects_rates_outside_0_1():
    with pytest.raises(ValueError, match="drop_branch=1.0"):
        Regularization(drop_branch=1.0)
    with pytest.raises(ValueError, match="dropout=-0.1"):
        Regularization(dropout=-0.1)


@pytest.mark.parametrize("paths,layout,kernels,units,model_width", [
    (1, "sequential", (), 1, None), (2, "sequential", (), 1, None), (1, "prime", (), 1, None),
    (1, "prime", (3, 5), 1, None), (2, "sequential", (), 3, None), (1, "prime", (5,), 2, None),
    (2, "prime", (3,), 2, 8)])
def test_cached_decoding_matches_full_recomputation(paths, layout, kernels, units, model_width):
    torch.manual_seed(3)
    maxima = _maxima(branches=2, paths=2, kernels=(3, 5), units=3)
    model = SuperTransformer(V, C, H, maxima, io_projection=model_width is not None).eval()
    dep = "sequential" if units == 3 else "independent"
    arch = Arch(StackArch((8, 16), (16, 32), (2, 1), (paths, 1)),
                StackArch((16, 8), (8, 32), (2, 1), (1 if layout == "prime" else paths, 1), (layout, "sequential"),
                          (kernels, ()), (units, 1), (), (dep, "independent")), model_width=model_width)
    src, tgt = _batch()
    with torch.no_grad():
        for p in model.parameters():  # non-zero conv kernels and gates
            p.add_(0.05 * torch.randn_like(p))
        full = model(src, tgt, arch)  # [b, t, V]
        memory, pad = model.encode(src, arch)
        cache = [{} for _ in model.decoder]
        steps = [model.decode_step(tgt[:, i:i + 1], i, memory, pad, arch, cache) for i in range(tgt.size(1))]
    assert (torch.stack(steps, 1) - full).abs().max().item() <= 1e-5


def _greedy_by_recomputation(model, src, arch, steps):
    """Greedy decoding by full recomputation, never choosing PAD (0) or BOS (2)."""
    out = torch.full((src.size(0), 1), 2)
    for _ in range(steps):
        logits = model(src, out, arch)[:, -1]
        logits[:, [0, 2]] = float("-inf")
        nxt = logits.argmax(-1, keepdim=True)
        out = torch.cat([out, nxt], 1)
    return out[:, 1:]


PRIME_UNITS = Arch(StackArch((16,), (32,), (1,), (), ("prime",), ((3,),), (2,), ("swap",), ("sequential",)),
                   StackArch((16, 8), (32, 16), (2, 1), (1, 2), ("prime", "sequential"), ((3, 5), ()), (2, 1)))


@pytest.mark.parametrize("family", ["sequential", "prime+units"])
def test_beam_size_one_equals_greedy_recomputation(family):
    torch.manual_seed(4)
    model = SuperTransformer(V, C, H, _maxima(paths=2, kernels=(3, 5), units=2)).eval()
    arch = None if family == "sequential" else PRIME_UNITS
    src, _ = _batch()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        hyps = beam_search(model, src, arch, beam_size=1, max_len_a=0.0, max_len_b=6)
        ref = _greedy_by_recomputation(model, src, arch, 6)
    for hyp, r in zip(hyps, ref.tolist()):
        r = r[: r.index(3)] if 3 in r else r[:5]
        assert hyp == r


@pytest.mark.parametrize("arch", [None, PRIME_UNITS], ids=["sequential", "prime+units"])
def test_beam_search_scores_equal_a_full_recomputation_of_the_chosen_hypotheses(arch):
    """Every beam's cached state (self-attention, causal conv, cross-attention) follows its hypothesis.
    The model is the first of a few random ones on which beam search differs from greedy (for Prime+units),
    so that the test exercises real beam reordering."""
    src, _ = _batch(b=4)
    for seed in range(5, 13):
        torch.manual_seed(seed)
        model = SuperTransformer(V, C, H, _maxima(paths=2, kernels=(3, 5), units=2)).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
            hyps, scores = beam_search(model, src, arch, beam_size=4, return_scores=True)
            if arch is None or hyps != beam_search(model, src, arch, beam_size=1):
                break
    else:
        pytest.fail("beam search equals greedy on every seed tried")
    with torch.no_grad():
        for i, (hyp, score) in enumerate(zip(hyps, scores)):
            tgt = torch.tensor([[2] + hyp])
            lp = torch.log_softmax(model(src[i:i + 1], tgt, arch), -1)[0]
            ids = hyp + [3]
            assert sum(lp[j, t].item() for j, t in enumerate(ids)) / len(ids) == pytest.approx(score, abs=1e-4)


SWEEP_FILES = sorted((Path(__file__).resolve().parents[2] / "search_spaces").glob("*.yaml"))


@pytest.mark.parametrize("path", SWEEP_FILES, ids=lambda p: p.stem)
def test_extract_equals_the_supernet_for_random_archs_of_each_shipped_space(path):
    """Every family file and unified.yaml: the standalone model of a sampled arch equals the supernet."""
    import random

    from nas.space.space import SearchSpace
    from nas.space import load_spec
    from nas.builders import build_supernet

    spec = load_spec(path, check_files=False)
    space = SearchSpace.from_spec(spec)
    torch.manual_seed(7)
    model = build_supernet(spec, V).eval()
    with torch.no_grad():  # move every parameter off its initial value (identity projections, unit weights, gates)
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    rng = random.Random(path.stem)
    src, tgt = _batch(b=2, s=6, t=5)
    for arch in [space.narrowest(), space.sample(rng), space.sample(rng)]:
        sub = extract(model, arch)
        with torch.no_grad():
            assert (sub(src, tgt) - model(src, tgt, arch)).abs().max().item() <= 1e-4, arch.summary()
