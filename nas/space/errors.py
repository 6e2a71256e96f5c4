"""Errors of the sweep YAML: :class:`SpecError`, and pydantic's validation errors rewritten as one line per
problem, ``<file>: <key path>: <what is wrong and the fix>`` (with "did you mean" for an unknown key)."""

from __future__ import annotations

import collections
import difflib
import re
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from nas.errors import NasError

__all__ = ["SpecError", "format_validation_error", "key_path"]


class SpecError(NasError):
    """A sweep YAML that cannot run; the message names the file, the key path and the fix."""


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models inside an annotation (through ``list[...]``, ``Union``, ``Annotated``, ``| None``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _did_you_mean(loc: tuple[Any, ...], model: type[BaseModel]) -> str:
    """Suggest the closest allowed key for an unknown key at ``loc`` (list indices and the ``name`` tags of
    discriminated unions such as ``train.stages.0.seq_distill`` are followed)."""
    models = [model]
    for part in loc[:-1]:
        if isinstance(part, int):  # a list index: the model is the list's item type
            continue
        tagged = [m for m in models if "name" in m.model_fields
                  and typing.get_args(m.model_fields["name"].annotation) == (part,)]
        if tagged:
            models = tagged
            continue
        field = next((m.model_fields[part] for m in models if part in m.model_fields), None)
        models = _models_in(field.annotation) if field is not None else []
        if not models:
            return ""
    model = models[0]
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    return f" (did you mean '{close[0]}'?)" if close else f" (allowed: {', '.join(model.model_fields)})"


_SUGGESTED = re.compile(r"^ \(did you mean '(.*)'\?\)$")
"""A :func:`_did_you_mean` hint that names one key (group 1)."""

_UNION_MEMBER = re.compile(r"^(int|str|float|bool|none|list\[.*\]|dict\[.*\]|tuple\[.*\])$")
"""The pseudo keys pydantic puts in an error's location for the members of a plain union (``int | str``)."""


def _merge_union_errors(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One error per value that fits no member of a union such as ``int | str | list[int]`` (pydantic reports it
    once per member, under the pseudo keys ``.int``, ``.str``, ``.list[int]``): the inner error when the value
    was a container of the right kind (``[3, 'a']``: item 1 is not an integer), else the members' messages joined."""
    keyed: list[tuple[tuple | None, tuple]] = []  # per error: (location of the value, location inside the member)
    for e in errors:
        loc = tuple(e["loc"])
        tags = [i for i, part in enumerate(loc) if isinstance(part, str) and _UNION_MEMBER.match(part)]
        ok = tags and e["type"] != "extra_forbidden"
        keyed.append((loc[:tags[-1]], loc[tags[-1] + 1:]) if ok else (None, ()))
    sizes = collections.Counter(prefix for prefix, _ in keyed if prefix is not None)
    merged: list[dict[str, Any]] = []
    done: set[tuple] = set()
    for e, (prefix, _) in zip(errors, keyed):
        if prefix is None or sizes[prefix] < 2:
            merged.append(e)
            continue
        if prefix in done:
            continue
        done.add(prefix)
        members = [(rest, m) for m, (p, rest) in zip(errors, keyed) if p == prefix]
        inner = [{**m, "loc": prefix + rest} for rest, m in members if rest]
        if inner:
            merged += inner
        else:
            msgs = [m["msg"].removeprefix("Input should be ").replace(", ", " (", 1) for _, m in members]
            msgs = [msg + ")" if " (" in msg else msg for msg in msgs]  # "a valid integer (unable to parse ...)"
            merged.append({"type": "union", "loc": prefix, "input": members[0][1].get("input"),
                           "msg": f"Input should be {', '.join(msgs[:-1])} or {msgs[-1]}"})
    return merged


def _key_text(part: Any) -> str:
    text = str(part)
    return text if text and text.isprintable() and text.strip() == text else repr(part)


def key_path(loc: tuple[Any, ...]) -> str:
    """A YAML key path as written in error messages: ``("space", "width", 0)`` -> ``space.width.0``; keys that
    are empty, unprintable or padded with spaces are quoted (``repr``); ``<top level>`` for ``()``."""
    return ".".join(_key_text(p) for p in loc) or "<top level>"


def _short_repr(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def format_validation_error(err: ValidationError, source: str, model: type[BaseModel]) -> str:
    """One line per problem: ``<file>: <key path>: <what is wrong and the fix>``; a required key that is missing
    because it was misspelt is named once, by the unknown key's did-you-mean line.

    Args:
        err: what ``model.model_validate`` raised.
        source: the file name to start each line with.
        model: the validated model (unknown keys get the closest allowed key of the model they are in).
    """
    lines = []
    errors = _merge_union_errors(err.errors())
    hints = {tuple(e["loc"]): _did_you_mean(tuple(e["loc"]), model) for e in errors
             if e["type"] in ("extra_forbidden", "invalid_key")}
    misspelt = {loc[:-1] + (m.group(1),) for loc, hint in hints.items() if (m := _SUGGESTED.match(hint))}
    for e in errors:
        loc = tuple(e["loc"])
        if e["type"] == "missing" and loc in misspelt:  # a misspelt key: its did-you-mean line names it
            continue
        path = key_path(loc)
        hint = hints.get(loc, "")
        if e["type"] == "extra_forbidden" or hint:  # invalid_key: a number, boolean or null where a name goes
            line = f"{source}: {path}: unknown key{hint}"
        elif e["type"] == "missing":
            line = f"{source}: {path}: required key is missing"
        elif e["type"] == "value_error":
            msg = str(e.get("ctx", {}).get("error", e["msg"]))
            line = f"{source}: {path + ': ' if loc else ''}{msg}"
        else:
            line = f"{source}: {path}: {e['msg']} (got {_short_repr(e.get('input'))})"
        lines.append(line.replace("\r", "\\r").replace("\n", "\\n"))  # one line per problem, whatever the values
    return "\n".join(lines)
