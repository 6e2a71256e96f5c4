"""One contract for every decoding path, on one table of sub-Transformers covering every family.

As optuna's ``StorageTestCase`` runs one suite against every storage, each path below must
give what the reference gives (teacher-forced ``model(src, tgt, arch)``, one pass over the
whole target) for every arch in ``ARCHS``:

- ``incremental``: :class:`IncrementalDecoder` one token per step, with key/value buffers
  that start too short (they must grow);
- ``chunks``: the same decoder fed several tokens per call (a forced prefix), which must
  attend causally;
- ``decode_step``: ``SuperTransformer.decode_step`` with the state in plain dicts (the
  interface the ONNX decoder step is exported from: past in, present out);
- ``beam search``: greedy and beam 4 with the cache give the hypotheses and scores of the same
  search recomputing every prefix, as sentences finish at different steps.

The ONNX graphs themselves are compared with PyTorch in ``test_onnx.py`` (exporting costs
seconds per arch). HAT's arbitrary encoder-decoder attention (``encoder_attention``) is in the table too: a
decoder layer whose cross-attention keys/values are those of the last k encoder layers, computed once.
"""

from __future__ import annotations

import pytest
import torch

from nas.model import SuperTransformer, beam_search
from nas.model.decode import IncrementalDecoder, beam_candidates, search
from nas.space.arch import Arch, StackArch

V, C, H = 37, 16, 2
MAXIMA = Arch(*(StackArch((16,) * n, (32,) * n, (2,) * n, (3,) * n, ("sequential+prime",) * n, ((3, 5),) * n, (3,) * n,
                          encoder_attention=(k,) * n) for n, k in ((2, 1), (2, 2))))
ENCODER = StackArch((8, 16), (16, 32), (2, 1), (2, 1))


def _decoder(layout="sequential", branches=1, paths=1, kernels=(), units=1, dependency="independent",
             encoder_attention=(1, 1)) -> StackArch:
    """Two decoder layers: the first with the given choices, the second plain and narrower; ``encoder_attention``
    of both."""
    return StackArch((16, 8), (32, 16), (branches, 1), (paths, 1), (layout, "sequential"), (kernels, ()), (units, 1),
                     (), (dependency, "independent"), encoder_attention)


# name -> (arch, SuperTransformer keyword arguments)
ARCHS: dict[str, tuple[Arch, dict]] = {
    "sequential": (Arch(ENCODER, _decoder()), {}),
    "multi-branch (MAT)": (Arch(ENCODER, _decoder(branches=2)), {}),
    "multi-path": (Arch(ENCODER, _decoder(paths=2, branches=2)), {}),
    "multi-path, more features": (Arch(ENCODER, _decoder(paths=3)), {"more_features": True}),
    "multi-unit (MUTE), eq. 10": (Arch(ENCODER, _decoder(paths=2, units=3)), {}),
    "multi-unit, AutoShuffle": (Arch(ENCODER, _decoder(paths=2, units=3, dependency="sequential")), {}),
    "prime-simple": (Arch(ENCODER, _decoder("prime", branches=2)), {}),
    "prime, two kernels": (Arch(ENCODER, _decoder("prime", branches=2, kernels=(3, 5))), {}),
    "encoder attention (HAT), last 2 then last 1": (Arch(ENCODER, _decoder(branches=2, encoder_attention=(2, 1))), {}),
    "encoder attention, prime with units": (
        Arch(ENCODER, _decoder("prime", kernels=(3,), units=2, encoder_attention=(2, 2))), {}),
    "prime, units, type-1 width": (Arch(ENCODER, _decoder("prime", kernels=(5,), units=2), model_width=8),
                                   {"io_projection": True}),
}


def _model(name: str, seed: int = 0) -> SuperTransformer:
    """A perturbed random supernet (non-zero gates, biases, unit weights) whose greedy output varies by token."""
    torch.manual_seed(seed)
    model = SuperTransformer(V, C, H, MAXIMA, **ARCHS[name][1]).eval()
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


