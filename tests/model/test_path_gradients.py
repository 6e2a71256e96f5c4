"""The multi-path training backward (issue 41): PathNorm with the weighted sum (``nas.model.paths._PathNormSum``)
and the per-path layer norm folded into the first projection (``nas.model.ffn._Fold``) are custom autograd
Functions. Their values and gradients are checked against autograd through a loop transcription of Multi-Path
eq. 4-7 built from ``F.layer_norm`` and plain products, one path and one unit at a time."""

import pytest
import torch
import torch.nn.functional as F

from nas.model.ffn import ElasticFFN, path_ffn
from nas.model.paths import PathFusion

C = 16


def _perturbed(module, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return module


def _reference_fuse(fusion, x, ys, keep, units, n_paths, c):
    """``beta_u x_u + sum_i keep_i alpha_i PathNorm_i(y_i)`` (eq. 6), plus eq. 7's averages with more features."""
    out = []
    for u in range(units):
        paths = [ys[u * n_paths + i] for i in range(n_paths)]
        acc = fusion.beta[u] * x[u]
        for i, y in enumerate(paths):
            term = fusion.alpha[u, i] * F.layer_norm(y, (c,), fusion.pathnorm_weight[u, i, :c],
                                                     fusion.pathnorm_bias[u, i, :c])
            if fusion.more_features and n_paths >= 3:
                new = sum(paths[k] for k in range(n_paths) if k != i) / (n_paths - 1)
                term = term + fusion.new_alpha[u, i] * F.layer_norm(new, (c,), fusion.new_pathnorm_weight[u, i, :c],
                                                                    fusion.new_pathnorm_bias[u, i, :c])
            acc = acc + (term if keep is None else keep[u * n_paths + i][:, None, None] * term)
        out.append(acc)
    return torch.stack(out)


def _grads(out, weights, tensors):
    grads = torch.autograd.grad((out.float() * weights).sum(), tensors, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g.float() for t, g in zip(tensors, grads)]


@pytest.mark.parametrize("units,n_paths,c,drop,more", [
    (1, 4, C, False, False), (1, 2, C, True, False), (2, 3, C, True, False), (1, 3, 8, False, False),
    (2, 4, 8, True, True)])
def test_fuse_values_and_gradients_match_the_loop_transcription(units, n_paths, c, drop, more):
    fusion = _perturbed(PathFusion(C, max_paths=4, more_features=more, max_units=2), seed=n_paths + units)
    x = torch.randn(units, 3, 5, c, requires_grad=True)
    ys = torch.randn(units * n_paths, 3, 5, c, requires_grad=True)
    keep = (torch.rand(units * n_paths, 3) >= 0.4).float() / 0.6 if drop else None
    if drop:
        assert (keep == 0).any(), "the seed must drop something for the test to mean anything"
    tensors = [x, ys, *fusion.parameters()]
    got = fusion.fuse(x, ys, keep)
    want = _reference_fuse(fusion, x, ys, keep, units, n_paths, c)
    assert (got - want).abs().max().item() <= 1e-5
    weights = torch.randn_like(want)
    for name, g, w in zip(["x", "ys", *dict(fusion.named_parameters())], _grads(got, weights, tensors),
                          _grads(want, weights, tensors)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _reference_path_ffn(fusion, ffn, x, width, units, n_paths):
    """``FFN_i(LN_i(x_u))`` per unit and path (eq. 5), the layer norm applied to the input, not folded."""
    c = x.size(-1)
    out = []
    for u in range(units):
        for i in range(n_paths):
            h = F.layer_norm(x[u], (c,), fusion.ln_weight[u, i, :c], fusion.ln_bias[u, i, :c])
            out.append(F.relu(h @ ffn.w1[u, i, :width, :c].T + ffn.b1[u, i, :width]) @ ffn.w2[u, i, :c, :width].T
                       + ffn.b2[u, i, :c])
    return torch.stack(out)


@pytest.mark.parametrize("units,n_paths,width,c", [(1, 4, 24, C), (2, 3, 12, C), (1, 2, 24, 8), (2, 1, 12, C)])
def test_the_folded_ffn_values_and_gradients_match_the_loop_transcription(units, n_paths, width, c):
    fusion = _perturbed(PathFusion(C, max_paths=4, max_units=2), seed=1)
    ffn = _perturbed(ElasticFFN(C, 24, max_paths=4, max_units=2), seed=2)
    x = torch.randn(units, 3, 5, c, requires_grad=True)
    tensors = [x, *fusion.parameters(), *ffn.parameters()]
    names = ["x", *(f"fusion.{n}" for n, _ in fusion.named_parameters()),
             *(f"ffn.{n}" for n, _ in ffn.named_parameters())]
    got = path_ffn(fusion, ffn, x, width, n_paths)
    want = _reference_path_ffn(fusion, ffn, x, width, units, n_paths)
    assert (got - want).abs().max().item() <= 1e-5
    weights = torch.randn_like(want)
    for name, g, w in zip(names, _grads(got, weights, tensors), _grads(want, weights, tensors)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_under_bf16_autocast_the_sublayer_stays_close_to_the_fp32_transcription():
    """The folded weights are written in bf16 and PathNorm's sum accumulates in fp32: values and gradients
    within bf16's precision of the fp32 loops. bf16's 8-bit mantissa through PathNorm's backward leaves
    relative errors (in norm) of 0.005-0.07 per gradient here, as the batched autograd form did before; a
    dropped or misplaced gradient would leave 1.0."""
    units, n_paths, width = 1, 4, 24
    fusion = _perturbed(PathFusion(C, max_paths=4), seed=3)
    ffn = _perturbed(ElasticFFN(C, 24, max_paths=4), seed=4)
    x = torch.randn(units, 8, 6, C, requires_grad=True)
    tensors = [x, *fusion.parameters(), *ffn.parameters()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys = path_ffn(fusion, ffn, x, width, n_paths)
        assert ys.dtype == torch.bfloat16
        got = fusion.fuse(x, ys)
    assert got.dtype == torch.float32
    want = _reference_fuse(fusion, x, _reference_path_ffn(fusion, ffn, x, width, units, n_paths), None, units,
                           n_paths, C)
    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()
    weights = torch.randn_like(want)
    names = ["x", *(f"fusion.{n}" for n, _ in fusion.named_parameters()),
             *(f"ffn.{n}" for n, _ in ffn.named_parameters())]
    for name, g, w in zip(names, _grads(got, weights, tensors), _grads(want, weights, tensors)):
        assert (g - w).norm().item() <= 0.12 * w.norm().item(), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_shared_inputs_gradient_is_autograds_through_the_stride0_batch(dtype):
    """``_BatchedLinear``'s gradient of an input read by every group is what autograd computes through
    ``baddbmm`` of the expanded input: each group's product, summed over the groups (in fp32, rounded once).
    In bf16 the group products round before the sum, so a single ``[N, G*O] x [G*O, I]`` product (the code
    before) rounds differently and fails this bit-for-bit comparison."""
    from nas.model.ffn import _BatchedLinear

    torch.manual_seed(0)
    groups, n, i, o = 4, 64, 32, 48
    x = torch.randn(n, i, dtype=dtype, requires_grad=True)
    w = torch.randn(groups, o, i, dtype=dtype, requires_grad=True)
    b = torch.randn(groups, 1, o, dtype=dtype, requires_grad=True)
    grad = torch.randn(groups, n, o, dtype=dtype)
    (got,) = torch.autograd.grad(_BatchedLinear.apply(b, x, w), x, grad)
    (want,) = torch.autograd.grad(torch.baddbmm(b, x.expand(groups, n, i), w.transpose(1, 2)), x, grad)
    assert got.dtype == dtype
    assert torch.equal(got, want)
