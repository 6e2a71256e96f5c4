"""nas.data.text: reading the raw parallel files (gzip or plain, errors naming the file and key) and the one
streaming pass that counts them and samples the tokenizer's pairs."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from nas.data import DataError, read_lines
from nas.data.text import scan_pairs

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


# --------------------------------------------------------------------------- scan_pairs


def test_tokenizer_sample_is_uniform_seeded_and_all_pairs_when_few(files):
    keys = ("data.train.src", "data.train.tgt")
    few = scan_pairs(files[0], files[1], 300, keys, sample=500, chunk_pairs=128)
    assert few.pairs == 300 and few.src == read_lines(files[0], limit=300)
    assert few.tgt == read_lines(files[1], limit=300)
    picked = scan_pairs(files[0], files[1], 3000, keys, sample=200, chunk_pairs=128, seed=1)
    again = scan_pairs(files[0], files[1], 3000, keys, sample=200, chunk_pairs=128, seed=1)
    other = scan_pairs(files[0], files[1], 3000, keys, sample=200, chunk_pairs=128, seed=2)
    lines = read_lines(files[0], limit=3000)
    where = [lines.index(s) for s in picked.src]
    assert len(picked.src) == len(picked.tgt) == 200 and picked.pairs == 3000
    assert picked.src == again.src and picked.src != other.src
    assert where == sorted(where) and max(where) > 2500 and min(where) < 500  # spread over all 3000, in order
    assert sum(w >= 1500 for w in where) > 60