def _tgt(b: int, t: int = 6) -> torch.Tensor:
    return torch.randint(4, V, (b, t), generator=torch.Generator().manual_seed(2))


def _incremental(model, arch, src, tgt) -> torch.Tensor:
    memory, pad = model.encode(src, arch)
    decoder = IncrementalDecoder(model, memory, pad, arch, max_len=2)  # too short: the buffers grow
    return torch.stack([decoder.step(tgt[:, i:i + 1]) for i in range(tgt.size(1))], 1)  # [b, t, V]


def _chunks(model, arch, src, tgt, sizes=(3, 1, 2)) -> torch.Tensor:
    """Logits after each chunk of ``sizes`` tokens, at the chunk's last position."""
    memory, pad = model.encode(src, arch)
    decoder = IncrementalDecoder(model, memory, pad, arch, max_len=2)
    out, start = [], 0
    for size in sizes:
        out.append(decoder.step(tgt[:, start:start + size]))
        start += size
    return torch.stack(out, 1)


def _decode_step(model, arch, src, tgt) -> torch.Tensor:
    memory, pad = model.encode(src, arch)
    cache = [{} for _ in model.decoder]
    return torch.stack([model.decode_step(tgt[:, i:i + 1], i, memory, pad, arch, cache) for i in range(tgt.size(1))], 1)


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("path", ["incremental", "decode_step"])
def test_each_step_equals_the_full_pass(name, path):
    arch, model, src = ARCHS[name][0], _model(name), _src()
    tgt = _tgt(src.size(0))
    with torch.no_grad():
        full = model(src, tgt, arch)  # [b, t, V]
        steps = {"incremental": _incremental, "decode_step": _decode_step}[path](model, arch, src, tgt)
    assert (steps - full).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", ARCHS)
def test_several_tokens_per_call_attend_causally(name):
    """A chunk of tokens fed at once gives, at its last position, the full pass's logits: the new
    positions must not see each other's future (nor the layers above their later positions)."""
    arch, model, src = ARCHS[name][0], _model(name), _src()
    tgt = _tgt(src.size(0))
    with torch.no_grad():
        full = model(src, tgt, arch)
        chunks = _chunks(model, arch, src, tgt)
    assert (chunks - full[:, [2, 3, 5]]).abs().max().item() <= 1e-5


def _varied_search(name: str, src: torch.Tensor, **kw) -> tuple[SuperTransformer, int]:
    """A random model (the first of a few seeds) and an EOS token with which the search ``kw`` ends the
    sentences at different steps: a token that greedy decoding emits at different steps."""
    arch = ARCHS[name][0]
    for seed in range(8):
        model = _model(name, seed)
        greedy = beam_search(model, src, arch, beam_size=1, max_len_a=0.0, max_len_b=6)
        for tok in sorted({t for hyp in greedy for t in hyp}):
            if len({hyp.index(tok) if tok in hyp else len(hyp) for hyp in greedy}) > 1:
                if len(set(map(len, beam_search(model, src, arch, eos_id=tok, **kw)))) > 1:
                    return model, tok
    pytest.fail(f"no seed and EOS make the search end {name!r}'s sentences at different steps")


@pytest.mark.parametrize("beam_size", [1, 4])
@pytest.mark.parametrize("name", ARCHS)
def test_cached_search_equals_uncached_token_for_token(name, beam_size):
    """Greedy and beam search with the cache give the hypotheses (and scores) of the same search
    recomputing every prefix. EOS is a token the model emits, so sentences finish at different
    steps and leave the batch (the cross-attention rows are dropped too)."""
    arch, src = ARCHS[name][0], _src()
    kw = dict(beam_size=beam_size, max_len_a=1.0, max_len_b=4, len_penalty=0.6, return_scores=True)
    with torch.no_grad():
        model, eos = _varied_search(name, src, beam_size=beam_size, max_len_a=1.0, max_len_b=4, len_penalty=0.6)
        cached, cached_scores = beam_search(model, src, arch, eos_id=eos, **kw)
        uncached, uncached_scores = beam_search(model, src, arch, eos_id=eos, use_cache=False, **kw)
    assert cached == uncached
    assert cached_scores == pytest.approx(uncached_scores, abs=1e-5)
    assert len(set(map(len, cached))) > 1, "sentences should finish at different steps"


