"""HAT's arbitrary encoder-decoder attention (Wang et al. 2020, sec. 3.1): a decoder layer attends to the last k
encoder layers, "the key and value vectors from encoder layers are concatenated in the sentence length dimension".

The references here are independent of the model's code path: a loop over sentences, heads and encoder layers
written from the paper's sentence (and HAT's ``transformer_super.py`` for which outputs and which norm), the
forward pass as it was before the choice existed, and the supernet for the extracted model. The cached decoding
paths run the contract suite of ``test_decoding.py``, which has encoder-attention archs in its table.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nas.errors import ArchError
from nas.model import SuperTransformer, beam_search, count_params, extract
from nas.space.arch import Arch, StackArch

V, C, H = 37, 16, 2
REPO = Path(__file__).resolve().parents[2]


def _stack(n: int, branches: int = 1, encoder_attention: tuple[int, ...] = ()) -> StackArch:
    return StackArch((C,) * n, (32,) * n, (branches,) * n, encoder_attention=encoder_attention)


def _model(maxima: Arch, seed: int = 0) -> SuperTransformer:
    """A perturbed random supernet: the layers' outputs differ clearly from one another."""
    torch.manual_seed(seed)
    model = SuperTransformer(V, C, H, maxima).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def _batch(b: int = 3, s: int = 7, t: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, V, (b, s), generator=g)
    src[0, -2:] = 0  # padding in one sentence
    return src, torch.randint(4, V, (b, t), generator=g)


def _encoder_outputs(model: SuperTransformer, src: torch.Tensor, arch: Arch) -> list[torch.Tensor]:
    """Every encoder layer's raw output ``[b, s, C]``, layer by layer."""
    pad, x, outs = src.eq(model.pad_id), model.embed_tokens(src, C), []
    for layer, dims in zip(model.encoder, arch.encoder.layer_dims()):
        x = layer(x, dims, pad)
        outs.append(x)
    return outs


def _loop_cross_attention(attn, xs: torch.Tensor, outs: list[torch.Tensor], norm, pad: torch.Tensor,
                          k: int) -> torch.Tensor:
    """The paper's cross-attention of queries ``xs [b, t, C]`` over encoder layers L-k+1 .. L (one branch, one
    path), one sentence and one head at a time: each layer's keys and values projected by the same weights, then
    concatenated along the source length; the softmax runs over the concatenation. HAT's code gives the last
    layer the encoder's final layer norm and the others none."""
    sources = outs[len(outs) - k:]  # layers L-k+1 .. L
    sources[-1] = F.layer_norm(sources[-1], (C,), norm.weight, norm.bias, norm.eps)
    wq, wk, wv = attn.w_in[0, 0, 0]  # each [D, C]
    bq, bk, bv = attn.b_in[0, 0, 0]  # each [D]
    wo, bo = attn.w_out[0, 0, 0], attn.b_out[0, 0, 0]  # [C, D], [C]
    dh = wq.size(0) // H
    out = torch.zeros(xs.shape)
    for n in range(xs.size(0)):
        heads = []
        for h in range(H):
            rows = slice(h * dh, (h + 1) * dh)
            q = xs[n] @ wq[rows].T + bq[rows]  # [t, dh]
            keys = torch.cat([mem[n] @ wk[rows].T + bk[rows] for mem in sources])  # [k*s, dh]
            values = torch.cat([mem[n] @ wv[rows].T + bv[rows] for mem in sources])  # [k*s, dh]
            padded = torch.cat([pad[n]] * k)  # [k*s]
            scores = (q @ keys.T / math.sqrt(dh)).masked_fill(padded, float("-inf"))  # [t, k*s]
            heads.append(torch.softmax(scores, -1) @ values)  # [t, dh]
        out[n] = torch.cat(heads, -1) @ wo.T + bo  # [t, C]
    return out


@pytest.mark.parametrize("enc_layers, k", [(3, 2), (3, 3), (2, 3)], ids=["last 2 of 3", "all 3", "3 clamped to 2"])
def test_cross_attention_equals_a_loop_over_the_concatenated_encoder_layers(enc_layers, k):
    maxima = Arch(_stack(3), _stack(2, encoder_attention=(3, 3)))
    model = _model(maxima)
    arch = Arch(_stack(enc_layers), _stack(2, encoder_attention=(1, k)))
    src, tgt = _batch()
    seen = {}
    layer = model.decoder[1]
    hook = layer.cross_attn.register_forward_hook(lambda m, args, out: seen.update(xs=args[0], out=out))
    try:
        with torch.no_grad():
            model(src, tgt, arch)
    finally:
        hook.remove()
    with torch.no_grad():
        outs = _encoder_outputs(model, src, arch)
        expected = _loop_cross_attention(layer.cross_attn, seen["xs"][0], outs, model.encoder_norm, src.eq(0),
                                         min(k, enc_layers))
    assert seen["out"].shape == (1, *expected.shape)  # [G, b, t, C]
    assert (seen["out"][0] - expected).abs().max().item() <= 1e-5
    assert arch.attended_layers == (1, min(k, enc_layers))


def _forward_before_encoder_attention(model: SuperTransformer, src: torch.Tensor, tgt: torch.Tensor,
                                      arch: Arch) -> torch.Tensor:
    """``model(src, tgt, arch)`` as it was before the choice existed: every decoder layer reads the normed last
    encoder output."""
    pad = src.eq(model.pad_id)
    memory = model._norm(model.encoder_norm, _encoder_outputs(model, src, arch)[-1])
    y = model.embed_tokens(tgt, C)
    for layer, dims in zip(model.decoder, arch.decoder.layer_dims()):
        y = layer(y, memory, dims, pad)
    return model.output_logits(y)


