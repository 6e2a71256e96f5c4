"""Sentence pairs as flat token ids, and the Arrow file that holds them.

Owns :class:`TokenCorpus` (each side a ``values`` array of all its ids and an ``offsets`` array; for the
prepared training split both are numpy views over the memory-mapped ``train.arrow``), its padding into a
:class:`~nas.data.batch.Batch` (:meth:`TokenCorpus.collate`, :func:`collate`) and the ``train.arrow`` format:
:func:`write_token_file` writes it, :func:`map_ipc` maps an Arrow IPC file, :func:`flat_ids` views a list column
as flat arrays.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc

from nas.data.batch import Batch
from nas.data.errors import DataError
from nas.data.ids import BOS_ID, EOS_ID, PAD_ID

__all__ = ["TokenCorpus", "collate", "flat_ids", "map_ipc", "write_token_file"]


def flat_ids(column: pa.Array | pa.ChunkedArray, name: str) -> tuple[np.ndarray, np.ndarray]:
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
    (:meth:`nas.data.PreparedData.corpus`) both are read-only numpy views over the memory-mapped
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
        see :func:`flat_ids`).

        Raises:
            DataError: a column is missing, not a list of integers or has nulls.
        """
        names = table.schema.names
        if "src" not in names or "tgt" not in names:
            raise DataError(f"token table has columns {names}, not src and tgt; delete the cache folder and "
                            f"prepare again")
        return cls(*flat_ids(table.column("src"), "src"), *flat_ids(table.column("tgt"), "tgt"),
                   owner=(owner, table))

    @classmethod
    def open(cls, path: str | Path) -> TokenCorpus:
        """Memory-map an Arrow IPC file written by :func:`nas.data.prepare_data` (columns ``src``, ``tgt``:
        ``large_list<int32>``, one record batch): nothing is read until rows are used.

        Raises:
            DataError: the file is missing or not such an Arrow file (names it and the fix).
        """
        source, batch = map_ipc(Path(path))
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
        import torch  # here, not at the top: the encoding worker processes start without it

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


def map_ipc(path: Path) -> tuple[pa.MemoryMappedFile, pa.RecordBatch | pa.Table]:
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


def write_token_file(path: Path, rows: int, sides: dict[str, tuple[Path, Path]]) -> None:
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
