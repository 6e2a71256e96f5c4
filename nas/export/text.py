"""Raw text through an export (``nas translate``): input bytes decoded line by line, translations timed on a
given number of CPU threads."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nas.errors import NasError

__all__ = ["Translations", "decode_lines", "translate_lines"]


def decode_lines(raw: bytes, source: str) -> list[str]:
    """The lines of ``raw`` (UTF-8; a BOM on the first line is dropped), stripped.

    Raises:
        NasError: a line is not UTF-8 (names ``source``, ``stdin`` or the file, the line and the byte, and how to
            convert the input).
    """
    lines = []
    for number, line in enumerate(raw.splitlines(), start=1):
        try:
            lines.append(line.decode("utf-8-sig" if number == 1 else "utf-8").strip())
        except UnicodeDecodeError as e:
            raise NasError(f"{source} line {number} is not UTF-8 (byte {e.start + 1} of the line is "
                           f"{line[e.start:e.start + 1]!r}); convert the input first, e.g. iconv -f latin1 -t utf-8 "
                           "FILE | nas translate ...") from None
    return lines


@dataclass(frozen=True)
class Translations:
    """``hypotheses`` in input order, the decoding wall ``seconds`` and the target ``tokens`` produced."""

    hypotheses: list[str]
    seconds: float
    tokens: int


def translate_lines(model: Any, lines: list[str], *, beam_size: int | None = None, max_tokens: int = 4096,
                    threads: int | None = None,
                    on_batch: Callable[[int, int], None] | None = None) -> Translations:
    """``model.translate`` (an :class:`nas.export.folder.Exported`) of ``lines``, length-sorted batches of at most
    ``max_tokens`` padded source tokens, on ``threads`` torch threads (the caller's count is restored afterwards);
    ``on_batch(sentences, target_tokens)`` after each batch."""
    import torch

    tokens = 0

    def count(sentences: int, target_tokens: int) -> None:
        nonlocal tokens
        tokens += target_tokens
        if on_batch is not None:
            on_batch(sentences, target_tokens)

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        start = time.perf_counter()
        hyps = model.translate(lines, beam_size=beam_size, max_tokens=max_tokens, on_batch=count)
        seconds = max(time.perf_counter() - start, 1e-9)
    finally:  # the threads are this call's: a caller in the same process (the API, a test) keeps its own
        torch.set_num_threads(before)
    return Translations(hyps, seconds, tokens)
