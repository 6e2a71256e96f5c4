"""Parallel-text data: streaming preparation, a joint SentencePiece tokenizer, memory-mapped token ids, batching.

Pipeline: :func:`prepare_data` streams the four raw text files (gzip or plain, one sentence a line),
trains one joint SentencePiece model on a sample of the training pairs, encodes the training pairs in
shards on all cores and writes the content-addressed cache folder: ``spm.model``, ``train.arrow`` (an
uncompressed Arrow IPC file, memory-mapped by every training process) and ``valid.parquet`` (the small
validation split, with its text for BLEU). :class:`TokenCorpus` holds a split as flat token ids (numpy
views over the mapped file: no Python object per sentence), :class:`TokenBatcher` cuts it into
fairseq-style token-count batches and :meth:`TokenCorpus.collate` pads them into ``int64`` tensors
(:class:`Batch`) with numpy fancy indexing.

Token ids: ``PAD_ID=0``, ``UNK_ID=1``, ``BOS_ID=2``, ``EOS_ID=3``. Stored and encoded
sequences carry no BOS/EOS; :func:`collate` adds them.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc
import pyarrow.parquet as pq
import sentencepiece as spm
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from nas import faults
from nas.errors import NasError
from nas.io import atomic_path, atomic_write_text
from nas.locks import hold, holder_text, is_held
from nas.space.datafiles import file_problem

if TYPE_CHECKING:
    import torch  # imported where a Batch is made: the encoding worker processes start without it

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "UNK_ID",
    "Batch",
    "DataError",
    "PreparedData",
    "TokenBatcher",
    "TokenCorpus",
    "Tokenizer",
    "collate",
    "prepare_data",
    "read_lines",
]

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

_FORMAT_VERSION = 2  # bump when the cache layout or the preprocessing changes (2: train.arrow, sampled tokenizer)
_GZIP_MAGIC = b"\x1f\x8b"
_DONE = "DONE"
_SPLITS = ("train", "valid")
_INPUT_SENTENCE_SIZE = 200_000
"""Lines SentencePiece trains on at most: half of them sources, half targets (see :func:`_scan_pairs`)."""
_SHARD_PAIRS = 65_536
"""Training pairs read and encoded per shard (the unit of resumption and of work per encoding process)."""
_POOL_MIN_PAIRS = 500_000
"""Below this many pairs left to encode, encoding runs in the preparing process: starting the worker
processes (about 1 s each: they import this module) costs more than it saves."""
_ENCODE_LINES = 8192
"""Lines per ``SentencePieceProcessor.encode`` call (bounds the Python lists of ids alive at once)."""
_PLAN = "plan.json"
_KEYS = ("data.train.src", "data.train.tgt", "data.valid.src", "data.valid.tgt")  # YAML keys named in errors
_console = Console(stderr=True, highlight=False, soft_wrap=True)


class DataError(NasError):
    """Bad data input; the message names the file and what would fix it."""


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------


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
    with _open_text(path, key) as f:
        return [line.strip() for line in _read(f, limit, path, key)]


def _open_text(path: Path, key: str | None) -> IO[str]:
    """``path`` opened as UTF-8 text with universal newlines (gzip or plain), as :func:`read_lines` reads it.

    Raises:
        DataError: it cannot be opened (names the file and the YAML key).
    """
    try:
        return (gzip.open if _is_gzip(path) else open)(path, "rt", encoding="utf-8")
    except OSError as e:
        raise DataError(f"cannot read data file {path} ({e}); {_fix_hint(key)}") from e


def _read(f: IO[str], n: int | None, path: Path, key: str | None) -> list[str]:
    """The next ``n`` raw lines of ``f`` (newlines kept; fewer at the end; ``None``: all).

    Raises:
        DataError: the file is unreadable, not valid gzip or not UTF-8 (names it and the YAML key).
    """
    try:
        return list(itertools.islice(f, n))
    except (OSError, UnicodeDecodeError, EOFError, zlib.error) as e:
        raise DataError(f"cannot read data file {path} ({e}); {_fix_hint(key)}") from e


def _skip(f: IO[str], n: int, path: Path, key: str | None) -> int:
    """Read past the next ``n`` lines of ``f`` without keeping them; returns how many there were."""
    try:
        return sum(1 for _ in itertools.islice(f, n))
    except (OSError, UnicodeDecodeError, EOFError, zlib.error) as e:
        raise DataError(f"cannot read data file {path} ({e}); {_fix_hint(key)}") from e


@dataclass(frozen=True)
class _Scan:
    """What one streaming pass over two parallel files found (:func:`_scan_pairs`)."""

    pairs: int
    """Pairs to prepare: ``min(lines, limit)``."""
    src: list[str]
    """The kept sources (stripped), in file order."""
    tgt: list[str]
    """The kept targets (stripped), aligned with ``src``."""


def _scan_pairs(src: Path, tgt: Path, limit: int | None, keys: tuple[str, str], *, sample: int | None,
                seed: int = 0) -> _Scan:
    """Stream two parallel files once, ``_SHARD_PAIRS`` lines at a time: count the lines of each whole, then
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
    with _open_text(src, keys[0]) as fs, _open_text(tgt, keys[1]) as ft:
        while True:
            a, b = _read(fs, _SHARD_PAIRS, src, keys[0]), _read(ft, _SHARD_PAIRS, tgt, keys[1])
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
    return _Scan(pairs, [s.strip() for _, s, _ in picked], [t.strip() for _, _, t in picked])
