"""nas.data.tokenizer: the joint SentencePiece model of a prepared entry round-trips text, strips special ids
and covers both languages."""

from __future__ import annotations

from pathlib import Path

import pytest

from nas.data import BOS_ID, EOS_ID, PAD_ID, PreparedData, prepare_data

SMALL = {"max_train_pairs": 2000, "max_valid_pairs": 100, "progress": False}


@pytest.fixture(scope="module")
def prepared(files: list[Path], tmp_path_factory: pytest.TempPathFactory) -> PreparedData:
    """2000 training pairs, 100 validation pairs, vocabulary 500 (overrides the shared entry of conftest)."""
    return prepare_data(*files, vocab_size=500, cache_dir=tmp_path_factory.mktemp("cache"), **SMALL)


def test_prepared_round_trips_real_validation_sentences(prepared: PreparedData) -> None:
    tok = prepared.tokenizer()
    src_text, tgt_text = prepared.valid_text()
    assert len(src_text) == len(tgt_text) == 100
    for lines in (src_text, tgt_text):
        assert tok.decode(tok.encode(lines)) == [" ".join(x.split()) for x in lines]


def test_decode_strips_specials_and_stops_at_first_eos(prepared: PreparedData) -> None:
    tok = prepared.tokenizer()
    ids = tok.encode(["A dog runs on the beach."])[0]
    assert tok.decode([[BOS_ID, *ids, EOS_ID, *ids, PAD_ID], [*ids, PAD_ID, PAD_ID]]) == [
        "A dog runs on the beach."
    ] * 2


def test_tokenizer_is_joint_over_source_and_target(prepared: PreparedData) -> None:
    tok = prepared.tokenizer()
    for word in ("Hund", "dog", "Männer", "men"):
        assert 1 not in tok.encode([word])[0]  # UNK_ID: both languages are covered
