"""The label-smoothed loss fused with the tied output layer (``nas.model.losses.linear_label_smoothed_nll``) against
a loop transcription of the smoothed cross-entropy (Szegedy et al. 2016) and against autograd through the unfused
path, and a supernet training step that uses it against one that does not."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from nas.model.losses import label_smoothed_nll, linear_label_smoothed_nll


def loop_loss(hidden, weight, target, eps, pad_id):
    """Per token: (1 - eps) * -log p(y) + eps * mean_j -log p(j), p the softmax of hidden @ weight.T; pads skipped."""
    loss = nll = 0.0
    for h, y in zip(hidden.reshape(-1, hidden.size(-1)).tolist(), target.reshape(-1).tolist()):
        if y == pad_id:
            continue
        z = [sum(a * b for a, b in zip(h, row)) for row in weight.tolist()]
        top = max(z)
        lse = top + math.log(sum(math.exp(v - top) for v in z))
        nll += lse - z[y]
        loss += (1 - eps) * (lse - z[y]) + eps * sum(lse - v for v in z) / len(z)
    return loss, nll


def _inputs(b=3, t=5, e=8, v=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, e, generator=g, dtype=torch.float64).float()
    weight = torch.randn(v, e, generator=g).float()
    target = torch.randint(1, v, (b, t), generator=g)
    target[0, -2:] = 0  # padding
    target[2, -1] = 0
    return hidden, weight, target


@pytest.mark.parametrize("chunk", [1, 4, 7, 512])
def test_loss_matches_the_loop_transcription(chunk):
    hidden, weight, target = _inputs()
    loss, nll = linear_label_smoothed_nll(hidden, weight, target, 0.1, 0, chunk=chunk)
    want_loss, want_nll = loop_loss(hidden.double(), weight.double(), target, 0.1, 0)
    assert float(loss) == pytest.approx(want_loss, rel=1e-5)
    assert float(nll) == pytest.approx(want_nll, rel=1e-5)


@pytest.mark.parametrize("chunk", [1, 6, 512])
def test_gradients_match_autograd_through_the_unfused_path(chunk):
    hidden, weight, target = _inputs(seed=1)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, _ = label_smoothed_nll(F.linear(h1, w1), target, 0.2, 0)
    (3.0 * loss).backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    fused, _ = linear_label_smoothed_nll(h2, w2, target, 0.2, 0, chunk=chunk)
    (3.0 * fused).backward()
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=1e-5, atol=1e-6)
    assert float(fused.detach()) == pytest.approx(float(loss.detach()), rel=1e-6)


def test_padding_contributes_nothing():
    hidden, weight, target = _inputs(seed=2)
    h = hidden.clone().requires_grad_()
    loss, _ = linear_label_smoothed_nll(h, weight, target, 0.1, 0, chunk=4)
    loss.backward()
    assert torch.all(h.grad[target.eq(0)] == 0)
    assert torch.any(h.grad[target.ne(0)] != 0)


def test_under_bf16_autocast_it_stays_close_to_the_unfused_path():
    hidden, weight, target = _inputs(b=4, t=16, e=32, v=50, seed=3)
    grads = []
    for fused in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (linear_label_smoothed_nll(h, w, target, 0.1, 0, chunk=16)[0] if fused
                    else label_smoothed_nll(F.linear(h, w), target, 0.1, 0)[0])
        loss.backward()
        assert loss.dtype == torch.float32 and h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
        grads.append((float(loss), h.grad, w.grad))
    (l0, h0, w0), (l1, h1, w1) = grads
    assert l1 == pytest.approx(l0, rel=1e-3)
    torch.testing.assert_close(h1, h0, rtol=0.05, atol=2e-3)
    torch.testing.assert_close(w1, w0, rtol=0.05, atol=2e-3)


def test_bad_arguments_are_named():
    hidden, weight, target = _inputs()
    with pytest.raises(ValueError, match="chunk=0"):
        linear_label_smoothed_nll(hidden, weight, target, 0.1, chunk=0)
    with pytest.raises(ValueError, match="target"):
        linear_label_smoothed_nll(hidden, weight, target[:, :-1], 0.1)


def test_a_sandwich_step_trains_as_the_unfused_loss_does():
    """One joint-stage step (no teacher: the fused path) gives the gradients autograd gives through the logits."""
    from nas.builders import build_space, build_supernet
    from nas.data import Batch
    from contextlib import nullcontext

    import yaml

    from nas.space.loader import parse_spec
    from trainers.stages.base import SandwichArchs
    from trainers.stages.sandwich import sandwich_step

    spec = parse_spec(yaml.safe_load(_SPEC))
    space = build_space(spec)
    torch.manual_seed(0)
    model = build_supernet(spec, 40, space).train()
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, 40, (3, 7), generator=g)
    tgt = torch.randint(4, 40, (3, 6), generator=g)
    tgt[0, -2:] = 0
    batch = Batch(src=src, tgt_in=torch.cat([torch.full((3, 1), 2), tgt[:, :-1]], 1), tgt_out=tgt,
                  ntokens=int(tgt.ne(0).sum()))
    archs = SandwichArchs(space, random.Random(0), 1).draw(0)
    ntokens = int(tgt.ne(0).sum())
    sandwich_step(model, [batch], archs, None, spec, nullcontext(), ntokens)
    fused = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    for arch in archs:  # the reference: logits, log_softmax and the smoothed loss through autograd
        loss, _ = label_smoothed_nll(model(batch.src, batch.tgt_in, arch), batch.tgt_out, spec.train.label_smoothing)
        (loss / ntokens).backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(fused[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert set(fused) == {n for n, p in model.named_parameters() if p.grad is not None}


_SPEC = """
name: fused
data: {train: {src: a.en, tgt: a.de}, valid: {src: b.en, tgt: b.de}}
supernet: {model_dim: 16, heads: 2, encoder_layers: 2, decoder_layers: 2, ffn_width: 32, branches: 2, dropout: 0.0}
space:
  encoder_layers: {values: [1, 2]}
  decoder_layers: {values: [1, 2]}
  width: {values: [8, 16], per_layer: true}
  ffn_width: {values: [16, 32], per_layer: true}
  branches: {values: [1, 2], per_layer: true}
train: {steps: 1, max_tokens: 64, label_smoothing: 0.1, drop_branch: 0.0}
"""


def test_without_autograd_it_computes_no_gradient_and_the_same_loss():
    hidden, weight, target = _inputs(seed=4)
    with torch.no_grad():
        loss, nll = linear_label_smoothed_nll(hidden.requires_grad_(), weight, target, 0.1, 0, chunk=4)
    want_loss, want_nll = loop_loss(hidden.detach().double(), weight.double(), target, 0.1, 0)
    assert not loss.requires_grad and loss.grad_fn is None
    assert float(loss) == pytest.approx(want_loss, rel=1e-5) and float(nll) == pytest.approx(want_nll, rel=1e-5)
