"""The whole sweep YAML (:class:`SweepSpec`): its sections, the checks that span them, the values derived from
several, and the hiding of values interpolated from the environment (:meth:`SweepSpec.redact`).

Reading it from disk is :func:`nas.space.loader.load_spec`. Pydantic and the standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, PrivateAttr, model_validator

from nas.redact import REDACTED
from nas.space.recipe import RetrainSpec
from nas.space.schema.base import StrictModel
from nas.space.schema.data import DataSpec
from nas.space.schema.resources import ResourcesSpec
from nas.space.schema.search import SearchSpec
from nas.space.schema.space import SpaceSpec, check_space
from nas.space.schema.supernet import SupernetSpec
from nas.space.schema.tracking import TrackingSpec
from nas.space.schema.train import TrainSpec

__all__ = ["MIN_SECRET_CHARS", "SweepSpec"]

# REDACTED (:mod:`nas.redact`) is what values interpolated from the environment (``${VAR}``) are replaced by
# wherever the spec is logged.


MIN_SECRET_CHARS = 6
"""A value interpolated from ``${VAR}`` is replaced inside free text only from this length on (by key always)."""


class SweepSpec(StrictModel):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$")
    data: DataSpec
    supernet: SupernetSpec
    space: SpaceSpec = SpaceSpec()
    train: TrainSpec = TrainSpec()
    search: SearchSpec = SearchSpec()
    resources: ResourcesSpec = ResourcesSpec()
    tracking: TrackingSpec = TrackingSpec()
    retrain: RetrainSpec = RetrainSpec()
    """The recipe of ``nas retrain`` (:class:`~nas.space.recipe.RetrainSpec`)."""
    workdir: Path = Path("nas_runs")
    """Where checkpoints, the Optuna journal and Ray results go (a folder per sweep name)."""
    _secrets: dict[tuple[str, ...], tuple[str, frozenset[str]]] = PrivateAttr(default_factory=dict)
    """Key path -> (masked, values) of every string ``load_spec`` substituted a ``${VAR}`` into (see :meth:`redact`)."""

    _source_text: str | None = PrivateAttr(default=None)
    """The YAML text this spec was read from when ``--set`` overrides changed it (:meth:`yaml_text`)."""

    def keep_source(self, text: str | None) -> "SweepSpec":
        """Remember the effective YAML text (the file's, with ``--set`` overrides applied); returns this spec."""
        self._source_text = text
        return self

    def yaml_text(self, path: str | Path) -> str:
        """The YAML the spec was read from: the effective text :meth:`keep_source` kept (``--set`` overrides
        applied), else the file ``path`` as it is. ``${VAR}`` references are kept, not substituted."""
        if self._source_text is not None:
            return self._source_text
        return Path(path).read_text(encoding="utf-8")

    def keep_secrets(self, secrets: Mapping[tuple[str, ...], tuple[str, frozenset[str]]]) -> "SweepSpec":
        """Remember the strings that ``${VAR}`` references were substituted into, by YAML key path:
        ``("tracking", "optuna_storage")`` -> (the YAML's string with each reference shown as ``***``, the
        substituted string and the variables' values), so that :meth:`redact` hides them; returns this spec."""
        self._secrets = dict(secrets)
        return self

    def redact(self, obj: Any, path: tuple[str, ...] = ()) -> Any:
        """``obj`` with every value interpolated from the environment hidden; use it on whatever is logged or
        written.

        By key: in a mapping (nested, or flat with dotted keys such as MLflow params, both rooted at the YAML's
        top level), the value at a key path that the YAML filled from ``${VAR}`` becomes the YAML's string with
        each reference shown as ``***``. A string outside such a key, or ``obj`` itself when it is a string,
        has each substituted string and variable value of at least :data:`MIN_SECRET_CHARS` characters
        replaced by ``***`` (a shorter one, ``1`` or ``nas``, would mangle unrelated text; a password in a
        URL is masked by :func:`nas.redact.redact_url` wherever one is shown).
        """
        if not self._secrets:
            return obj
        if path in self._secrets:
            return self._secrets[path][0]
        if isinstance(obj, str):
            values = {v for _, vs in self._secrets.values() for v in vs if len(v) >= MIN_SECRET_CHARS}
            for value in sorted(values, key=len, reverse=True):
                obj = obj.replace(value, REDACTED)
            return obj
        if isinstance(obj, Mapping):
            return {k: self.redact(v, (*path, *str(k).split("."))) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.redact(v, (*path, str(i))) for i, v in enumerate(obj))
        return obj

    @property
    def experiment(self) -> str:
        return self.tracking.experiment or self.name

    @property
    def run_dir(self) -> Path:
        return self.workdir / self.name

    @property
    def max_branches(self) -> int:
        """The most attention branches any sub-Transformer of the space has (1: no MAT branches)."""
        if self.supernet.branches is not None:
            return self.supernet.branches
        dim = self.space.branches
        return max((v for v in (dim.values or []) if isinstance(v, int)), default=1) if dim is not None else 1

    @property
    def drop_branch(self) -> float:
        """The drop-branch rate rho in use: ``train.drop_branch``, default 0.1 with branches, else 0."""
        if self.train.drop_branch is not None:
            return self.train.drop_branch
        return 0.1 if self.max_branches > 1 else 0.0

    @property
    def io_projection(self) -> bool:
        """Whether the supernet has the eq. 3 input/output projections (Scalable Transformers)."""
        if self.supernet.io_projection is not None:
            return self.supernet.io_projection
        return self.space.model_width is not None

    @model_validator(mode="after")
    def _check_space(self) -> "SweepSpec":
        sn, sp = self.supernet, self.space
        if sn.head_dim is None and sn.model_dim % sn.heads:
            raise ValueError(f"supernet.model_dim={sn.model_dim} is not divisible by supernet.heads={sn.heads}; "
                             f"change one, or set supernet.head_dim")
        if self.train.drop_branch and self.max_branches == 1:
            raise ValueError(f"train.drop_branch={self.train.drop_branch}, but the space has no branches (MAT "
                             f"drop-branch drops attention branches and the FFN): remove train.drop_branch, or "
                             f"add space.branches with values above 1")
        check_space(sp, sn)
        return self