def test_cached_beam_search_reorders_its_state_with_the_beams():
    """Beam search differs from greedy here, so the cached state really follows reordered hypotheses."""
    name = "prime, two kernels"
    arch, model, src = ARCHS[name][0], _model(name), _src()
    with torch.no_grad():
        greedy = beam_search(model, src, arch, beam_size=1, max_len_a=1.0, max_len_b=4)
        beam = beam_search(model, src, arch, beam_size=4, max_len_a=1.0, max_len_b=4)
        reference = beam_search(model, src, arch, beam_size=4, max_len_a=1.0, max_len_b=4, use_cache=False)
    assert beam == reference
    assert beam != greedy


@pytest.mark.parametrize("use_cache", [True, False])
def test_beam_search_never_emits_pad_or_bos(use_cache):
    """Even a model whose most likely next token is PAD, then BOS, emits neither (issue 14, part 1.8)."""
    name = "sequential"
    arch, model, src = ARCHS[name][0], _model(name), _src()
    with torch.no_grad():
        model.embed.weight[model.pad_id] = 5.0 * model.embed.weight.abs().max()  # tied output: PAD scores highest
        model.embed.weight[2] = 4.0 * model.embed.weight.abs().max()  # then BOS (id 2)
        memory, pad = model.encode(src, arch)
        first = model.decode(torch.full((src.size(0), 1), 2), memory, pad, arch)[:, -1].argmax(-1)
        assert set(first.tolist()) <= {model.pad_id, 2}, "the probe should prefer PAD or BOS"
        for beam_size in (1, 4):
            hyps = beam_search(model, src, arch, beam_size=beam_size, bos_id=2, eos_id=3, max_len_a=1.0, max_len_b=3,
                               use_cache=use_cache)
            assert all(hyp for hyp in hyps)
            assert not {model.pad_id, 2} & {tok for hyp in hyps for tok in hyp}


@pytest.mark.parametrize("beam_size", [1, 3])
def test_min_len_holds_back_eos_until_then_and_fixes_the_length_with_an_equal_bound(beam_size):
    """``min_len`` (fairseq's --min-len): with EOS the model's favourite token, outputs stop at once without it,
    run exactly ``min_len - 1`` tokens with it, and the best hypothesis is the search's best among those that
    end no earlier (the uncached search agrees)."""
    name = "sequential"
    arch, model, src = ARCHS[name][0], _model(name), _src()
    with torch.no_grad():
        memory, pad = model.encode(src, arch)
        eos = int(model.decode(torch.full((src.size(0), 1), 2), memory, pad, arch)[0, -1].argmax())
        free = beam_search(model, src, arch, beam_size=beam_size, eos_id=eos, max_len_a=0.0, max_len_b=9)
        fixed = beam_search(model, src, arch, beam_size=beam_size, eos_id=eos, max_len_a=0.0, max_len_b=9, min_len=9)
        uncached = beam_search(model, src, arch, beam_size=beam_size, eos_id=eos, max_len_a=0.0, max_len_b=9,
                               min_len=9, use_cache=False)
        held = beam_search(model, src, arch, beam_size=beam_size, eos_id=eos, max_len_a=0.0, max_len_b=9, min_len=4)
    assert min(map(len, free)) < 3
    assert [len(h) for h in fixed] == [8] * src.size(0) and eos not in {t for h in fixed for t in h}
    assert fixed == uncached
    assert min(map(len, held)) >= 3


