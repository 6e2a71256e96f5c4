"""Parallel-text data: reading, a joint SentencePiece tokenizer, a Parquet cache and token batching.

Pipeline: :func:`prepare_data` reads the four raw text files (gzip or plain, one sentence
a line), trains one joint SentencePiece model on the training source+target lines, encodes
both splits and writes them as Parquet into a content-addressed cache folder.
:class:`TokenBatcher` then cuts the encoded pairs into fairseq-style token-count batches
that :func:`collate` turns into padded ``int64`` tensors (:class:`Batch`).

Token ids: ``PAD_ID=0``, ``UNK_ID=1``, ``BOS_ID=2``, ``EOS_ID=3``. Stored and encoded
sequences carry no BOS/EOS; :func:`collate` adds them.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import sentencepiece as spm
import torch
from rich.console import Console

from nas import faults
from nas.errors import NasError
from nas.locks import hold, holder_text, is_held
from nas.space.datafiles import file_problem

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "UNK_ID",
    "Batch",
    "DataError",
    "PreparedData",
    "TokenBatcher",
    "Tokenizer",
    "collate",
    "prepare_data",
    "read_lines",
]

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

_FORMAT_VERSION = 1  # bump when the cache layout or the preprocessing changes
_GZIP_MAGIC = b"\x1f\x8b"
_DONE = "DONE"
_SPLITS = ("train", "valid")
_INPUT_SENTENCE_SIZE = 200_000
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
    try:
        opener = gzip.open if _is_gzip(path) else open
        with opener(path, "rt", encoding="utf-8") as f:
            return [line.strip() for line in itertools.islice(f, limit)]
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise DataError(f"cannot read data file {path} ({e}); {_fix_hint(key)}") from e


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------


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
# Prepared (cached) data
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedData:
    """A finished cache folder produced by :func:`prepare_data`.

    Attributes:
        root: the cache folder.
        spm_model: ``root / "spm.model"``.
        train_parquet: ``root / "train.parquet"`` (columns ``src``, ``tgt``: list<int32>).
        valid_parquet: ``root / "valid.parquet"`` (also ``src_text``, ``tgt_text``: string).
        vocab_size: actual number of pieces of the trained model.
    """

    root: Path
    spm_model: Path
    train_parquet: Path
    valid_parquet: Path
    vocab_size: int

    def tokenizer(self) -> Tokenizer:
        """Load the joint SentencePiece tokenizer."""
        return Tokenizer(self.spm_model)

    def load_split(self, split: str) -> tuple[list[list[int]], list[list[int]]]:
        """Return ``(src_ids, tgt_ids)`` of ``"train"`` or ``"valid"`` (no BOS/EOS).

        Raises:
            ValueError: unknown split name.
        """
        if split not in _SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {_SPLITS}")
        path = self.train_parquet if split == "train" else self.valid_parquet
        table = pq.read_table(path, columns=["src", "tgt"])
        return table.column("src").to_pylist(), table.column("tgt").to_pylist()

    def valid_text(self) -> tuple[list[str], list[str]]:
        """Return the raw (stripped) validation source sentences and target references."""
        table = pq.read_table(self.valid_parquet, columns=["src_text", "tgt_text"])
        return table.column("src_text").to_pylist(), table.column("tgt_text").to_pylist()


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
        train_parquet=root / "train.parquet",
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


def _read_pairs(
    src: Path, tgt: Path, limit: int | None, keys: tuple[str, str]
) -> tuple[list[str], list[str]]:
    """Read two parallel files whole, check they align, then keep the first ``limit`` pairs."""
    src_lines, tgt_lines = read_lines(src, key=keys[0]), read_lines(tgt, key=keys[1])
    if len(src_lines) != len(tgt_lines):
        raise DataError(
            f"parallel files are misaligned: {src} has {len(src_lines)} lines but {tgt} has "
            f"{len(tgt_lines)}; fix {keys[0]} / {keys[1]} in the YAML to point at matching files"
        )
    if not src_lines[:limit]:
        raise DataError(f"no sentence pairs in {src} / {tgt} (limit {limit}); fix {keys[0]} / {keys[1]}")
    return src_lines[:limit], tgt_lines[:limit]


def _write_parquet(path: Path, src: list[list[int]], tgt: list[list[int]], **text: list[str]) -> None:
    ids = pa.list_(pa.int32())
    columns = {"src": pa.array(src, type=ids), "tgt": pa.array(tgt, type=ids)}
    columns.update({name: pa.array(values, type=pa.string()) for name, values in text.items()})
    pq.write_table(pa.table(columns), path)


def _keep_train_pair(src: list[int], tgt: list[int], max_len: int) -> bool:
    return 0 < len(src) <= max_len and 0 < len(tgt) <= max_len


def _build(
    tmp: Path,
    train: tuple[list[str], list[str]],
    valid: tuple[list[str], list[str]],
    vocab_size: int,
    max_len: int,
    seed: int,
    say: Callable[[str], None],
) -> dict[str, int]:
    """Train the tokenizer and write both Parquet splits into ``tmp``; return counts."""
    corpus = train[0] + train[1]
    say(f"training SentencePiece (vocab {vocab_size}) on {len(corpus)} lines…")
    tok = Tokenizer.train(corpus, tmp / "spm", vocab_size, seed=seed)
    say(f"encoding {len(train[0])} training and {len(valid[0])} validation pairs…")
    pairs = zip(tok.encode(train[0]), tok.encode(train[1]))
    kept = [(s, t) for s, t in pairs if _keep_train_pair(s, t, max_len)]
    if not kept:
        raise DataError(f"no training pair survives max_len={max_len}; raise max_len or check the files")
    _write_parquet(tmp / "train.parquet", [s for s, _ in kept], [t for _, t in kept])
    v_src = [s[:max_len] for s in tok.encode(valid[0])]
    v_tgt = [t[:max_len] for t in tok.encode(valid[1])]
    _write_parquet(tmp / "valid.parquet", v_src, v_tgt, src_text=valid[0], tgt_text=valid[1])
    return {
        "vocab_size": tok.vocab_size,
        "train_pairs": len(kept),
        "train_dropped": len(train[0]) - len(kept),
        "valid_pairs": len(v_src),
    }


def _entry_lock(root: Path) -> Path:
    """The lock of the cache entry ``root``: ``<cache_dir>/<key>.lock``, held while it is prepared."""
    return root.with_name(f"{root.name}.lock")


def _remove_leftovers(cache_dir: Path, own: Path) -> list[Path]:
    """Delete the ``<key>.tmp-*`` folders of preparations that died (``kill -9``, power loss) and return them.

    A folder is a leftover when its entry's lock (:func:`_entry_lock`) is not held: a running preparation
    holds it from before its folder exists until after it is gone. The caller holds the lock of the entry
    ``own``, so every temporary folder of that entry is a leftover.
    """
    removed = []
    for tmp in sorted(cache_dir.glob("*.tmp-*")):
        root = cache_dir / tmp.name.split(".tmp-", 1)[0]
        if tmp.is_dir() and not tmp.is_symlink() and (root == own or not is_held(_entry_lock(root))):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
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
) -> PreparedData:
    """Tokenize a parallel corpus into a cached, content-addressed folder.

    Reads the four files (gzip or plain), keeps the first ``max_train_pairs`` /
    ``max_valid_pairs`` pairs, trains ONE joint SentencePiece model on the training source
    and target lines, encodes both splits and writes ``spm.model``, ``train.parquet`` and
    ``valid.parquet``. Training pairs with an empty side or a side longer than ``max_len``
    tokens (BOS/EOS not counted) are dropped; validation pairs are all kept, truncated to
    ``max_len`` tokens.

    The folder is ``cache_dir / key[:16]`` where ``key`` is a sha256 over the four files'
    bytes and all settings; a folder holding a ``DONE`` marker is reused as is. A new folder
    is written under a temporary sibling name (``<key>.tmp-*``) and renamed into place when complete, so an
    interrupted run never leaves a folder that looks finished.

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
    say = _console.print if progress else (lambda _msg: None)
    if (root / _DONE).exists():
        say(f"reusing prepared data in {root}")
        return _open_prepared(root)
    train = _read_pairs(paths[0], paths[1], max_train_pairs, _KEYS[:2])
    valid = _read_pairs(paths[2], paths[3], max_valid_pairs, _KEYS[2:])
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
            stats = _build(tmp, train, valid, vocab_size, max_len, seed, say)
            (tmp / _DONE).write_text(json.dumps({**settings, **stats}, indent=2) + "\n")
            tmp.chmod(0o755)  # mkdtemp makes it private; the published cache is shared
            faults.kill_point("data_prepare")  # tests only: a kill with the folder filled, not yet published
            _publish(tmp, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
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

    def to(self, device: torch.device | str) -> Batch:
        """Return a copy with all tensors on ``device``."""
        tensors = (self.src, self.tgt_in, self.tgt_out)
        src, tgt_in, tgt_out = (t.to(device, non_blocking=True) for t in tensors)
        return Batch(src, tgt_in, tgt_out, self.ntokens)


def _pad(rows: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(rows), max(map(len, rows))), PAD_ID, dtype=torch.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return out


def collate(src_ids: list[list[int]], tgt_ids: list[list[int]]) -> Batch:
    """Pad pairs of id lists (no BOS/EOS) into a :class:`Batch`.

    Raises:
        ValueError: the lists are empty or of different lengths.
    """
    if not src_ids or len(src_ids) != len(tgt_ids):
        raise ValueError(
            f"collate needs equally many (>0) sources and targets, got {len(src_ids)} and {len(tgt_ids)}"
        )
    tgt_out = _pad([list(t) + [EOS_ID] for t in tgt_ids])
    return Batch(
        src=_pad([list(s) + [EOS_ID] for s in src_ids]),
        tgt_in=_pad([[BOS_ID] + list(t) for t in tgt_ids]),
        tgt_out=tgt_out,
        ntokens=int((tgt_out != PAD_ID).sum()),
    )


class TokenBatcher:
    """Token-count batches from length buckets (fairseq-style).

    Pairs are sorted by ``(len(src), len(tgt))`` (ties broken by a ``seed``-ed shuffle when
    ``shuffle``) and cut greedily so that ``batch_size * padded_len <= max_tokens``, where
    ``padded_len`` is the longest source or target in the batch plus one (EOS/BOS). A single
    pair longer than ``max_tokens`` forms a batch of its own. Batch membership is fixed; each
    epoch only reorders the batches.
    """

    def __init__(
        self,
        src_ids: list[list[int]],
        tgt_ids: list[list[int]],
        max_tokens: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        """Raises ValueError if ``max_tokens < 8`` or the two lists differ in length."""
        if max_tokens < 8:
            raise ValueError(f"max_tokens must be at least 8, got max_tokens={max_tokens}")
        if len(src_ids) != len(tgt_ids):
            raise ValueError(f"{len(src_ids)} sources but {len(tgt_ids)} targets")
        self.src_ids, self.tgt_ids = src_ids, tgt_ids
        self.max_tokens, self.shuffle, self.seed = max_tokens, shuffle, seed
        self._batches = self._cut(self._sorted_indices())

    def _sorted_indices(self) -> list[int]:
        order = list(range(len(self.src_ids)))
        if self.shuffle:
            random.Random(self.seed).shuffle(order)  # random tie-break; sort below is stable
        return sorted(order, key=lambda i: (len(self.src_ids[i]), len(self.tgt_ids[i])))

    def _cut(self, order: list[int]) -> list[list[int]]:
        batches: list[list[int]] = []
        current: list[int] = []
        longest = 0
        for i in order:
            length = max(len(self.src_ids[i]), len(self.tgt_ids[i])) + 1
            if current and (len(current) + 1) * max(longest, length) > self.max_tokens:
                batches.append(current)
                current, longest = [], 0
            current.append(i)
            longest = max(longest, length)
        if current:
            batches.append(current)
        return batches

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self._batches)

    def epoch(self, epoch: int) -> list[list[int]]:
        """The batches (lists of pair indices) of ``epoch``.

        Shuffled deterministically by ``(seed, epoch)`` when ``shuffle``; the same arguments
        always give the same list.
        """
        batches = [list(b) for b in self._batches]
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(batches)
        return batches

    def batches(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        """Yield the collated batches of ``epoch`` from batch index ``start`` (exact resume).

        Raises:
            ValueError: ``start`` is negative.
        """
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        for idx in self.epoch(epoch)[start:]:
            yield collate([self.src_ids[i] for i in idx], [self.tgt_ids[i] for i in idx])
