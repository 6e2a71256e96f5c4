"""Key/value-cached decoding (IncrementalDecoder) equals recomputing the whole prefix, token for token."""

import pytest
import torch

from nas.model import SuperTransformer, beam_search
from nas.model.decode import IncrementalDecoder
from nas.space.arch import Arch, StackArch

V, C, H = 37, 16, 2
MAXIMA = Arch(*(StackArch((16,) * n, (32,) * n, (2,) * n, (2,) * n, ("sequential+prime",) * n, ((3, 5),) * n, (3,) * n)
                for n in (2, 2)))
ENCODER = StackArch((8, 16), (16, 32), (2, 1), (2, 1))


def _decoder(layout="sequential", branches=1, paths=1, kernels=(), units=1, dependency="independent") -> StackArch:
    """Two decoder layers: the first with the given choices, the second plain and narrower."""
    return StackArch((16, 8), (32, 16), (branches, 1), (paths, 1), (layout, "sequential"), (kernels, ()), (units, 1),
                     (), (dependency, "independent"))


ARCHS = {
    "sequential": Arch(ENCODER, _decoder()),
    "multi-branch": Arch(ENCODER, _decoder(branches=2)),
    "multi-path": Arch(ENCODER, _decoder(paths=2, branches=2)),
    "multi-unit": Arch(ENCODER, _decoder(paths=2, units=3, dependency="sequential")),
    "prime+conv": Arch(ENCODER, _decoder("prime", branches=2, kernels=(3, 5))),
    "prime+units+model_width": Arch(ENCODER, _decoder("prime", kernels=(5,), units=2), model_width=8),
}


def _model(arch: Arch, seed: int = 0) -> SuperTransformer:
    """A perturbed random supernet (non-zero gates, biases, unit weights) whose greedy output varies by token."""
    torch.manual_seed(seed)
    model = SuperTransformer(V, C, H, MAXIMA, io_projection=arch.model_width is not None).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
        model.decoder_norm.weight.normal_()  # outputs other than the input token
    return model


def _src(b: int = 4, s: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, V, (b, s), generator=g)
    src[0, -2:] = 0  # padding in one sentence
    src[2, -1:] = 0
    return src


@pytest.mark.parametrize("name", ARCHS)
def test_incremental_decoder_logits_equal_full_recomputation(name):
    """Each step's logits equal the last position of the teacher-forced decoder; the key/value
    buffers start too short (2 positions) so they must grow."""
    arch = ARCHS[name]
    model = _model(arch)
    src = _src()
    tgt = torch.randint(4, V, (src.size(0), 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(src, tgt, arch)  # [b, t, V]
        memory, pad = model.encode(src, arch)
        decoder = IncrementalDecoder(model, memory, pad, arch, max_len=2)
        steps = torch.stack([decoder.step(tgt[:, i:i + 1]) for i in range(tgt.size(1))], 1)
    assert (steps - full).abs().max().item() <= 1e-5


@pytest.mark.parametrize("beam_size", [1, 4])
@pytest.mark.parametrize("name", ARCHS)
def test_cached_search_equals_uncached_token_for_token(name, beam_size):
    """Greedy and beam search with the cache give the hypotheses (and scores) of the same search
    recomputing every prefix. EOS is a token the model emits, so sentences finish at different
    steps and leave the batch (the cross-attention rows are dropped too)."""
    arch = ARCHS[name]
    model = _model(arch)
    src = _src()
    kw = dict(beam_size=beam_size, max_len_a=1.0, max_len_b=4, len_penalty=0.6, return_scores=True)
    with torch.no_grad():
        probe = beam_search(model, src, arch, beam_size=1, max_len_a=0.0, max_len_b=3)
        eos = probe[0][1]  # sentence 0 ends at its second token
        cached, cached_scores = beam_search(model, src, arch, eos_id=eos, **kw)
        uncached, uncached_scores = beam_search(model, src, arch, eos_id=eos, use_cache=False, **kw)
    assert cached == uncached
    assert cached_scores == pytest.approx(uncached_scores, abs=1e-5)
    assert len(set(map(len, cached))) > 1, "sentences should finish at different steps"


def test_cached_beam_search_reorders_its_state_with_the_beams():
    """Beam search differs from greedy here, so the cached state really follows reordered hypotheses."""
    arch = ARCHS["prime+conv"]
    model = _model(arch)
    src = _src()
    with torch.no_grad():
        greedy = beam_search(model, src, arch, beam_size=1, max_len_a=1.0, max_len_b=4)
        beam = beam_search(model, src, arch, beam_size=4, max_len_a=1.0, max_len_b=4)
        reference = beam_search(model, src, arch, beam_size=4, max_len_a=1.0, max_len_b=4, use_cache=False)
    assert beam == reference
    assert beam != greedy
