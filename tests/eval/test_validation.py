"""``nas.eval.validation``: one ValidationSet loaded once, and ``validation_scores`` equal to the recipe it replaces
(``translate`` + ``corpus_scores`` + ``valid_loss`` of the same sentences) on a tiny real model and corpus."""

from __future__ import annotations

import random

import pytest
import torch

from nas.data import PreparedData, Tokenizer
from nas.eval.scores import corpus_scores, translate, valid_loss
from nas.eval.validation import ValidationSet, validation_scores
from nas.space.space import SearchSpace
from nas.space import parse_spec
from tests.conftest import tiny_spec_dict, use_tiny_data

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(multi30k, tiny_data, tmp_path_factory):
    """(model, space, data): a seeded, untrained tiny supernet and the tiny sweep's prepared corpus (12
    validation pairs)."""
    from nas.builders import build_supernet, prepare_sweep_data

    work = tmp_path_factory.mktemp("validation")
    raw = use_tiny_data(tiny_spec_dict(multi30k, work), tiny_data)
    spec = parse_spec(raw, "tiny")
    data = prepare_sweep_data(spec, progress=False)
    torch.manual_seed(0)
    return build_supernet(spec, data.vocab_size), SearchSpace.from_spec(spec), data


def _old(model, arch, data: PreparedData, n: int | None, beam_size: int, max_tokens: int) -> dict[str, float]:
    """The recipe as fidelity.score_model and trials.score_arch wrote it out before validation_scores."""
    src_text, refs = data.valid_text()
    src_ids, tgt_ids = data.load_split("valid")
    n = n or len(src_text)
    scores = corpus_scores(translate(model, data.tokenizer(), src_text[:n], arch, beam_size=beam_size), refs[:n])
    return {"bleu": scores.bleu, "chrf": scores.chrf,
            "valid_loss": valid_loss(model, src_ids[:n], tgt_ids[:n], arch, max_tokens=max_tokens)}


@pytest.mark.parametrize("sentences, beam_size, max_tokens", [(None, 2, 512), (5, 1, 64), (7, 3, 4096)])
def test_scores_equal_translate_corpus_scores_and_valid_loss_of_the_same_sentences(tiny, sentences, beam_size,
                                                                                     max_tokens):
    model, space, data = tiny
    vset = ValidationSet.load(data, sentences)
    for arch in (space.narrowest(), space.widest(), space.sample(random.Random(3))):
        expected = _old(model, arch, data, sentences, beam_size, max_tokens)
        for _ in range(2):  # the second call runs on the cached batches
            assert validation_scores(model, arch, vset, beam_size=beam_size, max_tokens=max_tokens) == expected


def test_beam_size_none_skips_bleu_and_loss_false_skips_the_loss(tiny):
    model, space, data = tiny
    vset = ValidationSet.load(data, 4)
    arch = space.narrowest()
    assert set(validation_scores(model, arch, vset, beam_size=None)) == {"valid_loss"}
    assert set(validation_scores(model, arch, vset, beam_size=1, loss=False)) == {"bleu", "chrf"}


def test_repeated_calls_read_no_file_and_tokenize_nothing(tiny, monkeypatch):
    model, space, data = tiny
    vset = ValidationSet.load(data, 6)
    validation_scores(model, space.widest(), vset, beam_size=1)

    def boom(*args, **kwargs):
        raise AssertionError("read or tokenized again")

    for name in ("valid_text", "load_split", "corpus", "tokenizer"):
        monkeypatch.setattr(PreparedData, name, boom)
    monkeypatch.setattr(Tokenizer, "encode", boom)
    for seed in range(3):
        scores = validation_scores(model, space.sample(random.Random(seed)), vset, beam_size=1)
        assert set(scores) == {"bleu", "chrf", "valid_loss"}


def test_a_set_holds_the_first_sentences_and_refuses_fewer_than_one(tiny):
    _, _, data = tiny
    src_text, refs = data.valid_text()
    src_ids, tgt_ids = data.load_split("valid")
    vset = ValidationSet.load(data, 5)
    assert (vset.src_text, vset.refs, len(vset)) == (src_text[:5], refs[:5], 5)
    assert vset.corpus.rows(range(5)) == (src_ids[:5], tgt_ids[:5])
    assert len(ValidationSet.load(data, 10_000)) == len(src_text)
    with pytest.raises(ValueError, match="sentences=0"):
        ValidationSet.load(data, 0)


def test_a_set_from_text_scores_bleu_but_has_no_loss(tiny):
    model, space, data = tiny
    src_text, refs = data.valid_text()
    vset = ValidationSet.from_text(src_text[:3], refs[:3], data.tokenizer())
    arch = space.narrowest()
    scores = corpus_scores(translate(model, data.tokenizer(), src_text[:3], arch, beam_size=2), refs[:3])
    assert validation_scores(model, arch, vset, beam_size=2, loss=False) == {"bleu": scores.bleu, "chrf": scores.chrf}
    with pytest.raises(ValueError, match="no token ids"):
        validation_scores(model, arch, vset, beam_size=None)


@pytest.mark.parametrize("max_tokens", [64, 4096])
def test_valid_loss_is_torchs_cross_entropy_of_the_full_logits(tiny, max_tokens):
    """``valid_loss`` (``nas.eval.scores.target_nll``: logits of the non-pad positions only, logsumexp minus the
    target's logit) against ``torch.nn.functional.cross_entropy`` of the model's whole ``[b, t, V]`` logits, padding
    ignored, summed over the same batches."""
    from nas.data import PAD_ID, TokenBatcher

    model, space, data = tiny
    src_ids, tgt_ids = data.load_split("valid")
    for arch in (space.narrowest(), space.widest(), space.sample(random.Random(5))):
        total, tokens = 0.0, 0
        with torch.no_grad():
            for batch in TokenBatcher(src_ids, tgt_ids, max_tokens, shuffle=False).batches(0):
                logits = model(batch.src, batch.tgt_in, arch)  # [b, t, V]
                total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten(),
                                                                 ignore_index=PAD_ID, reduction="sum"))
                tokens += int(batch.tgt_out.ne(PAD_ID).sum())
        assert valid_loss(model, src_ids, tgt_ids, arch, max_tokens=max_tokens) == pytest.approx(total / tokens,
                                                                                                 rel=1e-6)