class Tokenizer:
    """Joint (source+target) SentencePiece model wrapper.

    Attributes:
        model_path: the ``.model`` file this tokenizer was loaded from.
    """

    def __init__(self, model_path: str | Path) -> None:
        """Load a SentencePiece model.

        Raises:
            DataError: the model file is missing or not a SentencePiece model.
        """
        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise DataError(f"SentencePiece model not found: {self.model_path}; re-run data preparation")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.model_path))
        except (OSError, RuntimeError) as e:
            raise DataError(
                f"cannot load SentencePiece model {self.model_path} ({e}); delete its cache folder"
            ) from e

    @property
    def vocab_size(self) -> int:
        """Number of pieces, special ids (pad/unk/bos/eos) included."""
        return self._sp.get_piece_size()

    def encode(self, lines: list[str]) -> list[list[int]]:
        """Encode sentences to piece ids, without BOS/EOS."""
        return self._sp.encode(list(lines), out_type=int)

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Decode id sequences to text.

        Each sequence is cut at its first ``EOS_ID``; ``PAD_ID`` and ``BOS_ID`` are dropped.
        Accepts lists of ints (use ``tensor.tolist()`` for tensors).
        """
        return self._sp.decode([_strip_specials(seq) for seq in ids])

    @staticmethod
    def train(lines: list[str], model_prefix: str | Path, vocab_size: int, seed: int = 0) -> Tokenizer:
        """Train a unigram SentencePiece model on ``lines`` and load it.

        Writes ``<model_prefix>.model`` and ``<model_prefix>.vocab``. ``vocab_size`` is a soft
        limit (``hard_vocab_limit=False``): tiny corpora may give fewer pieces. Training is
        capped at 200k (shuffled) sentences and uses 2 threads.

        Raises:
            RuntimeError: from SentencePiece, e.g. ``vocab_size`` is too small for the
                corpus's character set.
        """
        spm.set_random_generator_seed(seed)
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_prefix=str(model_prefix),
            vocab_size=vocab_size,
            model_type="unigram",
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            character_coverage=1.0,
            input_sentence_size=_INPUT_SENTENCE_SIZE,
            shuffle_input_sentence=True,
            num_threads=2,
            hard_vocab_limit=False,
            minloglevel=2,
        )
        return Tokenizer(f"{model_prefix}.model")


def _strip_specials(seq: list[int]) -> list[int]:
    seq = list(seq)
    if EOS_ID in seq:
        seq = seq[: seq.index(EOS_ID)]
    return [i for i in seq if i not in (PAD_ID, BOS_ID)]



# ---------------------------------------------------------------------------
# Token corpus: flat ids, usually memory-mapped
# ---------------------------------------------------------------------------


def _flat(column: pa.Array | pa.ChunkedArray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(values, offsets)`` of a list<int> column: row i is ``values[offsets[i]:offsets[i + 1]]``.

    Zero-copy (views over the Arrow buffers, read-only for a memory-mapped file) for one chunk of
    ``large_list<int32>``; a column of several chunks is combined first (a copy) and ``list`` offsets are
    widened to int64 (a copy of ``n + 1`` offsets).

    Raises:
        DataError: the column is not a list of integers or has nulls.
    """
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    kind = column.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(kind.value_type):
        raise DataError(f"column {name!r} is {kind}, not a list of token ids; delete the cache folder and "
                        f"prepare again")
    if column.null_count or column.values.null_count:
        raise DataError(f"column {name!r} has missing rows; delete the cache folder and prepare again")
    width = np.int64 if pa.types.is_large_list(kind) else np.int32
    offsets = np.frombuffer(column.buffers()[1], dtype=width)[column.offset:column.offset + len(column) + 1]
    values = column.values.to_numpy(zero_copy_only=False)  # [all tokens of the column's child]
    return values, offsets.astype(np.int64, copy=False)  # [n + 1]


class _Column(Sequence):
    """One side of a :class:`TokenCorpus` as a read-only sequence of id lists (``corpus.src[i]`` is a
    ``list[int]``, ``corpus.src[a:b]`` a ``list[list[int]]``), for code written for lists."""

    def __init__(self, values: np.ndarray, offsets: np.ndarray) -> None:
        self._values, self._offsets = values, offsets

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = range(len(self))[index]  # IndexError, negative indices
        return self._values[self._offsets[i]:self._offsets[i + 1]].tolist()


