"""Encoding the training pairs in shards: the shard plan, the local worker processes, resuming from finished shards.

Owns :class:`ShardPlan` (how the pairs are cut into shards, ``plan.json`` in a preparation's work folder),
:func:`encode_pairs` and :func:`write_shard` (one shard's table and its file ``shard-NNNNN.arrow``), the
:class:`ShardEncoders` protocol with its local implementation (one plain subprocess per core running
:func:`serve_encoding`), and :func:`encode_shards`, which encodes the shards a work folder lacks.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc
import sentencepiece as spm
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from nas import faults
from nas.data.errors import DataError
from nas.data.text import DATA_KEYS, next_lines, open_text, skip_lines
from nas.atomic import atomic_path, atomic_write_text

__all__ = ["EncodersFactory", "ShardEncoders", "ShardPlan", "encode_pairs", "encode_shards", "serve_encoding",
           "shard_path", "write_shard"]

_POOL_MIN_PAIRS = 500_000
"""Below this many pairs left to encode, encoding runs in the preparing process: starting the worker
processes (about 1 s each: they import this module) costs more than it saves."""
_ENCODE_LINES = 8192
"""Lines per ``SentencePieceProcessor.encode`` call (bounds the Python lists of ids alive at once)."""
_PLAN = "plan.json"


@dataclass(frozen=True)
class ShardPlan:
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
        """Shards in the plan (the last one may be smaller)."""
        return -(-self.pairs // self.shard_pairs)

    def size(self, shard: int) -> int:
        """Pairs in ``shard``."""
        return min(self.shard_pairs, self.pairs - shard * self.shard_pairs)

    @classmethod
    def read(cls, work: Path) -> ShardPlan | None:
        """The work folder's plan, or None when there is none yet (or it is unusable: then everything is
        redone)."""
        try:
            plan = cls(**json.loads((work / _PLAN).read_text()))
        except (OSError, ValueError, TypeError):
            return None
        return plan if (work / "spm.model").is_file() and plan.pairs > 0 and plan.shard_pairs > 0 else None

    def write(self, work: Path) -> None:
        """Write ``work/plan.json`` atomically (after ``work/spm.model``: the plan's presence says it is final)."""
        atomic_write_text(work / _PLAN, json.dumps(self.__dict__) + "\n")


def shard_path(work: Path, shard: int) -> Path:
    """The file of shard ``shard`` in the work folder ``work``: ``shard-NNNNN.arrow``."""
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
    with atomic_path(shard_path(work, shard)) as tmp:
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


def serve_encoding() -> None:
    """An encoding worker's main loop: ``python -c "from nas.data.encode import serve_encoding; serve_encoding()"
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
    """``n`` encoding worker processes (:func:`serve_encoding`), fed round-robin, at most two shards each in
    flight (bounded memory).

    Plain subprocesses (not ``multiprocessing``): they inherit no file descriptor (the entry's lock), no
    thread, and never re-import the caller's ``__main__`` (a script without an ``if __name__ == "__main__"``
    guard would otherwise start a second preparation in each worker, which then waits for the lock forever).
    """

    def __init__(self, n: int, model: Path, work: Path, max_len: int) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        code = "from nas.data.encode import serve_encoding; serve_encoding()"
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


def _shard_lines(src: Path, tgt: Path, plan: ShardPlan, todo: list[int]) -> Iterator[tuple[int, list[str], list[str]]]:
    """``(shard, raw source lines, raw target lines)`` of the shards ``todo`` (ascending), streaming both files
    and skipping over the shards already encoded.

    Raises:
        DataError: a file ends early or the two disagree (it changed since it was counted).
    """
    wanted = set(todo)
    with open_text(src, DATA_KEYS[0]) as fs, open_text(tgt, DATA_KEYS[1]) as ft:
        for shard in range(max(todo) + 1):
            size = plan.size(shard)
            if shard not in wanted:
                got = (skip_lines(fs, size, src, DATA_KEYS[0]), skip_lines(ft, size, tgt, DATA_KEYS[1]))
                a = b = None
            else:
                a, b = next_lines(fs, size, src, DATA_KEYS[0]), next_lines(ft, size, tgt, DATA_KEYS[1])
                got = (len(a), len(b))
            if got != (size, size):
                raise DataError(f"{src} / {tgt} changed while being prepared (shard {shard} has {got[0]} / {got[1]} "
                                f"of {size} lines); prepare again")
            if a is not None:
                yield shard, a, b


def encode_shards(work: Path, plan: ShardPlan, src: Path, tgt: Path, max_len: int, say: Callable[[str], None],
                  progress: bool, encoders: EncodersFactory | None = None, *, console: Console) -> None:
    """Encode the shards missing from ``work`` (the others were finished by an earlier run and are reused).

    One worker process per core (:class:`_Encoders`, each loading ``spm.model``) when at least
    ``_POOL_MIN_PAIRS`` pairs are left, else this process; this process streams the files and hands
    ``plan.shard_pairs`` raw lines per side to a worker, at most two shards per worker in flight (bounded
    memory). With ``encoders`` (e.g. a Ray cluster's), every shard goes to them instead. Each shard is
    written atomically; the kill point ``data_prepare`` is passed after each one. ``say`` prints a line;
    ``console`` shows the progress bar (when ``progress``).

    Raises:
        DataError: a file ends early or the two disagree (it changed since it was counted).
        RuntimeError: an encoding worker failed or died (its error is named).
    """
    todo = [shard for shard in range(plan.shards) if not shard_path(work, shard).is_file()]
    if len(todo) < plan.shards:
        say(f"reusing {plan.shards - len(todo)} of {plan.shards} encoded shards in {work}")
    if not todo:
        return
    pairs = sum(plan.size(shard) for shard in todo)
    workers = min(_cpus(), len(todo)) if pairs >= _POOL_MIN_PAIRS and encoders is None else 1
    where = f"in {workers} process{'es' if workers > 1 else ''}" if encoders is None else "on the Ray cluster"
    say(f"encoding {pairs} training pairs ({len(todo)} shards) {where}…")
    columns = (TextColumn("[bold]encoding"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, disable=not progress) as bar:
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
