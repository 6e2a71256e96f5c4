"""The sweep YAML's ``tracking:`` section: the MLflow experiment and the Optuna study storage
(:class:`TrackingSpec`, :data:`OPTUNA_STORAGE_SCHEMES`). Pydantic only.
"""

from __future__ import annotations

from pydantic import field_validator

from nas.space.schema.base import StrictModel

__all__ = ["OPTUNA_STORAGE_SCHEMES", "TrackingSpec"]


OPTUNA_STORAGE_SCHEMES = ("postgresql", "postgresql+psycopg", "postgresql+psycopg2")


class TrackingSpec(StrictModel):
    experiment: str | None = None
    """MLflow experiment; default: the sweep's name."""
    optuna_storage: str | None = None
    """Optuna study storage: a PostgreSQL URL ``postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE`` (Optuna
    ``RDBStorage``; ``postgresql+psycopg2://`` for psycopg2), shared by every driver that resumes the sweep.
    None: a journal file ``<workdir>/<name>/optuna.journal`` (Optuna ``JournalFileBackend``)."""

    @field_validator("optuna_storage")
    @classmethod
    def _check_optuna_storage(cls, url: str | None) -> str | None:
        if url is None:
            return url
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in OPTUNA_STORAGE_SCHEMES:
            raise ValueError(f"{scheme + sep if sep else url!r} is not a PostgreSQL URL; write "
                             "postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE (or leave tracking.optuna_storage "
                             "out for the journal file <workdir>/<name>/optuna.journal)")
        if "/" not in rest or not rest.rsplit("/", 1)[1]:
            raise ValueError(f"{scheme}://... names no database; write {scheme}://USER@HOST:PORT/DATABASE")
        return url
