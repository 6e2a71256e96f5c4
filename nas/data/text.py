"""Reading the raw parallel text: one sentence a line, UTF-8, gzip or plain, streamed in chunks.

Owns :func:`read_lines` (a whole file as stripped lines), the streaming readers the preparation uses
(:func:`open_text`, :func:`next_lines`, :func:`skip_lines`), :func:`scan_pairs` (one pass over two parallel
files: their line counts and the pairs kept, or a seeded sample of them) and :data:`DATA_KEYS`, the YAML keys
that errors name. Every read error is a :class:`~nas.data.errors.DataError` naming the file and the key.
"""

from __future__ import annotations

import gzip
import itertools
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from nas.data.errors import DataError

__all__ = ["DATA_KEYS", "PairScan", "next_lines", "open_text", "read_lines", "scan_pairs", "skip_lines"]

DATA_KEYS = ("data.train.src", "data.train.tgt", "data.valid.src", "data.valid.tgt")
"""The YAML keys of the four data files, in :func:`nas.data.prepare_data`'s order (named in errors)."""
_GZIP_MAGIC = b"\x1f\x8b"


def _fix_hint(key: str | None) -> str:
    return f"fix {key} in the YAML" if key else "check the path"


def _is_gzip(path: Path) -> bool:
    if path.suffix == ".gz":
        return True
    with path.open("rb") as f:
        return f.read(2) == _GZIP_MAGIC


def read_lines(path: str | Path, limit: int | None = None, *, key: str | None = None) -> list[str]:
    """Read a one-sentence-per-line UTF-8 text file, plain or gzip-compressed.

    Gzip is detected by a ``.gz`` suffix or the gzip magic bytes. Every line is
    ``str.strip()``-ped (this also removes NBSP and ``\\r``); empty lines are kept so that
    line numbers stay aligned with a parallel file.

    Args:
        path: the file to read.
        limit: read at most this many lines (``None``: all).
        key: the YAML key the path came from, named in error messages.

    Returns:
        The stripped lines, at most ``limit`` of them.

    Raises:
        DataError: the file is missing, unreadable, not valid gzip or not UTF-8.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}; {_fix_hint(key)}")
    with open_text(path, key) as f:
        return [line.strip() for line in next_lines(f, limit, path, key)]


def open_text(path: Path, key: str | None) -> IO[str]:
    """``path`` opened as UTF-8 text with universal newlines (gzip or plain), as :func:`read_lines` reads it.

    Raises:
        DataError: it cannot be opened (names the file and the YAML key).
    """
    try:
        return (gzip.open if _is_gzip(path) else open)(path, "rt", encoding="utf-8")
    except OSError as e:
        raise DataError(f"cannot read data file {path} ({e}); {_fix_hint(key)}") from e


def next_lines(f: IO[str], n: int | None, path: Path, key: str | None) -> list[str]:
    """The next ``n`` raw lines of ``f`` (newlines kept; fewer at the end; ``None``: all).

    Raises:
        DataError: the file is unreadable, not valid gzip or not UTF-8 (names it and the YAML key).
    """
    try:
        return list(itertools.islice(f, n))
    except (OSError, UnicodeDecodeError, EOFError, zlib.error) as e:
        raise DataError(f"cannot read data file {path} ({e}); {_fix_hint(key)}") from e


def skip_lines(f: IO[str], n: int, path: Path, key: str | None) -> int:
    """Read past the next ``n`` lines of ``f`` without keeping them; returns how many there were.

    Raises:
        DataError: as :func:`next_lines`.
    """
    try:
        return sum(1 for _ in itertools.islice(f, n))
    except (OSError, UnicodeDecodeError, EOFError, zlib.error) as e:
        raise DataError(f"cannot read data file {path} ({e}); {_fix_hint(key)}") from e


@dataclass(frozen=True)
class PairScan:
    """What one streaming pass over two parallel files found (:func:`scan_pairs`)."""

    pairs: int
    """Pairs to prepare: ``min(lines, limit)``."""
    src: list[str]
    """The kept sources (stripped), in file order."""
    tgt: list[str]
    """The kept targets (stripped), aligned with ``src``."""


def scan_pairs(src: Path, tgt: Path, limit: int | None, keys: tuple[str, str], *, sample: int | None,
               chunk_pairs: int, seed: int = 0) -> PairScan:
    """Stream two parallel files once, ``chunk_pairs`` lines at a time: count the lines of each whole, then
    keep pairs among the first ``limit`` (``None``: all).

    ``sample=None`` keeps all of them (the validation split). Otherwise a uniform random sample of
    ``sample`` pairs is kept (reservoir sampling, Vitter's Algorithm R, with ``numpy``'s generator seeded by
    ``seed``, so the same files and seed give the same sample), returned in file order; with at most
    ``sample`` pairs, all of them are kept. Sampling pairs rather than lines gives SentencePiece as many
    source as target lines, and reading on to the end (not the first N lines) keeps a corpus that
    concatenates domains (Europarl, then news...) represented.

    Raises:
        DataError: a file is unreadable, not gzip/UTF-8 text; the two files have different line counts
            (checked before anything is trained or written); there is no pair within ``limit``.
    """
    rng = np.random.default_rng(seed)
    picked: list[tuple[int, str, str]] = []
    lines = [0, 0]
    with open_text(src, keys[0]) as fs, open_text(tgt, keys[1]) as ft:
        while True:
            a, b = next_lines(fs, chunk_pairs, src, keys[0]), next_lines(ft, chunk_pairs, tgt, keys[1])
            if not a and not b:
                break
            start = lines[0]
            lines[0] += len(a)
            lines[1] += len(b)
            if len(a) != len(b):
                continue  # one file ended: misaligned, reported below once both are counted
            m = len(a) if limit is None else max(0, min(len(a), limit - start))
            if sample is None:
                picked += zip(range(start, start + m), a[:m], b[:m])
                continue
            fill = min(max(sample - len(picked), 0), m)  # the reservoir's first ``sample`` pairs
            picked += zip(range(start, start + fill), a[:fill], b[:fill])
            if fill < m:
                seen = np.arange(start + fill, start + m)
                slots = rng.integers(0, seen + 1)  # pair i replaces a random slot with probability sample / (i + 1)
                for hit in np.flatnonzero(slots < sample).tolist():
                    j = fill + hit
                    picked[slots[hit]] = (start + j, a[j], b[j])
    if lines[0] != lines[1]:
        raise DataError(
            f"parallel files are misaligned: {src} has {lines[0]} lines but {tgt} has "
            f"{lines[1]}; fix {keys[0]} / {keys[1]} in the YAML to point at matching files"
        )
    pairs = lines[0] if limit is None else min(lines[0], limit)
    if pairs <= 0:
        raise DataError(f"no sentence pairs in {src} / {tgt} (limit {limit}); fix {keys[0]} / {keys[1]}")
    picked.sort(key=lambda p: p[0])
    return PairScan(pairs, [s.strip() for _, s, _ in picked], [t.strip() for _, _, t in picked])