class TokenCorpus:
    """Sentence pairs as flat token ids, without a Python object per sentence.

    Each side is a ``values`` array of all its ids (no BOS/EOS) concatenated and an ``offsets`` array:
    row ``i`` is ``values[offsets[i]:offsets[i + 1]]``. For the prepared training split
    (:meth:`PreparedData.corpus`) both are read-only numpy views over the memory-mapped
    ``train.arrow``: opening it reads nothing, and the processes of one machine (data-parallel ranks,
    trials) share its pages. Only the lengths (``[n]`` int32 per side) are computed into memory.

    Attributes:
        src_values, tgt_values: ``[total tokens]`` integer ids (int32 when mapped).
        src_offsets, tgt_offsets: ``[n + 1]`` int64, nondecreasing.
        src_lengths, tgt_lengths: ``[n]`` int32, tokens per row (BOS/EOS not counted).
    """

    def __init__(self, src_values: np.ndarray, src_offsets: np.ndarray, tgt_values: np.ndarray,
                 tgt_offsets: np.ndarray, *, owner: Any = None) -> None:
        """Wrap flat arrays (not copied); ``owner`` is kept alive with them (e.g. the memory map).

        Raises:
            ValueError: the two sides have different row counts, or offsets decrease or point past the values.
        """
        if len(src_offsets) != len(tgt_offsets) or len(src_offsets) == 0:
            raise ValueError(f"{len(src_offsets) - 1} sources but {len(tgt_offsets) - 1} targets")
        self.src_values, self.src_offsets = src_values, src_offsets
        self.tgt_values, self.tgt_offsets = tgt_values, tgt_offsets
        self.src_lengths = self._lengths(src_values, src_offsets, "source")
        self.tgt_lengths = self._lengths(tgt_values, tgt_offsets, "target")
        self._owner = owner

    @staticmethod
    def _lengths(values: np.ndarray, offsets: np.ndarray, side: str) -> np.ndarray:
        lengths = np.empty(len(offsets) - 1, dtype=np.int32)  # [n], without an int64 temporary
        np.subtract(offsets[1:], offsets[:-1], out=lengths, casting="unsafe")
        if len(lengths) and (lengths.min() < 0 or offsets[0] < 0 or offsets[-1] > len(values)):
            raise ValueError(f"{side} offsets decrease or point past the {len(values)} ids")
        return lengths

    @classmethod
    def from_lists(cls, src_ids: Sequence[Sequence[int]], tgt_ids: Sequence[Sequence[int]]) -> TokenCorpus:
        """A corpus of id lists (copied into int64 arrays).

        Raises:
            ValueError: the two lists differ in length.
        """
        if len(src_ids) != len(tgt_ids):
            raise ValueError(f"{len(src_ids)} sources but {len(tgt_ids)} targets")
        return cls(*cls._pack(src_ids), *cls._pack(tgt_ids))

    @staticmethod
    def _pack(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, rows), dtype=np.int64, count=len(rows)), out=offsets[1:])
        values = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(offsets[-1]))
        return values, offsets

    @classmethod
    def from_arrow(cls, table: pa.Table | pa.RecordBatch, *, owner: Any = None) -> TokenCorpus:
        """A corpus over the list<int> columns ``src`` and ``tgt`` of ``table`` (zero-copy where possible,
        see :func:`_flat`).

        Raises:
            DataError: a column is missing, not a list of integers or has nulls.
        """
        names = table.schema.names
        if "src" not in names or "tgt" not in names:
            raise DataError(f"token table has columns {names}, not src and tgt; delete the cache folder and "
                            f"prepare again")
        return cls(*_flat(table.column("src"), "src"), *_flat(table.column("tgt"), "tgt"), owner=(owner, table))

    @classmethod
    def open(cls, path: str | Path) -> TokenCorpus:
        """Memory-map an Arrow IPC file written by :func:`prepare_data` (columns ``src``, ``tgt``:
        ``large_list<int32>``, one record batch): nothing is read until rows are used.

        Raises:
            DataError: the file is missing or not such an Arrow file (names it and the fix).
        """
        source, batch = _map_ipc(Path(path))
        return cls.from_arrow(batch, owner=source)

    def __len__(self) -> int:
        """Sentence pairs."""
        return len(self.src_lengths)

    @property
    def src(self) -> Sequence[list[int]]:
        """The sources as a read-only sequence of id lists (``corpus.src[i]`` copies row i into a list)."""
        return _Column(self.src_values, self.src_offsets)

    @property
    def tgt(self) -> Sequence[list[int]]:
        """The targets as a read-only sequence of id lists."""
        return _Column(self.tgt_values, self.tgt_offsets)

    def rows(self, indices: Sequence[int] | np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
        """``(sources, targets)`` of the rows ``indices``, as lists of ids (no BOS/EOS)."""
        rows = np.asarray(indices, dtype=np.int64).tolist()
        src, tgt = self.src, self.tgt
        return [src[i] for i in rows], [tgt[i] for i in rows]

    def collate(self, indices: Sequence[int] | np.ndarray) -> Batch:
        """Pad the rows ``indices`` (in that order) into a :class:`Batch`, vectorised: ``src`` ``[b, s]`` with
        ``s = max source length + 1`` (ids + EOS), ``tgt_in``/``tgt_out`` ``[b, t]`` with ``t = max target
        length + 1`` (BOS + ids / ids + EOS), all int64, right-padded with ``PAD_ID``. Equal to
        :func:`collate` of the same rows as lists.

        Raises:
            ValueError: ``indices`` is empty.
        """
        import torch  # here, not at the top: see the imports

        rows = np.asarray(indices, dtype=np.int64)
        if rows.ndim != 1 or len(rows) == 0:
            raise ValueError(f"collate needs a non-empty list of row indices, got shape {rows.shape}")
        src = _pad(self.src_values, self.src_offsets[rows], self.src_lengths[rows], bos=False)
        tgt_in, tgt_out = _pad(self.tgt_values, self.tgt_offsets[rows], self.tgt_lengths[rows], bos=True)
        return Batch(src=torch.from_numpy(src), tgt_in=torch.from_numpy(tgt_in), tgt_out=torch.from_numpy(tgt_out),
                     ntokens=int(np.count_nonzero(tgt_out != PAD_ID)))


def _pad(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray, *,
         bos: bool) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Rows ``values[starts[r]:starts[r] + lengths[r]]`` padded to ``[b, max(lengths) + 1]`` int64 with
    ``PAD_ID``: ids + EOS, and when ``bos`` also BOS + ids (returned first, as a pair)."""
    b, longest = len(lengths), int(lengths.max())
    col = np.arange(longest)  # [longest]
    inside = col < lengths[:, None]  # [b, longest]
    ids = values[(starts[:, None] + col)[inside]]  # the rows' ids, row after row
    with_eos = np.full((b, longest + 1), PAD_ID, dtype=np.int64)  # [b, longest + 1]
    with_eos[:, :longest][inside] = ids
    with_eos[np.arange(b), lengths] = EOS_ID
    if not bos:
        return with_eos
    with_bos = np.full((b, longest + 1), PAD_ID, dtype=np.int64)  # [b, longest + 1]
    with_bos[:, 0] = BOS_ID
    with_bos[:, 1:][inside] = ids
    return with_bos, with_eos


# ---------------------------------------------------------------------------
# Prepared (cached) data
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedData:
    """A finished cache folder produced by :func:`prepare_data`.

    Attributes:
        root: the cache folder.
        spm_model: ``root / "spm.model"``.
        train_arrow: ``root / "train.arrow"``: uncompressed Arrow IPC file, one record batch, columns ``src``,
            ``tgt``: ``large_list<int32>`` (memory-mapped by :meth:`corpus`).
        valid_parquet: ``root / "valid.parquet"`` (columns ``src``, ``tgt``: list<int32>; ``src_text``,
            ``tgt_text``: string).
        vocab_size: actual number of pieces of the trained model.
    """

    root: Path
    spm_model: Path
    train_arrow: Path
    valid_parquet: Path
    vocab_size: int

    def tokenizer(self) -> Tokenizer:
        """Load the joint SentencePiece tokenizer."""
        return Tokenizer(self.spm_model)

    def corpus(self, split: str = "train") -> TokenCorpus:
        """The ids of ``"train"`` (memory-mapped from ``train.arrow``: no copy, shared by every process that
        opens it) or ``"valid"`` (read into memory) as a :class:`TokenCorpus`.

        Raises:
            ValueError: unknown split name.
            DataError: the file is unreadable (names it; delete the cache folder).
        """
        if split not in _SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {_SPLITS}")
        if split == "train":
            return TokenCorpus.open(self.train_arrow)
        return TokenCorpus.from_arrow(pq.read_table(self.valid_parquet, columns=["src", "tgt"]))

    def load_split(self, split: str) -> tuple[list[list[int]], list[list[int]]]:
        """Return ``(src_ids, tgt_ids)`` of ``"train"`` or ``"valid"`` (no BOS/EOS) as Python lists.

        For the small validation split and tests: the training split's lists cost ~100 bytes per token;
        train from :meth:`corpus` instead.

        Raises:
            ValueError: unknown split name.
        """
        if split not in _SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {_SPLITS}")
        if split == "train":
            _, batch = _map_ipc(self.train_arrow)
            return batch.column("src").to_pylist(), batch.column("tgt").to_pylist()
        table = pq.read_table(self.valid_parquet, columns=["src", "tgt"])
        return table.column("src").to_pylist(), table.column("tgt").to_pylist()

    def valid_text(self) -> tuple[list[str], list[str]]:
        """Return the raw (stripped) validation source sentences and target references."""
        table = pq.read_table(self.valid_parquet, columns=["src_text", "tgt_text"])
        return table.column("src_text").to_pylist(), table.column("tgt_text").to_pylist()


# ---------------------------------------------------------------------------
# Preparation: cache key, streaming encoder, resumable shards
# ---------------------------------------------------------------------------


def _cache_key(paths: list[Path], settings: dict[str, int | None]) -> str:
    """sha256 hex over the settings and the files' bytes (streamed, each prefixed by its size)."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for path in paths:
        digest.update(f"{path.stat().st_size}\0".encode())
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _open_prepared(root: Path) -> PreparedData:
    spm_model = root / "spm.model"
    return PreparedData(
        root=root,
        spm_model=spm_model,
        train_arrow=root / "train.arrow",
        valid_parquet=root / "valid.parquet",
        vocab_size=Tokenizer(spm_model).vocab_size,
    )


def _check_exist(paths: list[Path]) -> None:
    """Each path is a readable file (before anything is hashed, read or written); DataError naming its key
    (:func:`nas.space.datafiles.file_problem`, the check ``load_spec`` runs too)."""
    for path, key in zip(paths, _KEYS):
        problem = file_problem(path, key)
        if problem:
            raise DataError(f"{key}: {problem}")


def _write_parquet(path: Path, src: list[list[int]], tgt: list[list[int]], **text: list[str]) -> None:
    ids = pa.list_(pa.int32())
    columns = {"src": pa.array(src, type=ids), "tgt": pa.array(tgt, type=ids)}
    columns.update({name: pa.array(values, type=pa.string()) for name, values in text.items()})
    pq.write_table(pa.table(columns), path)


@dataclass(frozen=True)
class _Plan:
    """How the training pairs are cut into shards; ``plan.json`` in the work folder, written once the
    tokenizer is trained (its presence means: files aligned, ``spm.model`` final)."""

    pairs: int
    """Training pairs to encode (the first ``max_train_pairs`` lines)."""
    shard_pairs: int
    """Pairs per shard; shard ``i`` holds pairs ``[i * shard_pairs, (i + 1) * shard_pairs)``."""
    spm_pairs: int
    """Pairs SentencePiece was trained on (all, or a sample)."""

    @property
    def shards(self) -> int:
        return -(-self.pairs // self.shard_pairs)

    def size(self, shard: int) -> int:
        """Pairs in ``shard``."""
        return min(self.shard_pairs, self.pairs - shard * self.shard_pairs)


def _read_plan(work: Path) -> _Plan | None:
    """The work folder's plan, or None when there is none yet (or it is unusable: then everything is redone)."""
    try:
        plan = _Plan(**json.loads((work / _PLAN).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return plan if (work / "spm.model").is_file() and plan.pairs > 0 and plan.shard_pairs > 0 else None


def _shard_path(work: Path, shard: int) -> Path:
    return work / f"shard-{shard:05d}.arrow"


def encode_pairs(sp: spm.SentencePieceProcessor, src_lines: list[str], tgt_lines: list[str],
                  max_len: int) -> pa.Table:
    """Encode raw lines (stripped here) and keep the pairs whose sides both have 1 to ``max_len`` ids;
    a table with columns ``src``, ``tgt``: list<int32>."""
    columns = {}
    for name, lines in (("src", src_lines), ("tgt", tgt_lines)):
        parts = [pa.array(sp.encode([line.strip() for line in lines[lo:lo + _ENCODE_LINES]], out_type=int,
                                    num_threads=1), type=pa.list_(pa.int32()))
                 for lo in range(0, len(lines), _ENCODE_LINES)]
        columns[name] = pa.concat_arrays(parts) if parts else pa.array([], type=pa.list_(pa.int32()))
    src_len = pc.list_value_length(columns["src"]).to_numpy(zero_copy_only=False)
    tgt_len = pc.list_value_length(columns["tgt"]).to_numpy(zero_copy_only=False)
    keep = (src_len > 0) & (src_len <= max_len) & (tgt_len > 0) & (tgt_len <= max_len)
    return pa.table(columns).filter(pa.array(keep))


def write_shard(work: Path, shard: int, table: pa.Table) -> int:
    """Write shard ``shard`` of a preparation's work folder atomically (uncompressed Arrow IPC, the table of
    :func:`encode_pairs`); returns its rows."""
    with atomic_path(_shard_path(work, shard)) as tmp:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    return table.num_rows


def _die_with_parent(parent: int) -> None:
    """Linux: have this process SIGKILLed when ``parent`` (the preparing process) dies (``PR_SET_PDEATHSIG``),
    so a killed preparation leaves no encoding worker behind; elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _serve_encoding() -> None:
    """An encoding worker's main loop: ``python -c "from nas.data import _serve_encoding; _serve_encoding()"
    SPM_MODEL WORK MAX_LEN PARENT_PID``.

    Reads pickled ``(shard, raw source lines, raw target lines)`` tasks from stdin until EOF; for each, encodes
    and writes ``WORK/shard-NNNNN.arrow`` and answers ``("ok", kept pairs)`` or ``("error", message)`` (a
    pickle on what was stdout; stray prints go to stderr).
    """
    model, work, max_len, parent = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    _die_with_parent(parent)
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sp = spm.SentencePieceProcessor(model_file=model)
    tasks = sys.stdin.buffer
    while True:
        try:
            shard, src_lines, tgt_lines = pickle.load(tasks)
        except EOFError:
            return
        try:
            answer = ("ok", write_shard(work, shard, encode_pairs(sp, src_lines, tgt_lines, max_len)))
        except Exception as e:  # noqa: BLE001 - reported to the preparing process, which raises it
            answer = ("error", f"{type(e).__name__}: {e}")
        pickle.dump(answer, answers)
        answers.flush()


class ShardEncoders(Protocol):
    """Where :func:`prepare_data` encodes its shards: the local worker processes (:class:`_Encoders`) or a Ray
    cluster (:class:`nas.search.ray_encode.RayEncoders`). Each finished shard ends up as
    :func:`write_shard`'s file in the work folder; at most a bounded number are in flight."""

    def submit(self, shard: int, src_lines: list[str], tgt_lines: list[str]) -> list[int]:
        """Hand over one shard's raw lines; returns the sizes (pairs) of the shards finished meanwhile."""
        ...

    def drain(self) -> Iterator[int]:
        """Yield the sizes of the remaining shards as they finish."""
        ...

    def close(self) -> None:
        """Release the workers (stop what is unfinished)."""
        ...


EncodersFactory = Callable[[Path, Path, int], ShardEncoders]
"""``(spm.model path, work folder, max_len) -> ShardEncoders``: :func:`prepare_data`'s ``encoders``."""


class _Encoders:
    """``n`` encoding worker processes (:func:`_serve_encoding`), fed round-robin, at most two shards each in
    flight (bounded memory).

    Plain subprocesses (not ``multiprocessing``): they inherit no file descriptor (the entry's lock), no
    thread, and never re-import the caller's ``__main__`` (a script without an ``if __name__ == "__main__"``
    guard would otherwise start a second preparation in each worker, which then waits for the lock forever).
    """

    def __init__(self, n: int, model: Path, work: Path, max_len: int) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        code = "from nas.data import _serve_encoding; _serve_encoding()"
        self.procs = [subprocess.Popen([sys.executable, "-c", code, str(model), str(work), str(max_len),
                                        str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
                      for _ in range(n)]
        self.pending: list[deque[int]] = [deque() for _ in range(n)]
        self.sent = 0

    def submit(self, shard: int, src_lines: list[str], tgt_lines: list[str]) -> list[int]:
        """Hand a shard to the next worker (after waiting for its oldest one when it has two); returns the sizes
        (pairs) of the shards that finished meanwhile."""
        k = self.sent % len(self.procs)
        self.sent += 1
        done = [self._answer(k)] if len(self.pending[k]) >= 2 else []
        pickle.dump((shard, src_lines, tgt_lines), self.procs[k].stdin, protocol=pickle.HIGHEST_PROTOCOL)
        self.procs[k].stdin.flush()
        self.pending[k].append(len(src_lines))
        return done

    def drain(self) -> Iterator[int]:
        """Yield the sizes of the remaining shards as they finish."""
        for k in range(len(self.procs)):
            while self.pending[k]:
                yield self._answer(k)

    def _answer(self, k: int) -> int:
        try:
            status, value = pickle.load(self.procs[k].stdout)
        except EOFError:
            raise RuntimeError(f"encoding worker {self.procs[k].pid} died (exit status {self.procs[k].wait()}); "
                               f"its error is above") from None
        if status != "ok":
            raise RuntimeError(f"encoding worker {self.procs[k].pid} failed: {value}")
        return self.pending[k].popleft()

    def close(self) -> None:
        """Let the workers exit (end of input) once their work is done; kill them if it is not."""
        for proc, pending in zip(self.procs, self.pending):
            proc.stdin.close()
            if pending:
                proc.kill()
        for proc in self.procs:
            proc.wait()
            proc.stdout.close()


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _shard_lines(src: Path, tgt: Path, plan: _Plan, todo: list[int]) -> Iterator[tuple[int, list[str], list[str]]]:
    """``(shard, raw source lines, raw target lines)`` of the shards ``todo`` (ascending), streaming both files
    and skipping over the shards already encoded.

    Raises:
        DataError: a file ends early or the two disagree (it changed since it was counted).
    """
    wanted = set(todo)
    with _open_text(src, _KEYS[0]) as fs, _open_text(tgt, _KEYS[1]) as ft:
        for shard in range(max(todo) + 1):
            size = plan.size(shard)
            if shard not in wanted:
                got = (_skip(fs, size, src, _KEYS[0]), _skip(ft, size, tgt, _KEYS[1]))
                a = b = None
            else:
                a, b = _read(fs, size, src, _KEYS[0]), _read(ft, size, tgt, _KEYS[1])
                got = (len(a), len(b))
            if got != (size, size):
                raise DataError(f"{src} / {tgt} changed while being prepared (shard {shard} has {got[0]} / {got[1]} "
                                f"of {size} lines); prepare again")
            if a is not None:
                yield shard, a, b


def _encode_shards(work: Path, plan: _Plan, src: Path, tgt: Path, max_len: int, say: Callable[[str], None],
                   progress: bool, encoders: EncodersFactory | None = None) -> None:
    """Encode the shards missing from ``work`` (the others were finished by an earlier run and are reused).

    One worker process per core (:class:`_Encoders`, each loading ``spm.model``) when at least
    ``_POOL_MIN_PAIRS`` pairs are left, else this process; this process streams the files and hands
    ``_SHARD_PAIRS`` raw lines per side to a worker, at most two shards per worker in flight (bounded
    memory). With ``encoders`` (e.g. a Ray cluster's), every shard goes to them instead. Each shard is
    written atomically; the kill point ``data_prepare`` is passed after each one.
    """
    todo = [shard for shard in range(plan.shards) if not _shard_path(work, shard).is_file()]
    if len(todo) < plan.shards:
        say(f"reusing {plan.shards - len(todo)} of {plan.shards} encoded shards in {work}")
    if not todo:
        return
    pairs = sum(plan.size(shard) for shard in todo)
    workers = min(_cpus(), len(todo)) if pairs >= _POOL_MIN_PAIRS and encoders is None else 1
    where = f"in {workers} process{'es' if workers > 1 else ''}" if encoders is None else "on the Ray cluster"
    say(f"encoding {pairs} training pairs ({len(todo)} shards) {where}…")
    columns = (TextColumn("[bold]encoding"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=_console, disable=not progress) as bar:
        task = bar.add_task("encode", total=pairs)

        def finished(size: int) -> None:
            bar.advance(task, size)
            faults.kill_point("data_prepare")  # tests only: a kill with some shards finished

        if workers == 1 and encoders is None:
            sp = spm.SentencePieceProcessor(model_file=str(work / "spm.model"))
            for shard, a, b in _shard_lines(src, tgt, plan, todo):
                write_shard(work, shard, encode_pairs(sp, a, b, max_len))
                finished(len(a))
            return
        pool = (encoders or (lambda model, folder, n: _Encoders(workers, model, folder, n)))(
            work / "spm.model", work, max_len)
        try:
            for shard, a, b in _shard_lines(src, tgt, plan, todo):
                for size in pool.submit(shard, a, b):
                    finished(size)
            for size in pool.drain():
                finished(size)
        finally:
            pool.close()


def _map_ipc(path: Path) -> tuple[pa.MemoryMappedFile, pa.RecordBatch | pa.Table]:
    """Memory-map an Arrow IPC file: its one record batch (zero-copy), or all of its batches as a table.

    Raises:
        DataError: missing or not an Arrow IPC file (names it and the fix).
    """
    try:
        source = pa.memory_map(str(path), "r")
        reader = pa.ipc.open_file(source)
        batch = reader.get_batch(0) if reader.num_record_batches == 1 else reader.read_all()
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"cannot read {path} ({e}); delete {path.parent} and prepare again") from e
    return source, batch


def _write_token_file(path: Path, rows: int, sides: dict[str, tuple[Path, Path]]) -> None:
    """Write the final ``train.arrow`` from raw files: per side, int32 ids and ``rows + 1`` int64 offsets.

    The raw files are memory-mapped into one record batch of ``large_list<int32>`` columns (one
    contiguous buffer of ids and of offsets per side, so a reader maps them as flat arrays), written
    uncompressed.
    """
    arrays = []
    for values_path, offsets_path in sides.values():
        values = pa.memory_map(str(values_path), "r").read_buffer()
        offsets = pa.memory_map(str(offsets_path), "r").read_buffer()
        child = pa.Array.from_buffers(pa.int32(), values.size // 4, [None, values])
        arrays.append(pa.Array.from_buffers(pa.large_list(pa.int32()), rows, [None, offsets], children=[child]))
    batch = pa.RecordBatch.from_arrays(arrays, names=list(sides))
    batch.validate()
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)


def _assemble(work: Path, plan: _Plan, out: Path) -> int:
    """Concatenate the shards, in order, into ``out`` (``train.arrow``); returns its pairs.

    Streams: each shard is mapped in turn and its ids and offsets appended to raw files beside ``out``,
    which :func:`_write_token_file` then turns into the one-batch IPC file; memory stays at a shard.

    Raises:
        DataError: a shard is unreadable (names it; delete the work folder).
    """
    sides = {side: (out.with_name(f".{side}.ids"), out.with_name(f".{side}.offsets")) for side in ("src", "tgt")}
    files = {side: (open(v, "wb"), open(o, "wb")) for side, (v, o) in sides.items()}
    ends = dict.fromkeys(sides, 0)
    rows = 0
    try:
        for ids, offs in files.values():
            offs.write(np.zeros(1, np.int64).tobytes())
        for shard in range(plan.shards):
            _, table = _map_ipc(_shard_path(work, shard))
            for side, (ids, offs) in files.items():
                values, offsets = _flat(table.column(side), side)
                ids.write(memoryview(np.ascontiguousarray(values[offsets[0]:offsets[-1]], dtype=np.int32)))
                offs.write(memoryview(offsets[1:] - offsets[0] + ends[side]))
                ends[side] += int(offsets[-1] - offsets[0])
            rows += table.num_rows
    finally:
        for ids, offs in files.values():
            ids.close()
            offs.close()
    if rows:
        _write_token_file(out, rows, sides)
    for paths in sides.values():
        for p in paths:
            p.unlink()
    return rows


def _train_tokenizer(work: Path, scan: _Scan, vocab_size: int, seed: int, say: Callable[[str], None]) -> _Plan:
    """Train ``work/spm.model`` on the scan's sample, then write the plan (in that order, each atomically)."""
    for stale in work.glob("shard-*.arrow"):  # no plan: shards of an unknown tokenizer
        stale.unlink()
    corpus = scan.src + scan.tgt
    sampled = "all" if len(scan.src) == scan.pairs else f"a random sample of {len(scan.src)} of the {scan.pairs}"
    say(f"training SentencePiece (vocab {vocab_size}) on {len(corpus)} lines ({sampled} training pairs)…")
    Tokenizer.train(corpus, work / ".spm-new", vocab_size, seed=seed)
    for ext in ("vocab", "model"):
        os.replace(work / f".spm-new.{ext}", work / f"spm.{ext}")
    plan = _Plan(pairs=scan.pairs, shard_pairs=_SHARD_PAIRS, spm_pairs=len(scan.src))
    atomic_write_text(work / _PLAN, json.dumps(plan.__dict__) + "\n")
    return plan


def _build(tmp: Path, work: Path, paths: list[Path], scan: Callable[[], _Scan], valid: _Scan, vocab_size: int,
           max_len: int, seed: int, say: Callable[[str], None], progress: bool,
           encoders: EncodersFactory | None = None) -> dict[str, int]:
    """Fill ``tmp`` (the entry's final contents) from the work folder, encoding what is missing; return counts.

    The work folder keeps the tokenizer, the plan and the encoded shards across runs: a killed
    preparation resumes from them. ``scan()`` gives the training files' scan (called only when the
    work folder has no plan yet).
    """
    work.mkdir(exist_ok=True)
    for partial in work.glob(".*"):  # temporary files of writes that were killed
        partial.unlink()
    plan = _read_plan(work)
    if plan is None:
        plan = _train_tokenizer(work, scan(), vocab_size, seed, say)
    _encode_shards(work, plan, paths[0], paths[1], max_len, say, progress, encoders)
    say(f"writing {tmp.name}/train.arrow…")
    kept = _assemble(work, plan, tmp / "train.arrow")
    if not kept:
        shutil.rmtree(work, ignore_errors=True)  # deterministic: nothing to resume
        raise DataError(f"no training pair survives max_len={max_len}; raise max_len or check the files")
    for name in ("spm.model", "spm.vocab"):
        shutil.copyfile(work / name, tmp / name)
    tok = Tokenizer(tmp / "spm.model")
    v_src = [s[:max_len] for s in tok.encode(valid.src)]
    v_tgt = [t[:max_len] for t in tok.encode(valid.tgt)]
    _write_parquet(tmp / "valid.parquet", v_src, v_tgt, src_text=valid.src, tgt_text=valid.tgt)
    return {
        "vocab_size": tok.vocab_size,
        "train_pairs": kept,
        "train_dropped": plan.pairs - kept,
        "valid_pairs": len(v_src),
        "spm_pairs": plan.spm_pairs,
        "shards": plan.shards,
    }


def _entry_lock(root: Path) -> Path:
    """The lock of the cache entry ``root``: ``<cache_dir>/<key>.lock``, held while it is prepared."""
    return root.with_name(f"{root.name}.lock")


def _work_folder(root: Path) -> Path:
    """The resumable work folder of the cache entry ``root``: ``<cache_dir>/<key>.work`` (tokenizer, plan, shards)."""
    return root.with_name(f"{root.name}.work")


def _remove_leftovers(cache_dir: Path, own: Path) -> list[Path]:
    """Delete the ``<key>.tmp-*`` folders of preparations that died (``kill -9``, power loss) and return them.

    A folder is a leftover when its entry's lock (:func:`_entry_lock`) is not held: a running preparation
    holds it from before its folder exists until after it is gone. The caller holds the lock of the entry
    ``own``, so every temporary folder of that entry is a leftover. A ``<key>.work`` folder is kept (a
    later preparation of that entry resumes from it) unless its entry is finished (a kill between the
    publication and its removal).
    """
    removed = []
    for tmp in sorted(cache_dir.glob("*.tmp-*")):
        root = cache_dir / tmp.name.split(".tmp-", 1)[0]
        if tmp.is_dir() and not tmp.is_symlink() and (root == own or not is_held(_entry_lock(root))):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    for work in sorted(cache_dir.glob("*.work")):
        root = cache_dir / work.name[: -len(".work")]
        if work.is_dir() and not work.is_symlink() and (root / _DONE).is_file() and not is_held(_entry_lock(root)):
            shutil.rmtree(work, ignore_errors=True)
            removed.append(work)
    return removed


def _publish(tmp: Path, root: Path) -> None:
    """Atomically move the finished ``tmp`` folder to ``root`` (a racing winner is kept)."""
    if root.exists() and not (root / _DONE).exists():
        shutil.rmtree(root)  # incomplete leftover; never reused
    try:
        os.rename(tmp, root)
    except OSError:
        if not (root / _DONE).exists():
            raise
        shutil.rmtree(tmp)


def prepare_data(
    train_src: str | Path,
    train_tgt: str | Path,
    valid_src: str | Path,
    valid_tgt: str | Path,
    vocab_size: int,
    cache_dir: str | Path,
    *,
    max_train_pairs: int | None = None,
    max_valid_pairs: int | None = None,
    max_len: int = 128,
    seed: int = 0,
    progress: bool = True,
    encoders: EncodersFactory | None = None,
) -> PreparedData:
    """Tokenize a parallel corpus into a cached, content-addressed folder, streaming (memory independent of
    the corpus size) and resumable.

    Keeps the first ``max_train_pairs`` / ``max_valid_pairs`` pairs. Steps:

    1. One streaming pass over the training files (``_SHARD_PAIRS`` lines at a time, gzip or plain) counts
       their lines (a misalignment fails here, before anything is trained or written) and draws a uniform
       random sample of ``_INPUT_SENTENCE_SIZE / 2`` pairs (reservoir sampling, seeded by ``seed``; every
       pair when there are fewer).
    2. ONE joint unigram SentencePiece model is trained on the sample's source and target lines.
    3. A second pass encodes the pairs in shards of ``_SHARD_PAIRS`` on all cores (a process per core,
       each loading the model, for ``_POOL_MIN_PAIRS`` pairs or more), or wherever ``encoders`` (a
       :data:`EncodersFactory`, e.g. :class:`nas.search.ray_encode.RayEncoders` on a Ray cluster) puts them;
       the result is the same. Training pairs with an empty side or
       a side longer than ``max_len`` tokens (BOS/EOS not counted) are dropped.
    4. The shards are concatenated into ``train.arrow`` (uncompressed Arrow IPC, ``large_list<int32>``
       columns ``src``, ``tgt``, memory-mapped by :meth:`PreparedData.corpus`); the validation pairs are
       all kept, truncated to ``max_len`` tokens, in ``valid.parquet`` with their text.

    The folder is ``cache_dir / key[:16]`` where ``key`` is a sha256 over the four files'
    bytes and all settings; a folder holding a ``DONE`` marker is reused as is. A new folder
    is written under a temporary sibling name (``<key>.tmp-*``) and renamed into place when complete, so an
    interrupted run never leaves a folder that looks finished. Steps 2-3 keep their results in
    ``cache_dir/<key>.work/`` (``spm.model``, ``plan.json``, ``shard-NNNNN.arrow``, each written
    atomically): a killed preparation resumes from the finished shards (the same files, so the same
    key); the folder is deleted once the entry is published. The kill point ``data_prepare``
    (:mod:`nas.faults`) is passed after each shard written, then once with the temporary folder filled.

    One process prepares an entry at a time: it holds ``cache_dir/<key>.lock`` (``flock``, released by the
    kernel when the process dies) while it builds; a second one waits, then reuses the result. Holding
    that lock, it first deletes the temporary folders that killed preparations left behind (those whose
    entry's lock nobody holds), never the folder of a preparation still running.

    Raises:
        DataError: a file is missing or unreadable, source and target line counts differ
            (checked before anything is trained or written), a split has no pairs, or no
            training pair survives ``max_len``.
        ValueError: ``vocab_size`` or ``max_len`` is not positive.
    """
    if vocab_size <= 0 or max_len <= 0:
        raise ValueError(f"vocab_size ({vocab_size}) and max_len ({max_len}) must be positive")
    paths = [Path(p) for p in (train_src, train_tgt, valid_src, valid_tgt)]
    _check_exist(paths)
    settings = {"format": _FORMAT_VERSION, "vocab_size": vocab_size, "max_train_pairs": max_train_pairs,
                "max_valid_pairs": max_valid_pairs, "max_len": max_len, "seed": seed}
    cache_dir = Path(cache_dir)
    root = cache_dir / _cache_key(paths, settings)[:16]
    work = _work_folder(root)
    say = _console.print if progress else (lambda _msg: None)
    if (root / _DONE).exists():
        say(f"reusing prepared data in {root}")
        return _open_prepared(root)

    def scan_train() -> _Scan:
        say(f"reading {paths[0]} and {paths[1]}…")
        return _scan_pairs(paths[0], paths[1], max_train_pairs, _KEYS[:2], sample=_INPUT_SENTENCE_SIZE // 2,
                           seed=seed)

    # A plan in the work folder means these very files (same key) were checked and sampled already.
    train = None if _read_plan(work) else scan_train()
    valid = _scan_pairs(paths[2], paths[3], max_valid_pairs, _KEYS[2:], sample=None)
    cache_dir.mkdir(parents=True, exist_ok=True)
    lock = _entry_lock(root)
    if is_held(lock):
        say(f"waiting for {holder_text(lock)}, which prepares the same data in {root}…")
    with hold(lock, command=f"prepare_data {root}", blocking=True):  # one preparation per entry at a time
        if (root / _DONE).exists():  # the process we waited for prepared it
            say(f"reusing prepared data in {root}")
            return _open_prepared(root)
        for leftover in _remove_leftovers(cache_dir, root):
            say(f"removed {leftover}, left by a preparation that was killed")
        tmp = Path(tempfile.mkdtemp(prefix=f"{root.name}.tmp-", dir=cache_dir))
        try:
            stats = _build(tmp, work, paths, lambda: train or scan_train(), valid, vocab_size, max_len, seed, say,
                           progress, encoders)
            (tmp / _DONE).write_text(json.dumps({**settings, **stats}, indent=2) + "\n")
            tmp.chmod(0o755)  # mkdtemp makes it private; the published cache is shared
            faults.kill_point("data_prepare")  # tests only: a kill with the folder filled, not yet published
            _publish(tmp, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    say(f"prepared data in {root}: {stats['train_pairs']} train pairs "
        f"({stats['train_dropped']} dropped), {stats['valid_pairs']} valid pairs, "
        f"vocab {stats['vocab_size']}")
    return _open_prepared(root)


# ---------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------


@dataclass
class Batch:
    """A padded batch of ``b`` sentence pairs.

    Attributes:
        src: ``[b, s]`` int64, source ids + EOS, right-padded with ``PAD_ID``.
        tgt_in: ``[b, t]`` int64, BOS + target ids (decoder input), padded.
        tgt_out: ``[b, t]`` int64, target ids + EOS (labels), padded.
        ntokens: number of non-pad label tokens, ``(tgt_out != PAD_ID).sum()``.
    """

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    ntokens: int

    def to(self, device: torch.device | str, pin_memory: bool = False) -> Batch:
        """Return a copy with all tensors on ``device``; ``pin_memory`` (CUDA): through page-locked memory, so the
        copy is asynchronous (``non_blocking``) and the host does not wait for it."""
        tensors = (self.src, self.tgt_in, self.tgt_out)
        if pin_memory:
            tensors = tuple(t.pin_memory() for t in tensors)
        src, tgt_in, tgt_out = (t.to(device, non_blocking=pin_memory) for t in tensors)
        return Batch(src, tgt_in, tgt_out, self.ntokens)


def collate(src_ids: Sequence[Sequence[int]], tgt_ids: Sequence[Sequence[int]]) -> Batch:
    """Pad pairs of id lists (no BOS/EOS) into a :class:`Batch` (see :meth:`TokenCorpus.collate`).

    Raises:
        ValueError: the lists are empty or of different lengths.
    """
    if not len(src_ids) or len(src_ids) != len(tgt_ids):
        raise ValueError(
            f"collate needs equally many (>0) sources and targets, got {len(src_ids)} and {len(tgt_ids)}"
        )
    return TokenCorpus.from_lists(src_ids, tgt_ids).collate(np.arange(len(src_ids)))


class TokenBatcher:
    """Token-count batches from length buckets (fairseq-style), computed with numpy.

    Pairs are sorted by ``(len(src), len(tgt))`` (ties broken by a ``seed``-ed shuffle when
    ``shuffle``) and cut greedily so that ``batch_size * padded_len <= max_tokens``, where
    ``padded_len`` is the longest source or target in the batch plus one (EOS/BOS). A single
    pair longer than ``max_tokens`` forms a batch of its own. Batch membership is fixed; each
    epoch only reorders the batches.

    The batches are exactly those of the list-based batcher this replaced (same seed, same data:
    same membership, same order in every epoch), so runs resume identically: the tie-break is
    ``random.Random(seed).shuffle`` of ``range(n)`` (about 0.7 s per million pairs), the sort a stable
    ``np.lexsort``, the epoch order ``random.Random(f"{seed}:{epoch}").shuffle`` of the batches.

    Built either from a :class:`TokenCorpus` (``TokenBatcher(corpus, max_tokens)``: memory-mapped ids
    stay mapped; each process holds only ``[n]`` lengths and order arrays, about 20 bytes a pair) or from
    two lists of id lists (``TokenBatcher(src_ids, tgt_ids, max_tokens)``, copied into a corpus).

    Attributes:
        corpus: the pairs batched.
    """

    def __init__(
        self,
        src_ids: Sequence[Sequence[int]] | TokenCorpus,
        tgt_ids: Sequence[Sequence[int]] | int | None = None,
        max_tokens: int | None = None,
        *,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        """Raises ValueError if ``max_tokens < 8`` or the two lists differ in length; TypeError if
        ``max_tokens`` is missing."""
        if isinstance(src_ids, TokenCorpus):
            if tgt_ids is not None and max_tokens is not None:
                raise TypeError("TokenBatcher(corpus, max_tokens) takes no target lists")
            corpus, max_tokens = src_ids, (tgt_ids if max_tokens is None else max_tokens)
        else:
            corpus = None
        if max_tokens is None:
            raise TypeError("TokenBatcher needs max_tokens")
        if max_tokens < 8:
            raise ValueError(f"max_tokens must be at least 8, got max_tokens={max_tokens}")
        if corpus is None:
            if len(src_ids) != len(tgt_ids):
                raise ValueError(f"{len(src_ids)} sources but {len(tgt_ids)} targets")
            corpus = TokenCorpus.from_lists(src_ids, tgt_ids)
        self.corpus = corpus
        self.max_tokens, self.shuffle, self.seed = max_tokens, shuffle, seed
        self._order, self._bounds = self._cut(self._sorted_indices())

    def _sorted_indices(self) -> np.ndarray:
        """``[n]`` int64 pair indices sorted by (source length, target length), ties in shuffled order."""
        n = len(self.corpus)
        if self.shuffle:
            order = list(range(n))
            random.Random(self.seed).shuffle(order)  # random tie-break; the sort below is stable
            perm = np.fromiter(order, dtype=np.int64, count=n)
            del order
        else:
            perm = np.arange(n, dtype=np.int64)
        keys = (self.corpus.tgt_lengths[perm], self.corpus.src_lengths[perm])  # lexsort: last key first
        return perm[np.lexsort(keys)]

    def _cut(self, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Greedy cut of ``order``: returns it and the ``[batches + 1]`` int64 batch boundaries in it.

        A batch from position ``a`` ends before the first ``p > a`` with
        ``(p - a + 1) * max(padded_len[a..p]) > max_tokens``; since ``max(...) >= padded_len[a]``, that ``p`` lies
        within ``max_tokens // padded_len[a] + 1`` positions, so each batch looks at a short window.
        """
        padded = np.maximum(self.corpus.src_lengths[order], self.corpus.tgt_lengths[order]).astype(np.int64) + 1
        n, limit = len(order), self.max_tokens
        counts = np.arange(1, limit + 3, dtype=np.int64)  # [max_tokens + 2]: batch sizes 1, 2, ...
        bounds = [0]
        start = 0
        while start < n:
            window = max(limit // int(padded[start]), 1) + 1
            tokens = np.maximum.accumulate(padded[start:start + window]) * counts[:min(window, n - start)]
            over = np.flatnonzero(tokens[1:] > limit)  # the first pair that does not fit any more
            start += int(over[0]) + 1 if len(over) else len(tokens)
            bounds.append(start)
        return order, np.asarray(bounds, dtype=np.int64)

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self._bounds) - 1

    def _epoch_order(self, epoch: int) -> list[int]:
        """The batch numbers in ``epoch``'s order (shuffling ``range(batches)`` swaps like shuffling the batches)."""
        order = list(range(len(self)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def _indices(self, batch: int) -> np.ndarray:
        return self._order[self._bounds[batch]:self._bounds[batch + 1]]

    def epoch(self, epoch: int) -> list[list[int]]:
        """The batches (lists of pair indices) of ``epoch``.

        Shuffled deterministically by ``(seed, epoch)`` when ``shuffle``; the same arguments
        always give the same list.
        """
        return [self._indices(b).tolist() for b in self._epoch_order(epoch)]

    def batches(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        """Yield the collated batches of ``epoch`` from batch index ``start`` (exact resume).

        Raises:
            ValueError: ``start`` is negative.
        """
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        for b in self._epoch_order(epoch)[start:]:
            yield self.corpus.collate(self._indices(b))
