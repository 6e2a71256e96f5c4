"""``search.points_to_evaluate``: the sub-Transformers a search scores first, in the forms a user writes them.

An entry is one of:

- a reference sub-Transformer of the space: ``widest``, ``narrowest`` or ``middle``;
- an arch as ``nas retrain --arch`` reads it (:meth:`nas.space.arch.Arch.parse`): a summary string
  ``"enc[128/256 128/256] dec[128/256 128/256]"`` or arch JSON;
- a named arch, ``{name: tiny, arch: "enc[...] dec[...]"}`` (:class:`ArchPoint`);
- ``{file: baselines.yaml}``: the named archs of a YAML file that maps names to archs, its path relative to the
  sweep YAML's folder. :func:`nas.space.loader.load_spec` reads it and puts its archs in its place as named archs,
  so a spec never holds the file, and the copy a sweep saves holds the archs;
- a mapping of Optuna parameters, ``{encoder.layers: 2, decoder.width.0: 128}`` (those left out are sampled).

Every entry has a name (:func:`point_name`), which the trial it starts is tagged with (MLflow tag ``nas.point``)
and the leaderboard shows. Whether an arch lies inside the space is checked by the loader, which has the space
(:meth:`nas.space.space.SearchSpace.point_params`). Pydantic, the standard library and :mod:`nas.space.arch` only.
"""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Union

from pydantic import BeforeValidator, Discriminator, Tag, field_validator

from nas.errors import ArchError
from nas.space.arch import Arch
from nas.space.schema.base import StrictModel

__all__ = ["REFERENCE_POINTS", "ArchPoint", "PointSpec", "point_name", "is_arch_point", "named_arch_problem",
           "POINT_EXAMPLE"]

REFERENCE_POINTS = ("widest", "narrowest", "middle")
"""Names of the space's reference sub-Transformers (:meth:`nas.space.space.SearchSpace.references`)."""

POINT_EXAMPLE = '"enc[128/256 128/256] dec[128/256 128/256]"'
"""An arch summary as error messages show it."""

_FORMS = (f"widest, narrowest, middle, an arch ({POINT_EXAMPLE}), {{name: NAME, arch: ARCH}}, {{file: FILE.yaml}} "
          f"or a mapping of Optuna parameters ({{encoder.layers: 2}})")
"""The forms of a ``points_to_evaluate`` entry, for error messages."""

_NAME = re.compile(r"^[A-Za-z0-9_.+-]{1,64}$")
"""A point name: 1-64 letters, digits and ``_.+-`` (an MLflow tag value and a table cell)."""


def _check_name(name: Any) -> str | None:
    """Why ``name`` cannot name a point, or None."""
    if not isinstance(name, str) or not _NAME.match(name):
        return f"name {name!r} must be 1-64 letters, digits or _.+- (e.g. tiny, Transformer-Tiny)"
    if name in REFERENCE_POINTS:
        return f"name {name!r} is a reference sub-Transformer's; pick another name"
    return None


def _check_arch(text: Any) -> str | None:
    """Why ``text`` is no arch string, or None."""
    if not isinstance(text, str):
        return f"arch {text!r} is not a string; write it as {POINT_EXAMPLE}"
    try:
        Arch.parse(text)
    except ArchError as e:
        return str(e)
    return None


class ArchPoint(StrictModel):
    """A named sub-Transformer to score: an arch the user designed (a published baseline, the model in
    production), so that the leaderboard shows where it lands among the searched ones."""

    name: str
    """Its label (1-64 letters, digits or ``_.+-``): the trial's MLflow tag ``nas.point`` and the leaderboard's
    ``point`` column."""
    arch: str
    """The arch as ``nas retrain --arch`` reads it: a summary (``enc[128/256 128/256] dec[128/256]``, one
    ``width/ffn_width`` token per layer) or arch JSON (:meth:`nas.space.arch.Arch.parse`)."""

    @field_validator("name")
    @classmethod
    def _named(cls, name: str) -> str:
        why = _check_name(name)
        if why is not None:
            raise ValueError(why)
        return name

    @field_validator("arch")
    @classmethod
    def _parses(cls, text: str) -> str:
        why = _check_arch(text)
        if why is not None:
            raise ValueError(why)
        return text

    def parsed(self) -> Arch:
        """The :class:`Arch` of :attr:`arch`."""
        return Arch.parse(self.arch)


