""":class:`DataError`, the error every module of :mod:`nas.data` raises for bad data input."""

from __future__ import annotations

from nas.errors import NasError

__all__ = ["DataError"]


class DataError(NasError):
    """Bad data input; the message names the file and what would fix it."""
