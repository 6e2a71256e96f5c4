"""nas.data.cache: prepare_data's cache entry (content-addressed, reused, checked before anything is written, never
reused half-written) and what it holds."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import nas.data.cache as cache_module
from nas.data import DataError, PreparedData, prepare_data

SMALL = {"max_train_pairs": 2000, "max_valid_pairs": 100, "progress": False}


@pytest.fixture(scope="module")
def prepared(files: list[Path], tmp_path_factory: pytest.TempPathFactory) -> PreparedData:
    """2000 training pairs, 100 validation pairs, vocabulary 500, alone in its cache folder (overrides the shared
    entry of conftest: the tests below add entries beside it)."""
    return prepare_data(*files, vocab_size=500, cache_dir=tmp_path_factory.mktemp("cache"), **SMALL)


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


def test_misalignment_after_the_first_shard_fails_before_anything_is_written(files, tmp_path, monkeypatch):
    monkeypatch.setattr(cache_module, "_SHARD_PAIRS", 50)
    src, tgt = tmp_path / "a.en", tmp_path / "a.de"
    src.write_text("a sentence\n" * 300)
    tgt.write_text("ein Satz\n" * 301)
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match="has 300 lines but .* has 301"):
        prepare_data(src, tgt, files[2], files[3], vocab_size=50, cache_dir=cache, max_train_pairs=100,
                     progress=False)
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
