"""Deprecated alias of the split spec modules, kept only while ``trainers/`` and ``nas/fidelity.py`` still
import ``nas.space.spec``; import from :mod:`nas.space` (or :mod:`nas.space.schema`, :mod:`nas.space.loader`,
:mod:`nas.space.errors`, :mod:`nas.space.constraints`) instead. Delete this file once nothing imports it.
"""

from nas.space.constraints import METRIC_NAMES, Constraint, parse_constraint
from nas.space.errors import SpecError
from nas.space.loader import load_spec, parse_spec
from nas.space.schema import *  # noqa: F401,F403  (the pydantic models, by their schema.__all__)
from nas.space import schema

__all__ = [*schema.__all__, "SpecError", "load_spec", "parse_spec", "Constraint", "parse_constraint", "METRIC_NAMES"]