class _ContinuingStepper:
    """A stepper for :func:`nas.model.decode.search` that returns, as the compiled step of ``nas.export.aot`` does,
    the candidates and what the search derives from them while every sentence goes on: the rows to continue, whether
    an EOS ranks among a sentence's first k, the grown token history. Those three are computed here by loops over
    the sentences and beams, not by the search's tensor code; ``corrupt`` replaces the history with zeros but the
    newest token (what a search that reads it must then get wrong)."""

    def __init__(self, model, arch, src, k: int, eos_id: int, corrupt: bool = False) -> None:
        memory, pad = model.encode(src, arch)
        rows = torch.arange(src.size(0)).repeat_interleave(k)
        self.decoder = IncrementalDecoder(model, memory.index_select(0, rows), pad.index_select(0, rows), arch)
        self.eos_id, self.corrupt, self.extras = eos_id, corrupt, 0

    def step(self, tokens, scores, banned, at_limit, eos_zero):
        n, k = scores.shape
        lprobs = torch.log_softmax(self.decoder.step(tokens[:, -1:]).float(), -1).view(n, k, -1)
        lprobs.index_fill_(2, banned, float("-inf"))
        for i in (i for i, at in enumerate(at_limit) if at):  # only EOS, with its log-probability (0 with eos_zero)
            eos = torch.zeros(k) if eos_zero else lprobs[i, :, self.eos_id].clone()
            lprobs[i] = float("-inf")
            lprobs[i, :, self.eos_id] = eos
        cands = beam_candidates(lprobs, scores, self.eos_id)
        next_beam, next_tok, is_eos = cands[5].tolist(), cands[6].tolist(), cands[3].tolist()
        src_rows = [i * k + next_beam[i][j] for i in range(n) for j in range(k)]
        history = tokens.tolist()
        # hypothesis i*k + j continues row src_rows[i*k + j] with token next_tok[i][j]
        grown = [([0] * len(history[r]) if self.corrupt else history[r]) + [next_tok[h // k][h % k]]
                 for h, r in enumerate(src_rows)]
        self.extras += 1
        return None, (*cands, torch.tensor(src_rows), torch.tensor(any(any(row[:k]) for row in is_eos)),
                      torch.tensor(grown))

    def reorder(self, src_rows, sent_rows):
        self.decoder.reorder(src_rows, sent_rows)


@pytest.mark.parametrize("beam_size", [1, 4])
def test_search_takes_the_rows_eos_test_and_history_a_stepper_returns(beam_size):
    """A stepper that returns the search's bookkeeping while every sentence goes on (the compiled decoder's) gets
    the eager search's hypotheses and scores, as sentences finish at different steps; a wrong history changes the
    hypotheses, so the search reads what the stepper returns."""
    name = "multi-branch (MAT)"
    arch, src = ARCHS[name][0], _src()
    kw = dict(max_len_a=1.0, max_len_b=4, len_penalty=0.6)
    with torch.no_grad():
        model, eos = _varied_search(name, src, beam_size=beam_size, **kw)
        want = beam_search(model, src, arch, beam_size=beam_size, eos_id=eos, return_scores=True, **kw)
        src_len = (src != model.pad_id).sum(1)
        max_len = torch.clamp((src_len.float() * kw["max_len_a"] + kw["max_len_b"]).long(),
                              max=model.max_positions - 1).tolist()
        got = {}
        for corrupt in (False, True):
            stepper = _ContinuingStepper(model, arch, src, beam_size, eos, corrupt)
            got[corrupt] = search(stepper, src.size(0), max_len, beam_size=beam_size, vocab=model.vocab_size,
                                  pad_id=model.pad_id, bos_id=2, eos_id=eos, len_penalty=kw["len_penalty"], min_len=0,
                                  return_scores=True, device="cpu")
            assert stepper.extras > 0
    assert got[False][0] == want[0] and got[False][1] == pytest.approx(want[1], abs=1e-6)
    assert len(set(map(len, want[0]))) > 1, "sentences should finish at different steps"
    assert got[True][0] != want[0]
