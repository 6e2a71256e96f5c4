"""The content-addressed data cache: :func:`prepare_data` and the life of one cache entry.

Owns the entry's key (a sha256 over the four files and the settings), its lock ``<key>.lock`` (one preparation
per entry at a time), its resumable work folder ``<key>.work`` (tokenizer, :class:`~nas.data.encode.ShardPlan`,
encoded shards), the temporary folder ``<key>.tmp-*`` filled and then published by a rename, the removal of
what killed preparations left behind, and the build steps between: training the tokenizer on a sample,
assembling the shards into ``train.arrow``, writing ``valid.parquet``. The shards themselves are encoded by
:mod:`nas.data.encode`; the finished folder is read through :class:`~nas.data.prepared.PreparedData`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console

from nas import faults
from nas.data.corpus import flat_ids, map_ipc, write_token_file
from nas.data.encode import EncodersFactory, ShardPlan, encode_shards, shard_path
from nas.data.errors import DataError
from nas.data.prepared import PreparedData
from nas.data.text import DATA_KEYS, PairScan, scan_pairs
from nas.data.tokenizer import INPUT_SENTENCE_SIZE, Tokenizer
from nas.locks import hold, holder_text, is_held
from nas.space.datafiles import file_problem

__all__ = ["prepare_data"]

_FORMAT_VERSION = 2  # bump when the cache layout or the preprocessing changes (2: train.arrow, sampled tokenizer)
_DONE = "DONE"
_SHARD_PAIRS = 65_536
"""Training pairs read and encoded per shard (the unit of resumption and of work per encoding process)."""
_console = Console(stderr=True, highlight=False, soft_wrap=True)


def _cache_key(paths: list[Path], settings: dict[str, int | None]) -> str:
    """sha256 hex over the settings and the files' bytes (streamed, each prefixed by its size)."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for path in paths:
        digest.update(f"{path.stat().st_size}\0".encode())
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _check_exist(paths: list[Path]) -> None:
    """Each path is a readable file (before anything is hashed, read or written); DataError naming its key
    (:func:`nas.space.datafiles.file_problem`, the check ``load_spec`` runs too)."""
    for path, key in zip(paths, DATA_KEYS):
        problem = file_problem(path, key)
        if problem:
            raise DataError(f"{key}: {problem}")


def _write_parquet(path: Path, src: list[list[int]], tgt: list[list[int]], **text: list[str]) -> None:
    ids = pa.list_(pa.int32())
    columns = {"src": pa.array(src, type=ids), "tgt": pa.array(tgt, type=ids)}
    columns.update({name: pa.array(values, type=pa.string()) for name, values in text.items()})
    pq.write_table(pa.table(columns), path)


def _assemble(work: Path, plan: ShardPlan, out: Path) -> int:
    """Concatenate the shards, in order, into ``out`` (``train.arrow``); returns its pairs.

    Streams: each shard is mapped in turn and its ids and offsets appended to raw files beside ``out``,
    which :func:`~nas.data.corpus.write_token_file` then turns into the one-batch IPC file; memory stays at a shard.

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
            _, table = map_ipc(shard_path(work, shard))
            for side, (ids, offs) in files.items():
                values, offsets = flat_ids(table.column(side), side)
                ids.write(memoryview(np.ascontiguousarray(values[offsets[0]:offsets[-1]], dtype=np.int32)))
                offs.write(memoryview(offsets[1:] - offsets[0] + ends[side]))
                ends[side] += int(offsets[-1] - offsets[0])
            rows += table.num_rows
    finally:
        for ids, offs in files.values():
            ids.close()
            offs.close()
    if rows:
        write_token_file(out, rows, sides)
    for paths in sides.values():
        for p in paths:
            p.unlink()
    return rows


def _train_tokenizer(work: Path, scan: PairScan, vocab_size: int, seed: int,
                     say: Callable[[str], None]) -> ShardPlan:
    """Train ``work/spm.model`` on the scan's sample, then write the plan (in that order, each atomically)."""
    for stale in work.glob("shard-*.arrow"):  # no plan: shards of an unknown tokenizer
        stale.unlink()
    corpus = scan.src + scan.tgt
    sampled = "all" if len(scan.src) == scan.pairs else f"a random sample of {len(scan.src)} of the {scan.pairs}"
    say(f"training SentencePiece (vocab {vocab_size}) on {len(corpus)} lines ({sampled} training pairs)…")
    Tokenizer.train(corpus, work / ".spm-new", vocab_size, seed=seed)
    for ext in ("vocab", "model"):
        os.replace(work / f".spm-new.{ext}", work / f"spm.{ext}")
    plan = ShardPlan(pairs=scan.pairs, shard_pairs=_SHARD_PAIRS, spm_pairs=len(scan.src))
    plan.write(work)
    return plan


def _build(tmp: Path, work: Path, paths: list[Path], scan: Callable[[], PairScan], valid: PairScan, vocab_size: int,
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
    plan = ShardPlan.read(work)
    if plan is None:
        plan = _train_tokenizer(work, scan(), vocab_size, seed, say)
    encode_shards(work, plan, paths[0], paths[1], max_len, say, progress, encoders, console=_console)
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
       random sample of ``INPUT_SENTENCE_SIZE / 2`` pairs (reservoir sampling, seeded by ``seed``; every
       pair when there are fewer).
    2. ONE joint unigram SentencePiece model is trained on the sample's source and target lines.
    3. A second pass encodes the pairs in shards of ``_SHARD_PAIRS`` on all cores (a process per core,
       each loading the model, when enough pairs are left: :func:`~nas.data.encode.encode_shards`), or
       wherever ``encoders`` (a :data:`~nas.data.encode.EncodersFactory`, e.g.
       :class:`nas.search.ray_encode.RayEncoders` on a Ray cluster) puts them; the result is the same.
       Training pairs with an empty side or a side longer than ``max_len`` tokens (BOS/EOS not counted) are
       dropped.
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
        return PreparedData.open(root)

    def scan_train() -> PairScan:
        say(f"reading {paths[0]} and {paths[1]}…")
        return scan_pairs(paths[0], paths[1], max_train_pairs, DATA_KEYS[:2], sample=INPUT_SENTENCE_SIZE // 2,
                          chunk_pairs=_SHARD_PAIRS, seed=seed)

    # A plan in the work folder means these very files (same key) were checked and sampled already.
    train = None if ShardPlan.read(work) else scan_train()
    valid = scan_pairs(paths[2], paths[3], max_valid_pairs, DATA_KEYS[2:], sample=None, chunk_pairs=_SHARD_PAIRS)
    cache_dir.mkdir(parents=True, exist_ok=True)
    lock = _entry_lock(root)
    if is_held(lock):
        say(f"waiting for {holder_text(lock)}, which prepares the same data in {root}…")
    with hold(lock, command=f"prepare_data {root}", blocking=True):  # one preparation per entry at a time
        if (root / _DONE).exists():  # the process we waited for prepared it
            say(f"reusing prepared data in {root}")
            return PreparedData.open(root)
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
    return PreparedData.open(root)
