"""The one family of errors that means "bad user input".

The CLI turns a `NasError` into one line on stderr and exit status 2; every other
exception is a bug and keeps its traceback (exit status 1). Raise a subclass of
`NasError` where a value the user gave (a YAML key, a file, a flag) is wrong, and name
that value and what would fix it in the message (STYLE habit 9).

This module imports nothing from `nas`: every layer may raise these.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["error_chain", "NasError", "NotFoundError", "OutputPathError", "DiskFullError", "ArchError", "PredictorFileError",
           "MissingFileError", "DamagedFileError"]


class NasError(ValueError):
    """Bad user input: a YAML key, a data file, a flag, a backend address or a stored run.

    Subclasses `ValueError` so that code catching `ValueError` for a bad value keeps working;
    the CLI catches `NasError` only, so a plain `ValueError` raised by a bug is reported
    as a bug (traceback, exit 1), not as bad input.
    """


class NotFoundError(NasError, LookupError):
    """A run, sweep, experiment or trial the user named does not exist (names it and how to create it)."""


class MissingFileError(NasError, FileNotFoundError):
    """A file the user pointed at (an export folder's `model.safetensors`, a model's config) does not exist
    (names it and the command that writes it). Also a `FileNotFoundError`, so callers that caught that keep
    working."""


class DamagedFileError(NasError):
    """A file the user pointed at exists but cannot be read: truncated weights, invalid JSON, weights that do not
    fit their config (names the file, what is wrong and the command that writes it again)."""


class OutputPathError(NasError):
    """An output path the user gave (`--out`) is unsafe to write: a folder where a file is wanted, the current
    folder or one of its ancestors, the home folder, or a folder holding files that an earlier output did not
    write (names the path, a few of its entries, and the fix)."""


class DiskFullError(NasError):
    """A file could not be written because its disk is full, its quota is used up or it hit the file-size
    limit (`ENOSPC`, `EDQUOT`, `EFBIG`). The message names the file, the space left and the fix; the file
    it was replacing is kept as it was (`nas.atomic.atomic_path`). `errno` holds the system's code.

    Not bad input in the strict sense, but the fix is the user's (free space, or write elsewhere), so the
    CLI reports it in one line (exit 2) rather than as a bug."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class ArchError(NasError):
    """A sub-Transformer description the user gave (an `arch.json`, an arch dict, an `--arch` value) is
    malformed or outside the supernet it is run on (names the stack, the choice, the layer and the limit)."""


class PredictorFileError(NasError):
    """A latency-predictor file (`search.latency_predictor`, `nas latency ...`) is not one `nas latency fit`
    wrote, or was fitted for other features (names the file and how to refit it)."""


def error_chain(error: BaseException | None) -> Iterator[BaseException]:
    """`error`, then what caused it (`__cause__`, else `__context__`), and so on, each once: where a
    library wraps the error that matters (Optuna's `StorageInternalError`, a writer's `RuntimeError`)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__

