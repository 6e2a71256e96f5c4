"""Up-front checks of the data files a sweep YAML names, before anything is trained or written.

A file that is missing, a folder, unreadable, not gzip/UTF-8 text or empty, and a split whose source and
target have different line counts, are reported as :class:`~nas.space.errors.SpecError` naming the YAML key
(``data.train.src``...), the path and the fix. Lines are counted as ``nas.data.read_lines`` splits them
(gzip detected by suffix or magic bytes, UTF-8, universal newlines); the files are read whole once.

Standard library only: :func:`nas.space.loader.load_spec` runs these checks without importing ``nas.data``
(which needs torch, pyarrow and SentencePiece).
"""

from __future__ import annotations

import gzip
import io
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

from nas.space.errors import SpecError

if TYPE_CHECKING:
    from nas.space.schema import SweepSpec

__all__ = ["file_problem", "count_lines", "check_data_files"]


def file_problem(f: Path, key: str) -> str | None:
    """Why ``f`` cannot be opened as the data file named by the YAML key ``key`` (missing, a folder, not a
    regular file, unreadable), as the end of an error message that names the fix; None when it opens.

    The one check of a data file's path: :func:`check_data_files` (at ``load_spec``) and
    ``nas.data.prepare_data`` (before anything is hashed, read or written) both use it.
    """
    if f.is_dir():
        return f"{f} is a folder, not a data file; point {key} at a text file (one sentence per line, gzip or plain UTF-8)"
    if not f.exists():
        return f"file not found: {f} (resolved from {Path.cwd()}); fix the path or run from the folder it is relative to"
    if not f.is_file():
        return f"{f} is not a regular file; point {key} at a text file"
    try:
        f.open("rb").close()
    except OSError as e:
        return f"cannot read {f} ({e.strerror or e}); make it readable (chmod a+r) or point {key} at a readable copy"
    return None


def count_lines(f: Path, key: str, source: str) -> int:
    """Lines of a data file as ``nas.data.read_lines`` splits them (gzip or plain UTF-8, universal newlines).

    Args:
        f: the file.
        key: the YAML key it came from (``data.train.src``), named in errors.
        source: the YAML file, named in errors.

    Raises:
        SpecError: ``f`` is a folder or not a regular file, unreadable, not valid gzip, not UTF-8 or empty;
            names ``key``.
    """
    where = f"{source}: {key}"
    problem = file_problem(f, key)
    if problem:
        raise SpecError(f"{where}: {problem}")
    try:
        with f.open("rb") as raw:
            gz = f.suffix == ".gz" or raw.read(2) == b"\x1f\x8b"
            raw.seek(0)
            with (gzip.open(raw, "rt", encoding="utf-8") if gz else io.TextIOWrapper(raw, encoding="utf-8")) as text:
                count = sum(1 for _ in text)
    except UnicodeDecodeError as e:
        raise SpecError(f"{where}: {f} is not UTF-8 text ({e.reason}); convert it (iconv -t UTF-8) "
                        f"or point {key} at a UTF-8 copy") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise SpecError(f"{where}: {f} is not a valid gzip file ({e or 'truncated'}); download it again "
                        f"or point {key} at the uncompressed file") from None
    except OSError as e:
        raise SpecError(f"{where}: cannot read {f} ({e.strerror or e}); make it readable (chmod a+r) "
                        f"or point {key} at a readable copy") from None
    if count == 0:
        raise SpecError(f"{where}: {f} is empty; point {key} at a file with one sentence per line")
    return count


def check_data_files(spec: SweepSpec, source: str) -> None:
    """Every data file is readable text, and each split's source and target files have equally many lines
    (checked whole, as ``nas.data.prepare_data`` does, before anything is trained or written).

    Raises:
        SpecError: naming the YAML key (``data.train.src``...), the path and the fix; a missing file is
            reported before any file is read.
    """
    pairs = {split: getattr(spec.data, split) for split in ("train", "valid")}
    for split, pair in pairs.items():  # every path first: a missing file is reported before any counting
        for side in ("src", "tgt"):
            f = getattr(pair, side)
            if not f.exists():
                raise SpecError(f"{source}: data.{split}.{side}: {file_problem(f, f'data.{split}.{side}')}")
    for split, pair in pairs.items():
        src_lines = count_lines(pair.src, f"data.{split}.src", source)
        tgt_lines = count_lines(pair.tgt, f"data.{split}.tgt", source)
        if src_lines != tgt_lines:
            raise SpecError(f"{source}: data.{split}: source and target are misaligned: data.{split}.src {pair.src} "
                            f"has {src_lines} lines but data.{split}.tgt {pair.tgt} has {tgt_lines}; line i of one "
                            f"must translate line i of the other: point both keys at the two sides of one corpus "
                            f"(or remove the extra lines)")
