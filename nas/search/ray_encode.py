"""Encoding a corpus's shards on a Ray cluster (``nas sweep FILE --address ...``): :class:`RayEncoders`.

:func:`nas.data.prepare_data` streams the training files on the driver and hands each shard's raw lines to
its encoders; here each shard is one Ray task on a cluster CPU (SentencePiece loaded from the model's bytes,
:func:`nas.data.encode_pairs`), whose Arrow table comes back to the driver, which writes the shard
(:func:`nas.data.write_shard`) into its work folder. So the corpus need not be on the workers' disks, and the
result is the file a local preparation writes. At most two shards per cluster CPU are in flight (the
driver waits for the oldest before reading on): memory stays bounded, as in Ray Data's streaming execution.
Ray tasks rather than Ray Data: a Ray Data pipeline reads its input on the workers, which here need not see
the driver's files.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import ray

from nas.data import encode_pairs, write_shard

__all__ = ["RayEncoders"]


@ray.remote(num_cpus=1)
def _encode(model: bytes, src_lines: list[str], tgt_lines: list[str], max_len: int) -> pa.Table:
    """One shard on a Ray worker: ``encode_pairs`` with the SentencePiece model given as bytes."""
    import sentencepiece as spm

    return encode_pairs(spm.SentencePieceProcessor(model_proto=model), src_lines, tgt_lines, max_len)


class RayEncoders:
    """:class:`nas.data.ShardEncoders` on the connected Ray cluster (``ray.init`` first).

    Args:
        model: the preparation's ``spm.model`` (read once, put in the object store once).
        work: the preparation's work folder on the driver, where the shards are written.
        max_len: the longest side kept (ids).
        in_flight: shards submitted and not yet written (default: two per cluster CPU).
    """

    def __init__(self, model: Path, work: Path, max_len: int, in_flight: int | None = None) -> None:
        self.work, self.max_len = Path(work), max_len
        self.model = ray.put(Path(model).read_bytes())
        self.limit = in_flight or max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
        self.pending: dict[ray.ObjectRef, tuple[int, int]] = {}  # task -> (shard, pairs), in submission order

    def submit(self, shard: int, src_lines: list[str], tgt_lines: list[str]) -> list[int]:
        """Start one shard's task; returns the sizes of the shards written meanwhile (waiting for the oldest
        while ``in_flight`` are running)."""
        done = []
        while len(self.pending) >= self.limit:
            done += self._write(self._ready(1))
        self.pending[_encode.remote(self.model, src_lines, tgt_lines, self.max_len)] = (shard, len(src_lines))
        return done + self._write(self._ready(0))

    def drain(self) -> Iterator[int]:
        """Write the remaining shards as their tasks finish; yield their sizes."""
        while self.pending:
            yield from self._write(self._ready(1))

    def close(self) -> None:
        """Cancel the tasks not written yet (an error or a kill on the driver)."""
        for ref in self.pending:
            ray.cancel(ref, force=True)
        self.pending.clear()

    def _ready(self, at_least: int) -> list[ray.ObjectRef]:
        refs = list(self.pending)
        if not refs:
            return []
        ready, _ = ray.wait(refs, num_returns=max(at_least, 1) if at_least else len(refs),
                            timeout=None if at_least else 0)
        return ready

    def _write(self, refs: list[ray.ObjectRef]) -> list[int]:
        sizes = []
        for ref in refs:
            shard, size = self.pending.pop(ref)
            write_shard(self.work, shard, ray.get(ref))  # a task's error is raised here, naming its cause
            sizes.append(size)
        return sizes
