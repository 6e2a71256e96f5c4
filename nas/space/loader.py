"""Reading a sweep YAML from disk: duplicate keys, ``${VAR}`` interpolation, validation, and the checks that
need more than the YAML (data files, ``points_to_evaluate`` against the space, the latency predictor file).

This is the top of the spec layer: it imports the schema, the search space and the torch-free file checks,
and nothing imports it back inside ``nas.space``. No torch, Ray, Optuna or MLflow.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from nas.space.datafiles import check_data_files
from nas.space.errors import SpecError, format_validation_error, key_path
from nas.space.predictor_file import read_predictor_meta, workload_mismatch, workload_of, workload_tag
from nas.space.rebase import rebase_paths
from nas.space.schema import REDACTED, SweepSpec
from nas.space.space import SearchSpace

__all__ = ["apply_overrides", "load_spec", "parse_spec"]


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects a key repeated in one mapping (PyYAML silently keeps the last one, so
    a second ``space:`` section would drop the first). Keys merged in with ``<<:`` may be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first is not key_node.start_mark:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {first.line + 1}); keep one of them",
                    key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def parse_spec(raw: Any, source: str = "<yaml>") -> SweepSpec:
    """Validate a parsed YAML mapping (no file checks, no interpolation).

    Raises:
        SpecError: naming each bad key path, one line per problem (:func:`format_validation_error`).
    """
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: the top level must be a mapping of keys (name, data, supernet, ...)")
    try:
        return SweepSpec.model_validate(raw)
    except ValidationError as e:
        raise SpecError(format_validation_error(e, source, SweepSpec)) from None


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
"""A ``${VAR}`` reference to an environment variable inside a YAML string."""


LOCATION_KEYS = ("name", "workdir", "data")
"""Top-level YAML keys whose ``${VAR}`` references are locations, not secrets (``workdir: ${SCRATCH}/runs``):
logged as they are, since ``nas export`` and ``nas report`` read the run and data folders back from MLflow tags.
A reference in any other key is a secret, masked wherever the spec is logged (:meth:`SweepSpec.redact`)."""


def _interpolate(raw: Any, loc: tuple[Any, ...], secrets: dict[tuple[str, ...], tuple[str, frozenset[str]]],
                 source: str) -> Any:
    """``raw`` with ``${VAR}`` in its string values replaced by the environment's values; ``secrets`` gets, for
    each key path (outside :data:`LOCATION_KEYS`) whose value referenced a non-empty variable, ``(masked,
    values)``: the YAML's string with each reference shown as ``***``, and the substituted string with the
    variables' values.

    Raises:
        SpecError: a referenced variable is not set (names the key path and the variable).
    """
    if isinstance(raw, dict):
        return {k: _interpolate(v, (*loc, k), secrets, source) for k, v in raw.items()}
    if isinstance(raw, list):
        return [_interpolate(v, (*loc, i), secrets, source) for i, v in enumerate(raw)]
    if not isinstance(raw, str):
        return raw

    values: set[str] = set()

    def value(m: re.Match) -> str:
        name = m.group(1)
        if name not in os.environ:
            raise SpecError(f"{source}: {key_path(loc)}: environment variable {name} is not set; export it "
                            f"(e.g. in .env) or write the value in the YAML")
        if os.environ[name]:  # an empty value hides nothing
            values.add(os.environ[name])
        return os.environ[name]

    out = _ENV_REF.sub(value, raw)
    if values and (not loc or loc[0] not in LOCATION_KEYS):
        masked = _ENV_REF.sub(lambda m: REDACTED if os.environ[m.group(1)] else "", raw)
        secrets[tuple(str(k) for k in loc)] = (masked, frozenset({out, *values}))
    return out


def _parse_override(item: str) -> tuple[tuple[str, ...], Any]:
    """``"train.steps=2"`` -> (``("train", "steps")``, ``2``): the value is read as YAML (numbers, lists, ...)."""
    key, sep, value = item.partition("=")
    keys = tuple(key.strip().split("."))
    if not sep or not all(keys):
        raise SpecError(f"--set {item}: expected KEY.PATH=VALUE, e.g. --set train.steps=2")
    try:
        return keys, yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError as e:
        raise SpecError(f"--set {item}: the value is not valid YAML ({getattr(e, 'problem', e)})") from None


def apply_overrides(raw: Any, overrides: tuple[str, ...] | list[str], source: str) -> Any:
    """``raw`` (a parsed YAML mapping, not changed) with each ``KEY.PATH=VALUE`` of ``overrides`` set, in order;
    missing sections are created (validation then names any unknown key), as Hydra's ``+key=value`` and Ray's
    ``--config`` overrides let users cut a YAML down without editing it.

    Raises:
        SpecError: a malformed override, a value that is not YAML, or a key path through a non-mapping value.
    """
    import copy

    out = copy.deepcopy(raw)
    for item in overrides:
        keys, value = _parse_override(item)
        node = out
        for key in keys[:-1]:
            if not isinstance(node, dict):
                break
            node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise SpecError(f"{source}: --set {item}: {'.'.join(keys[:-1])} is not a section (a mapping) in the "
                            f"YAML, so it has no key {keys[-1]!r}")
        node[keys[-1]] = value
    return out


def load_spec(path: str | Path, *, check_files: bool = True, check_predictor: bool | None = None,
              overrides: tuple[str, ...] | list[str] = (), base_dir: str | Path | None = None) -> SweepSpec:
    """Read and validate a sweep YAML; nothing is started or written, and torch is not imported.

    String values may reference environment variables as ``${VAR}``; the substituted values are kept on the
    spec so that :meth:`SweepSpec.redact` hides them wherever the spec is logged.

    Raises:
        SpecError: unreadable file, malformed YAML (with the line number), a ``${VAR}`` whose variable is not
            set, an unknown key
            (with a suggestion), a duplicated key, a wrong type, an impossible space, or
            (``check_files``) a data file that is missing, a folder, unreadable, not gzip/UTF-8 text
            or empty, or source and target files of a split with different line counts; or
            (``check_predictor``, default ``check_files``) a ``search.latency_predictor`` that is missing or
            fitted for another model_dim or latency workload; each names the key path; or a malformed
            ``overrides`` item.

    ``overrides``: ``KEY.PATH=VALUE`` items (``nas sweep FILE --set train.steps=2``) applied to the YAML before
    validation (:func:`apply_overrides`); the spec then keeps the effective YAML (:meth:`SweepSpec.yaml_text`),
    which the sweep saves as its copy, so ``--resume`` continues with the same values.

    ``base_dir``: the folder that relative paths (data files, ``workdir``, ``data.cache_dir``, ...) are relative to,
    default the current one (:func:`nas.space.rebase.rebase_paths`).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError(f"cannot read sweep file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save the file as UTF-8") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # the safe loader, plus duplicate-key errors
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError(f"{path}:{where}: malformed YAML: {getattr(e, 'problem', e)}") from None
    source_text = None
    if overrides:
        if not isinstance(raw, dict):
            raise SpecError(f"{path}: the top level must be a mapping of keys (name, data, supernet, ...)")
        raw = apply_overrides(raw, overrides, str(path))
        source_text = (f"# {path} with --set {' --set '.join(overrides)}\n"
                       + yaml.safe_dump(raw, sort_keys=False, allow_unicode=True))
    secrets: dict[tuple[str, ...], tuple[str, frozenset[str]]] = {}
    raw = _interpolate(raw, (), secrets, str(path))
    if base_dir is not None:
        raw = rebase_paths(raw, Path(base_dir), SweepSpec)
    source = f"{path} (with --set {', '.join(overrides)})" if overrides else str(path)
    spec = parse_spec(raw, source).keep_secrets(secrets).keep_source(source_text)
    _check_points(spec, str(path))
    if check_files:
        check_data_files(spec, str(path))
    if check_files if check_predictor is None else check_predictor:
        _check_latency_predictor(spec, str(path))
    return spec


