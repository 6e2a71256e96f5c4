"""``SuperTransformer.step_logits``: a decoder step's logits from a transposed copy of the tied embedding, kept
between steps and batches. The copy must follow every change of the embedding, and it must not travel with the model."""

from __future__ import annotations

import copy
import pickle

import torch

from nas.model import SuperTransformer
from nas.space.arch import Arch, StackArch

V, C = 53, 16


def _model(seed: int = 0, **kw) -> SuperTransformer:
    torch.manual_seed(seed)
    maxima = Arch(StackArch((C,), (32,), (1,)), StackArch((C,), (32,), (1,)))
    return SuperTransformer(V, C, 2, maxima, dropout=0.0, **kw).eval()


def _reference(model: SuperTransformer, x: torch.Tensor) -> torch.Tensor:
    """Final layer norm, then the tied embedding as a loop of dot products in float64 (independent of the kernels)."""
    h = torch.nn.functional.layer_norm(x.double(), (C,), model.decoder_norm.weight.double(),
                                       model.decoder_norm.bias.double(), model.decoder_norm.eps)
    w = model.embed.weight.double()
    return torch.stack([torch.stack([h[i] @ w[v] for v in range(V)]) for i in range(h.size(0))])


def test_step_logits_equal_the_tied_output_layer():
    model, x = _model(), torch.randn(4, C)
    with torch.inference_mode():
        got = model.step_logits(x)
    assert got.shape == (4, V)
    assert torch.allclose(got.double(), _reference(model, x), atol=1e-5)
    assert torch.allclose(got, model.output_logits(x), atol=1e-5)


def test_the_copy_follows_an_in_place_update_and_a_loaded_state():
    model, other, x = _model(0), _model(1), torch.randn(4, C)
    with torch.inference_mode():
        model.step_logits(x)  # the copy is made
    with torch.no_grad():
        model.embed.weight.mul_(-2.0)  # an optimizer step changes the weight in place
    with torch.inference_mode():
        assert torch.allclose(model.step_logits(x).double(), _reference(model, x), atol=1e-5)
    model.load_state_dict(other.state_dict())
    with torch.inference_mode():
        assert torch.allclose(model.step_logits(x).double(), _reference(other, x), atol=1e-5)


def test_the_copy_is_a_plain_tensor_and_stays_out_of_copies_and_pickles():
    model, x = _model(), torch.randn(2, C)
    size = len(pickle.dumps(model))
    with torch.inference_mode():
        model.step_logits(x)  # made under inference mode ...
    with torch.no_grad():
        model.step_logits(x)  # ... and usable outside it
    assert len(pickle.dumps(model)) == size  # nothing more travels with the model (to a Ray worker, say)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.embed.weight.zero_()
    with torch.inference_mode():
        assert torch.allclose(model.step_logits(x).double(), _reference(model, x), atol=1e-5)
        assert bool((twin.step_logits(x) == 0).all())