def test_attending_to_the_last_layer_only_is_the_model_before_the_choice_bit_for_bit():
    maxima = Arch(_stack(3, branches=2), _stack(2, branches=2, encoder_attention=(3, 3)))
    model = _model(maxima)
    plain = _model(dataclasses.replace(maxima, decoder=_stack(2, branches=2)))  # maxima without the choice
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
    assert count_params(model) == count_params(plain)  # no parameters of its own
    src, tgt = _batch()
    arch = Arch(StackArch((C, 8, C), (32, 16, 32), (2, 1, 1)), StackArch((8, C), (16, 32), (1, 2)))
    explicit = dataclasses.replace(arch, decoder=dataclasses.replace(arch.decoder, encoder_attention=(1, 1)))
    assert explicit == arch and explicit.arch_id == arch.arch_id
    with torch.no_grad():
        before = _forward_before_encoder_attention(model, src, tgt, arch)
        assert torch.equal(model(src, tgt, arch), before)
        assert torch.equal(plain(src, tgt, arch), before)
        assert model.encode(src, arch)[0].shape == (3, 7, C)
    assert beam_search(model, src, arch, beam_size=3) == beam_search(plain, src, arch, beam_size=3)


def test_memory_is_the_normed_last_layer_then_the_raw_earlier_ones_newest_first():
    model = _model(Arch(_stack(3), _stack(2, encoder_attention=(3, 3))))
    src, _ = _batch()
    arch = Arch(_stack(3), _stack(2, encoder_attention=(3, 2)))
    with torch.no_grad():
        memory, pad = model.encode(src, arch)
        outs = _encoder_outputs(model, src, arch)
        sources = model.cross_sources(memory, pad, arch)
    s = src.size(1)
    assert memory.shape == (3, 3 * s, C) and pad.shape == (3, s)
    assert torch.equal(memory[:, :s], model._norm(model.encoder_norm, outs[2]))
    assert torch.equal(memory[:, s:2 * s], outs[1]) and torch.equal(memory[:, 2 * s:], outs[0])
    assert [m.size(1) for m, _ in sources] == [3 * s, 2 * s]
    assert torch.equal(sources[1][1], torch.cat([pad, pad], 1))
    with pytest.raises(ValueError, match="encode with the same arch|for the same arch"):
        model.decode(src[:, :3], memory[:, :2 * s], pad, arch)


def test_extracted_sub_transformer_with_encoder_attention_equals_the_supernet():
    maxima = Arch(_stack(3, branches=2), _stack(2, branches=2, encoder_attention=(3, 3)))
    model = _model(maxima, seed=3)
    arch = Arch(StackArch((C, 8, C), (32, 16, 32), (2, 1, 2)),
                StackArch((8, C), (16, 32), (1, 2), encoder_attention=(2, 1)))
    sub = extract(model, arch)
    assert sub.max_arch == arch and sub.full_arch == arch  # the arch's choice travels with the model
    src, tgt = _batch()
    with torch.no_grad():
        assert (sub(src, tgt) - model(src, tgt, arch)).abs().max().item() <= 1e-5
    assert beam_search(sub, src, beam_size=3) == beam_search(model, src, arch, beam_size=3)
    reloaded = SuperTransformer.from_config(json.loads(json.dumps(sub.config())))
    assert reloaded.max_arch == arch


def test_an_arch_beyond_the_supernet_s_encoder_attention_is_refused_with_the_choice_named():
    model = _model(Arch(_stack(3), _stack(2)))  # trained without the choice: every decoder layer attends to 1
    src, tgt = _batch()
    with pytest.raises(ArchError, match=r"arch\.decoder\.encoder_attention\[1\]=2 exceeds the supernet's 1"):
        model(src, tgt, Arch(_stack(3), _stack(2, encoder_attention=(1, 2))))


def test_arch_carries_encoder_attention_in_its_summary_and_json_only_when_used():
    arch = Arch(_stack(3), StackArch((128, 64), (512, 256), encoder_attention=(2, 1)))
    assert arch.summary() == "enc[16/32 16/32 16/32] dec[128/512e2 64/256]"
    assert Arch.parse(arch.summary()) == arch and Arch.from_json(arch.to_json()) == arch
    assert arch.to_dict()["decoder"]["encoder_attention"] == [2, 1]
    assert "encoder_attention" not in Arch(_stack(3), _stack(2)).to_dict()["decoder"]
    with pytest.raises(ArchError, match="only decoder layers attend to encoder layers"):
        Arch(_stack(2, encoder_attention=(1, 2)), _stack(1))
    with pytest.raises(ArchError, match="e0 \\(encoder_attention\\) must be >= 1"):
        Arch.parse("enc[16/32] dec[16/32e0]")


def test_committed_results_keep_their_arch_ids():
    """Results key on ``arch_id``: an arch saved before the choice existed keeps its id (the JSON leaves
    ``encoder_attention`` out when every layer's is 1)."""
    files = sorted((REPO / "experiments" / "ground_truth" / "archs").glob("*.json"))
    assert files
    for path in files:
        record = json.loads(path.read_text())
        assert Arch.from_dict(record["arch"]).arch_id == record["arch_id"], path.name
