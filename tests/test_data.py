"""Tests for nas.data: reading, SentencePiece cache, batching."""

from __future__ import annotations

import gzip
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nas.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    DataError,
    PreparedData,
    TokenBatcher,
    collate,
    prepare_data,
    read_lines,
)

SMALL = {"max_train_pairs": 2000, "max_valid_pairs": 100, "progress": False}


@pytest.fixture(scope="module")
def files(multi30k: Path) -> list[Path]:
    """Multi30k's train.en, train.de, val.en, val.de beside the repository (conftest's ``multi30k`` fails,
    never skips, when they are missing)."""
    return [multi30k / name for name in ("train.en.gz", "train.de.gz", "val.en.gz", "val.de.gz")]


# --------------------------------------------------------------------------- read_lines


def test_read_lines_strips_plain_gzip_and_detects_gzip_without_suffix(tmp_path: Path) -> None:
    text = "  A dog runs. \n\u00a0Ein Hund.\u00a0\r\n\nlast"
    (tmp_path / "plain.txt").write_text(text, encoding="utf-8")
    (tmp_path / "zipped.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "zipped_no_suffix").write_bytes(gzip.compress(text.encode()))
    expected = ["A dog runs.", "Ein Hund.", "", "last"]
    for name in ("plain.txt", "zipped.gz", "zipped_no_suffix"):
        assert read_lines(tmp_path / name) == expected
    assert read_lines(tmp_path / "zipped.gz", limit=2) == expected[:2]


def test_read_lines_missing_file_names_path_and_key(tmp_path: Path) -> None:
    missing = tmp_path / "nope.en.gz"
    with pytest.raises(DataError, match="nope.en.gz") as err:
        read_lines(missing, key="data.train.src")
    assert str(missing) in str(err.value) and "data.train.src" in str(err.value)


def test_read_lines_non_utf8_raises_data_error(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("Müller\n".encode("latin-1"))
    with pytest.raises(DataError, match="latin1.txt"):
        read_lines(bad)


# --------------------------------------------------------------------------- prepare_data


@pytest.fixture(scope="module")
def prepared(files: list[Path], tmp_path_factory: pytest.TempPathFactory) -> PreparedData:
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


def test_prepared_splits_are_int32_lists_matching_the_tokenizer(prepared: PreparedData) -> None:
    tok = prepared.tokenizer()
    assert prepared.vocab_size == tok.vocab_size <= 500
    assert prepared.spm_model == prepared.root / "spm.model"
    schema = pq.read_schema(prepared.valid_parquet)
    assert schema.field("src").type == pa.list_(pa.int32())
    assert schema.field("tgt_text").type == pa.string()
    src, tgt = prepared.load_split("valid")
    src_text, tgt_text = prepared.valid_text()
    assert src == tok.encode(src_text) and tgt == tok.encode(tgt_text)
    train_src, train_tgt = prepared.load_split("train")
    assert 1900 <= len(train_src) == len(train_tgt) <= 2000
    assert all(0 < len(s) <= 128 and 0 < len(t) <= 128 for s, t in zip(train_src, train_tgt))
    with pytest.raises(ValueError, match="test"):
        prepared.load_split("test")


def test_tokenizer_is_joint_over_source_and_target(prepared: PreparedData) -> None:
    tok = prepared.tokenizer()
    for word in ("Hund", "dog", "Männer", "men"):
        assert 1 not in tok.encode([word])[0]  # UNK_ID: both languages are covered


def test_second_call_reuses_cache_without_retraining(files: list[Path], prepared: PreparedData) -> None:
    mtime = prepared.spm_model.stat().st_mtime_ns
    again = prepare_data(*files, vocab_size=500, cache_dir=prepared.root.parent, **SMALL)
    assert again == prepared
    assert prepared.spm_model.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in prepared.root.parent.iterdir()) == [prepared.root.name, f"{prepared.root.name}.lock"]


def test_changing_vocab_size_gives_a_different_cache_folder(files: list[Path], prepared: PreparedData) -> None:
    other = prepare_data(*files, vocab_size=400, cache_dir=prepared.root.parent, **SMALL)
    assert other.root != prepared.root
    assert other.root.parent == prepared.root.parent
    assert other.vocab_size <= 400 < prepared.vocab_size


def test_max_len_drops_long_training_pairs_and_truncates_validation(files: list[Path], tmp_path: Path) -> None:
    data = prepare_data(*files, vocab_size=500, cache_dir=tmp_path, max_len=8, **SMALL)
    train_src, train_tgt = data.load_split("train")
    assert 0 < len(train_src) < 2000
    assert all(len(s) <= 8 and len(t) <= 8 for s, t in zip(train_src, train_tgt))
    valid_src, valid_tgt = data.load_split("valid")
    assert len(valid_src) == 100
    assert max(map(len, valid_src + valid_tgt)) == 8


def test_misaligned_files_raise_naming_both_counts_before_writing(files: list[Path], tmp_path: Path) -> None:
    src, tgt = tmp_path / "a.en", tmp_path / "a.de"
    src.write_text("one\ntwo\nthree\n")
    tgt.write_text("eins\nzwei\ndrei\nvier\n")
    cache = tmp_path / "cache"
    with pytest.raises(DataError) as err:
        prepare_data(src, tgt, files[2], files[3], vocab_size=500, cache_dir=cache, progress=False)
    message = str(err.value)
    assert "has 3 lines" in message and "has 4" in message
    assert str(src) in message and str(tgt) in message
    assert not cache.exists()


def test_missing_file_raises_naming_the_yaml_key(tmp_path: Path) -> None:
    present = tmp_path / "x.txt"
    present.write_text("x\n")
    with pytest.raises(DataError, match=r"data\.valid\.tgt"):
        prepare_data(present, present, present, tmp_path / "gone.de", vocab_size=50, cache_dir=tmp_path)


def test_zero_training_pairs_raise_data_error(files: list[Path], tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no sentence pairs"):
        prepare_data(*files, vocab_size=500, cache_dir=tmp_path, max_train_pairs=0, progress=False)


def test_leftovers_of_a_crashed_run_are_not_reused(files: list[Path], tmp_path: Path) -> None:
    settings = {"max_train_pairs": 500, "max_valid_pairs": 20, "progress": False}
    root = prepare_data(*files, vocab_size=300, cache_dir=tmp_path, **settings).root
    shutil.rmtree(root)
    crashed_tmp = tmp_path / f"{root.name}.tmp-crashed"
    for half_written in (crashed_tmp, root):  # a temp folder and a final folder lacking DONE
        half_written.mkdir()
        (half_written / "spm.model").write_bytes(b"garbage")
    data = prepare_data(*files, vocab_size=300, cache_dir=tmp_path, **settings)
    assert data.root == root and (root / "DONE").is_file()
    tok = data.tokenizer()
    assert tok.decode(tok.encode(["A man sleeps."])) == ["A man sleeps."]


# --------------------------------------------------------------------------- batching


def _random_pairs(n: int = 300, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    src = [[rng.randrange(4, 50) for _ in range(rng.randint(1, 30))] for _ in range(n)]
    tgt = [[rng.randrange(4, 50) for _ in range(rng.randint(1, 30))] for _ in range(n)]
    src.append(list(range(4, 104)))  # one pair longer than max_tokens
    tgt.append([5, 6])
    return src, tgt


def test_every_batch_respects_max_tokens() -> None:
    src, tgt = _random_pairs()
    batcher = TokenBatcher(src, tgt, max_tokens=64, seed=1)
    sizes = [len(b) for b in batcher.epoch(0)]
    assert sizes.count(1) >= 1 and max(sizes) > 1
    for batch in batcher.batches(0):
        if batch.src.shape[0] > 1:
            assert batch.src.numel() <= 64 and batch.tgt_in.numel() <= 64


def test_every_pair_appears_exactly_once_per_epoch() -> None:
    src, tgt = _random_pairs()
    batcher = TokenBatcher(src, tgt, max_tokens=64)
    for epoch in (0, 1):
        indices = [i for batch in batcher.epoch(epoch) for i in batch]
        assert sorted(indices) == list(range(len(src)))
    assert len(batcher) == len(batcher.epoch(0))


def test_epoch_order_is_deterministic_and_differs_between_epochs() -> None:
    src, tgt = _random_pairs()
    batcher = TokenBatcher(src, tgt, max_tokens=64, seed=3)
    twin = TokenBatcher(src, tgt, max_tokens=64, seed=3)
    assert batcher.epoch(2) == batcher.epoch(2) == twin.epoch(2)
    assert batcher.epoch(0) != batcher.epoch(1)
    assert TokenBatcher(src, tgt, max_tokens=64, seed=4).epoch(2) != batcher.epoch(2)


def test_unshuffled_batches_follow_length_order() -> None:
    src, tgt = _random_pairs()
    batcher = TokenBatcher(src, tgt, max_tokens=64, shuffle=False)
    order = [i for batch in batcher.epoch(0) for i in batch]
    keys = [(len(src[i]), len(tgt[i])) for i in order]
    assert keys == sorted(keys)
    assert batcher.epoch(0) == batcher.epoch(5)


def test_batches_resume_at_start_equals_tail_of_full_epoch() -> None:
    src, tgt = _random_pairs()
    batcher = TokenBatcher(src, tgt, max_tokens=64)
    full = list(batcher.batches(epoch=1))
    tail = list(batcher.batches(epoch=1, start=5))
    assert len(tail) == len(full) - 5
    for a, b in zip(full[5:], tail):
        assert torch.equal(a.src, b.src) and torch.equal(a.tgt_out, b.tgt_out)


def test_max_tokens_below_8_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        TokenBatcher([[4]], [[5]], max_tokens=7)


def test_collate_places_bos_eos_and_counts_target_tokens() -> None:
    batch = collate([[10, 11, 12], [20]], [[30], [40, 41]])
    assert batch.src.tolist() == [[10, 11, 12, EOS_ID], [20, EOS_ID, PAD_ID, PAD_ID]]
    assert batch.tgt_in.tolist() == [[BOS_ID, 30, PAD_ID], [BOS_ID, 40, 41]]
    assert batch.tgt_out.tolist() == [[30, EOS_ID, PAD_ID], [40, 41, EOS_ID]]
    assert batch.src.dtype == batch.tgt_in.dtype == torch.int64
    assert batch.ntokens == 5


def test_batch_to_moves_every_tensor() -> None:
    moved = collate([[10]], [[30]]).to("meta")
    assert {t.device.type for t in (moved.src, moved.tgt_in, moved.tgt_out)} == {"meta"}
    assert moved.ntokens == 2
