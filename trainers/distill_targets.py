"""Stage 3 of Scalable Transformers: sequence-level self-distillation targets (sec. 3.3 eq. 6, sec. 4.1).

Before stage 3, the widest sub-Transformer translates the training sources with beam search
(sec. 4.1: beam 4, length penalty 0.6); the translations replace the ground truth as targets, after
dropping pairs whose length or source/target length ratio is too large. The targets are written in
parts of ``PART_SIZE`` consecutive training pairs, each part an atomically renamed Parquet file
``part-XXXXX.parquet`` (columns ``index``: the pair's index in the training split, ``tgt``: the
target ids without BOS/EOS). A killed run keeps its finished parts and translates only the missing
ones on resume. With data-parallel workers, part ``i`` is translated by rank ``i % world``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from nas.data import EOS_ID, PAD_ID
from nas.atomic import atomic_path, atomic_write_text
from nas.model.decode import beam_search
from nas.model.supernet import SuperTransformer
from nas.precision import autocast_for
from nas.space.arch import Arch
from nas.space import SeqDistillStage

__all__ = ["write_distill_targets", "load_distill_targets", "keep_distilled_pair", "PART_SIZE", "DISTILL_DIR"]

PART_SIZE = 2048
"""Training pairs per Parquet part (the unit of resumption)."""
DISTILL_DIR = "seq_distill"
"""Folder under the supernet's folder that holds the targets."""


def keep_distilled_pair(src_len: int, tgt_len: int, max_length: int, max_ratio: float) -> bool:
    """Sec. 4.1's filter: keep a (source, beam target) pair unless the target is empty or longer than
    ``max_length`` tokens, or either length is more than ``max_ratio`` times the other (lengths in
    subword tokens, EOS excluded)."""
    if tgt_len == 0 or src_len == 0 or tgt_len > max_length:
        return False
    return max(src_len, tgt_len) <= max_ratio * min(src_len, tgt_len)


def _part_path(folder: Path, part: int) -> Path:
    return folder / f"part-{part:05d}.parquet"


@torch.no_grad()
def _translate_part(model: SuperTransformer, arch: Arch, src_ids: list[list[int]], stage: SeqDistillStage,
                    max_src: int, autocast) -> list[list[int]]:
    """Beam-search translations (ids, no BOS/EOS) of ``src_ids`` in input order; batches sorted by length."""
    order = sorted(range(len(src_ids)), key=lambda i: len(src_ids[i]))
    out: list[list[int]] = [[] for _ in src_ids]
    for start in range(0, len(order), stage.batch_size):
        chunk = order[start:start + stage.batch_size]
        rows = [src_ids[i][: max_src - 1] + [EOS_ID] for i in chunk]
        src = torch.full((len(rows), max(map(len, rows))), PAD_ID, dtype=torch.long)  # [b, s]
        for r, ids in enumerate(rows):
            src[r, : len(ids)] = torch.tensor(ids)
        src = src.to(next(model.parameters()).device)
        with autocast:
            hyps = beam_search(model, src, arch, beam_size=stage.beam_size, len_penalty=stage.length_penalty)
        for i, hyp in zip(chunk, hyps):
            out[i] = [t for t in hyp if t != EOS_ID]
    return out


def write_distill_targets(model: SuperTransformer, widest: Arch, src_ids: list[list[int]], folder: str | Path,
                          stage: SeqDistillStage, *, rank: int = 0, world: int = 1, bf16: bool = False,
                          progress: bool | None = None) -> Path:
    """Translate the training sources with the widest sub-Transformer into Parquet parts (resumable).

    Args:
        model: the supernet after the stages before (put in eval mode here, train mode restored after).
        widest: the sub-Transformer that translates (eq. 6's T_max).
        src_ids: the training sources (ids, no EOS); the first ``stage.max_sentences`` are translated.
        folder: where the parts go (created); parts already there are kept and skipped.
        stage: beam size, length penalty, filters and budget (sec. 4.1).
        rank, world: this worker's rank and the number of data-parallel workers.
        bf16: run the beam search under bf16 autocast (on the model's device).
        progress: show a progress bar (default: when stderr is a terminal).
    Returns:
        ``folder``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    n = len(src_ids) if stage.max_sentences is None else min(stage.max_sentences, len(src_ids))
    parts = [p for p in range((n + PART_SIZE - 1) // PART_SIZE) if p % world == rank]
    todo = [p for p in parts if not _part_path(folder, p).is_file()]
    show = sys.stderr.isatty() if progress is None else progress
    autocast = autocast_for("bf16" if bf16 else "fp32", next(model.parameters()).device)
    was_training = model.training
    model.eval()
    total = sum(min(PART_SIZE, n - p * PART_SIZE) for p in todo)
    with Progress(TextColumn("[bold]seq_distill targets"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), disable=not show) as bar:
        task = bar.add_task("beam", total=total)
        for p in todo:
            lo, hi = p * PART_SIZE, min(n, (p + 1) * PART_SIZE)
            hyps = _translate_part(model, widest, src_ids[lo:hi], stage, model.max_positions // 2, autocast)
            keep = [(lo + i, h) for i, h in enumerate(hyps)
                    if keep_distilled_pair(len(src_ids[lo + i]), len(h), stage.max_length, stage.max_length_ratio)]
            table = pa.table({"index": pa.array([k for k, _ in keep], pa.int64()),
                              "tgt": pa.array([h for _, h in keep], pa.list_(pa.int32()))})
            path = _part_path(folder, p)
            with atomic_path(path) as tmp:
                pq.write_table(table, tmp)
            bar.advance(task, hi - lo)
            if not show:
                print(f"seq_distill targets: part {p} ({hi - lo} sentences, {len(keep)} kept) -> {path}",
                      file=sys.stderr, flush=True)
    model.train(was_training)
    if rank == 0:
        info = {"sentences": n, "parts": (n + PART_SIZE - 1) // PART_SIZE, "beam_size": stage.beam_size,
                "length_penalty": stage.length_penalty, "max_length": stage.max_length,
                "max_length_ratio": stage.max_length_ratio}
        atomic_write_text(folder / "info.json", json.dumps(info, indent=2))
    return folder


def load_distill_targets(folder: str | Path, src_ids: list[list[int]],
                         max_sentences: int | None) -> tuple[list[list[int]], list[list[int]]]:
    """The stage-3 corpus: (sources, beam targets) of the kept pairs, in training order.

    Raises:
        FileNotFoundError: a part is missing (names it: the targets were not written completely).
    """
    folder = Path(folder)
    n = len(src_ids) if max_sentences is None else min(max_sentences, len(src_ids))
    src, tgt = [], []
    for p in range((n + PART_SIZE - 1) // PART_SIZE):
        path = _part_path(folder, p)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the stage-3 targets are incomplete; rerun the same command "
                                    f"to translate the missing parts")
        table = pq.read_table(path)
        for i, t in zip(table.column("index").to_pylist(), table.column("tgt").to_pylist()):
            src.append(src_ids[i])
            tgt.append(t)
    return src, tgt