def named_arch_problem(name: Any, arch: Any) -> str | None:
    """Why ``name: arch`` is no named arch (a bad name, an arch string that does not parse), or None."""
    return _check_name(name) or _check_arch(arch)


def _check_point(value: Any) -> Any:
    """A ``points_to_evaluate`` entry checked on its own (the space is the loader's): a reference name or an arch
    string, a named arch (made an :class:`ArchPoint`), or a mapping of parameters (checked by the loader).

    Raises:
        ValueError: none of the forms (the message lists them), a reference misspelt (with the closest), an arch
            that does not parse, a named arch with other keys, or an unread ``{file: ...}``.
    """
    if isinstance(value, str):
        if value in REFERENCE_POINTS:
            return value
        if "[" not in value and not value.lstrip().startswith("{"):
            close = difflib.get_close_matches(value, REFERENCE_POINTS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{value!r} is not a point{hint}; write {_FORMS}")
        why = _check_arch(value)
        if why is not None:
            raise ValueError(why)
        return value
    if isinstance(value, ArchPoint):
        return value
    if isinstance(value, dict) and "file" in value:
        raise ValueError(f"{{file: {value['file']}}} was not read: only load_spec (nas sweep FILE, nas.load_spec) "
                         f"reads point files, relative to the sweep YAML")
    if isinstance(value, dict) and ("arch" in value or "name" in value):
        if set(value) != {"name", "arch"}:
            extra = sorted(map(str, set(value) - {"name", "arch"}))
            missing = sorted({"name", "arch"} - set(value))
            what = f"unknown key(s) {', '.join(extra)}" if extra else f"missing {', '.join(missing)}"
            raise ValueError(f"a named arch is {{name: NAME, arch: ARCH}}, with nothing else ({what})")
        why = named_arch_problem(value["name"], value["arch"])
        if why is not None:
            raise ValueError(why)
        return ArchPoint(name=value["name"], arch=value["arch"])
    if not isinstance(value, dict):
        raise ValueError(f"{value!r} is not a point; write {_FORMS}")
    return value


def _kind(value: Any) -> str:
    """The union member of a checked entry (:func:`_check_point` ran first)."""
    return "named" if isinstance(value, ArchPoint) else "params" if isinstance(value, dict) else "text"


PointSpec = Annotated[
    Union[Annotated[ArchPoint, Tag("named")], Annotated[str, Tag("text")],
          Annotated[dict[str, Union[int, str]], Tag("params")]],
    Discriminator(_kind), BeforeValidator(_check_point)]
"""One ``points_to_evaluate`` entry: a reference name or an arch string (``str``), a named arch
(:class:`ArchPoint`) or a mapping of Optuna parameters (``dict``)."""


def is_arch_point(point: Any) -> bool:
    """Whether ``point`` is a whole arch the user wrote (an arch string or an :class:`ArchPoint`), as opposed to a
    reference of the space or a partial mapping of parameters. With ``search.method: evolution`` level 2 scores
    these whatever level 1 finds."""
    return isinstance(point, ArchPoint) or (isinstance(point, str) and point not in REFERENCE_POINTS)


def point_name(point: Any, index: int) -> str:
    """The name of entry ``index`` of ``points_to_evaluate`` (the trial's MLflow tag ``nas.point``): a reference's
    (``narrowest``), a named arch's (``tiny``), else ``points_to_evaluate.<index>``."""
    if isinstance(point, ArchPoint):
        return point.name
    if isinstance(point, str) and point in REFERENCE_POINTS:
        return point
    return f"points_to_evaluate.{index}"
