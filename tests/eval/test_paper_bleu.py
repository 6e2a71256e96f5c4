"""``nas.eval.scores.paper_bleu``: BLEU as Wu et al. (ACL 2021, fairseq) report it on Multi30k, lowercased and
Moses-tokenized, against an independent reference: the same sentences tokenized by hand and scored over whitespace
tokens; and the cases that fail when the lowercasing or the tokenization is left out."""

from __future__ import annotations

import pytest
import sacrebleu

from nas.eval.scores import corpus_scores, file_language, paper_bleu

REFERENCES = ["Ein Mann, der ein Hemd trägt.", "Zwei Hunde spielen im Schnee!",
              "Eine Frau (mit Hut) sitzt auf einer Bank."]
HYPOTHESES = ["Ein Mann, der ein T-Shirt trägt.", "Zwei Hunde spielen im Schnee.",
              "eine Frau mit Hut sitzt auf der Bank."]
REFERENCES_BY_HAND = ["ein mann , der ein hemd trägt .", "zwei hunde spielen im schnee !",
                      "eine frau ( mit hut ) sitzt auf einer bank ."]
"""``tokenizer.perl -l de`` of the lowercased references, written out by hand: punctuation split off."""
HYPOTHESES_BY_HAND = ["ein mann , der ein t-shirt trägt .", "zwei hunde spielen im schnee .",
                      "eine frau mit hut sitzt auf der bank ."]
"""The same of the hypotheses (an intra-word hyphen stays: Moses splits dashes only with ``-a``)."""


def test_paper_bleu_is_whitespace_bleu_of_the_lowercased_moses_tokens():
    expected = sacrebleu.corpus_bleu(HYPOTHESES_BY_HAND, [REFERENCES_BY_HAND], tokenize="none").score
    assert paper_bleu(HYPOTHESES, REFERENCES, "de") == pytest.approx(expected, abs=1e-9)
    # the reference is discriminating: without the tokenization ("mann," one token) the score is another
    untokenized = sacrebleu.corpus_bleu([h.lower() for h in HYPOTHESES], [[r.lower() for r in REFERENCES]],
                                        tokenize="none").score
    assert abs(untokenized - expected) > 1.0


def test_casing_errors_cost_sacrebleu_points_but_not_paper_bleu():
    lowercased = [r.lower() for r in REFERENCES]  # every word right, every capital lost
    assert paper_bleu(lowercased, REFERENCES, "de") == pytest.approx(100.0)
    assert corpus_scores(lowercased, REFERENCES).bleu < 70.0  # the primary figure counts the casing


def test_moses_tokenization_splits_punctuation_that_whitespace_leaves_on_the_word():
    """A hypothesis equal to the reference but for its spacing around punctuation scores 100: both sides are
    tokenized the same way, as fairseq scores its pre-tokenized text."""
    spaced = ["Ein Mann , der ein Hemd trägt .", "Zwei Hunde spielen im Schnee !",
              "Eine Frau ( mit Hut ) sitzt auf einer Bank ."]
    assert paper_bleu(spaced, REFERENCES, "de") == pytest.approx(100.0)


def test_paper_bleu_refuses_lists_of_different_lengths():
    with pytest.raises(ValueError, match="2 hypotheses and 3 references"):
        paper_bleu(HYPOTHESES[:2], REFERENCES, "de")


@pytest.mark.parametrize(("path", "code"), [("../shared/data/multi30k/val.de.gz", "de"), ("train.fr", "fr"),
                                             ("test_2017_flickr.cs.bz2", "cs"), ("target.txt", "en"),
                                             ("data/tgt", "en"), ("news.2014.de", "de")])
def test_the_target_language_is_read_from_the_file_name_else_moses_default_en(path, code):
    assert file_language(path) == code