def _check_points(spec: SweepSpec, source: str) -> None:
    """Every ``search.points_to_evaluate`` mapping names parameters of this space with allowed values.

    Raises:
        SpecError: naming the point's index and the parameter.
    """
    space = SearchSpace.from_spec(spec)
    for i, point in enumerate(spec.search.points_to_evaluate):
        if isinstance(point, dict):
            why = space.check_params(point)
            if why is not None:
                raise SpecError(f"{source}: search.points_to_evaluate.{i}: {why}")


def _check_latency_predictor(spec: SweepSpec, source: str) -> None:
    """``search.latency_predictor`` exists and was fitted for this supernet's model_dim and the YAML's latency
    workload (``search.latency_workload``; read without torch: :func:`read_predictor_meta`).

    Raises:
        SpecError: naming the key, the file and the fix.
    """
    path = spec.search.latency_predictor
    if path is None:
        return
    fix = f"write one with `nas latency fit {source} --out {path}`"
    if not path.is_file():
        raise SpecError(f"{source}: search.latency_predictor: file not found: {path}; "
                        f"{fix}")
    try:
        meta = read_predictor_meta(path)
    except Exception as e:  # a file that is not a predictor: any reader error says so
        raise SpecError(f"{source}: search.latency_predictor: {path} is not a latency predictor ({e}); {fix}") from None
    model_dim, workload = meta["model_dim"], workload_of(spec.search)
    if model_dim != spec.supernet.model_dim:
        raise SpecError(f"{source}: search.latency_predictor: {path} was fitted for model_dim {model_dim}, "
                        f"but supernet.model_dim is {spec.supernet.model_dim}; {fix}")
    diff = workload_mismatch(meta["workload"], workload)
    if diff:
        raise SpecError(f"{source}: search.latency_predictor: {path} predicts latency workload "
                        f"{workload_tag(meta['workload'])}, but trials time search.latency_workload "
                        f"{workload_tag(workload)} ({diff}); {fix}")
